"""The evaluation entry points (``echo-rl eval poker`` / ``echo-rl eval math``), kept tiny."""

import json
import math
from pathlib import Path

import pytest

from echo_rl.adapters import math_eval
from echo_rl.adapters.hf import HFModel
from echo_rl.adapters.poker import eval as poker_eval

DATA = Path(__file__).resolve().parents[1] / "examples" / "data" / "arith.jsonl"


@pytest.fixture(scope="module")
def tiny():
    return HFModel("tiny-qwen3", max_positions=1024)


def run_folder(tmp_path, config: dict, state: dict) -> Path:
    """An Echo run folder as the learner leaves it: config.toml and one checkpoint."""
    import torch

    from echo_rl.core.config import EchoConfig, dump_toml

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.toml").write_text(dump_toml(EchoConfig.model_validate(config)))
    torch.save({"model": state}, run / "checkpoints" / "step-00000003.pt")
    (run / "checkpoints" / "latest").write_text("step-00000003.pt")
    return run


def test_confidence_intervals():
    m, ci = poker_eval.mean_ci([1.0, -1.0, 1.0, -1.0])
    assert m == 0 and ci == pytest.approx(1.96 * math.sqrt(4 / 3) / 2)
    lo, hi = math_eval.wilson(0, 40)
    assert lo == 0 and 0.05 < hi < 0.1
    lo, hi = math_eval.wilson(20, 40)
    assert lo < 0.5 < hi


def test_poker_eval_rule_based_hero_table_layout(capsys, tmp_path):
    out = tmp_path / "res.json"
    assert (
        poker_eval.main(["--model", "rule:station", "--hands", "4", "--no-llm", "--json", str(out)])
        == 0
    )
    text = capsys.readouterr().out
    assert "Rule-based1 (tag)" in text and "Rule-based3 (maniac)" in text and "±" in text
    res = json.loads(out.read_text())
    assert [c["opponent"] for c in res["columns"]] == ["tag", "station", "maniac"]
    assert all(c["hands"] == 4 and c["invalid_rate"] == 0 for c in res["columns"])


def test_poker_eval_model_with_frozen_llm_opponent(tiny):
    res = poker_eval.evaluate("tiny-qwen3", 2, hero=tiny, max_new_tokens=3, bot_samples=4)
    assert [c["column"] for c in res["columns"]] == [
        "Rule-based1",
        "Rule-based2",
        "Rule-based3",
        "LLM",
    ]
    assert all(math.isfinite(c["mean_bb"]) and c["decisions"] >= 1 for c in res["columns"])
    assert "LLM" in poker_eval.table(res)


def test_math_eval(tiny, capsys, tmp_path):
    res = math_eval.evaluate("tiny-qwen3", str(DATA), limit=4, max_new_tokens=3, hero=tiny)
    assert res["n"] == 4 and 0 <= res["accuracy"] <= 1 and len(res["examples"]) == 3
    out = tmp_path / "m.json"
    assert (
        math_eval.main(
            [
                "--model",
                "tiny-qwen3",
                "--data",
                str(DATA),
                "--limit",
                "3",
                "--max-new-tokens",
                "2",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    assert "accuracy" in capsys.readouterr().out and json.loads(out.read_text())["n"] == 3
    assert math_eval.main(["--model", "tiny-qwen3", "--data", str(tmp_path / "none.jsonl")]) == 2


def test_models_load_from_an_echo_run_folder(tmp_path, tiny):
    import torch

    state = {k: v + 0.01 for k, v in tiny.model.state_dict().items()}
    run = run_folder(
        tmp_path,
        {
            "model": {"max_positions": 1024},
            "adapter": {"name": "poker", "options": {"obs_format": "compact"}},
        },
        state,
    )
    m = HFModel(str(run))
    w = "model.embed_tokens.weight"
    assert torch.equal(m.model.state_dict()[w], state[w])
    assert m.run_config.adapter.options["obs_format"] == "compact"


def test_a_run_folder_is_evaluated_as_it_trained(tmp_path, tiny):
    """The hero answers with the run's token budget and sees the run's observation options: a
    policy trained on one-letter answers given 32 tokens says "c5..." (invalid), and one
    trained without all-in must not be handed it."""
    run = run_folder(
        tmp_path,
        {
            "model": {"max_positions": 1024},
            "worker": {"max_new_tokens": 1},
            "adapter": {
                "name": "poker",
                "options": {
                    "obs_format": "compact",
                    "strength_hint": True,
                    "allin": False,
                    "bot_samples": 4,
                },
            },
        },
        tiny.model.state_dict(),
    )
    hero = HFModel(str(run))
    budgets = []
    real = hero.generate
    hero.generate = lambda prompts, n, t=0.0: budgets.append(n) or real(prompts, n, t)
    res = poker_eval.evaluate(str(run), 2, hero=hero, llm=False, bot_samples=4)
    assert budgets and set(budgets) == {1}
    assert res["options"]["strength_hint"] is True and res["options"]["allin"] is False
    res = poker_eval.evaluate(str(run), 1, hero=hero, llm=False, bot_samples=4, max_new_tokens=3)
    assert budgets[-1] == 3  # an explicit budget still wins


def test_a_run_with_restricted_answers_is_evaluated_with_them(tmp_path, tiny):
    """A run trained on answer_letters is played from its softmax over those letters: the
    untrained tiny model, free, answers mostly non-actions (played as check or fold)."""
    cfg = {
        "model": {"max_positions": 1024},
        "worker": {"max_new_tokens": 1},
        "adapter": {
            "name": "poker",
            "options": {
                "obs_format": "strength",
                "allin": False,
                "answer_letters": "fcb",
                "bot_samples": 4,
            },
        },
    }
    run = run_folder(tmp_path, cfg, tiny.model.state_dict())
    hero = HFModel(str(run))
    res = poker_eval.evaluate(str(run), 6, hero=hero, llm=False, bot_samples=4)
    assert hero.answer_tokens == (23, 20, 19)  # f, c, b
    # only a "b" when no raise is left (facing an all-in) is invalid now
    rate = lambda r: (  # noqa: E731
        sum(c["invalid_rate"] * c["decisions"] for c in r["columns"])
        / sum(  # noqa: E731
            c["decisions"] for c in r["columns"]
        )
    )
    assert rate(res) < 0.25
    cfg["adapter"]["options"]["answer_letters"] = ""
    free = poker_eval.evaluate(
        str(run_folder(tmp_path / "free", cfg, tiny.model.state_dict())),
        6,
        llm=False,
        bot_samples=4,
    )
    assert rate(free) > 0.5
