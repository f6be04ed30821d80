"""``echo-rl eval --run-dir``: any adapter's mean reward with a 95 % interval, paired comparisons,
held-out splits, LoRA checkpoints, and errors that name the problem and the fix.

Run folders are built as the learner leaves them (config.toml, checkpoints/after-N.pt, latest)
around the tiny model, with checkpoints of perturbed weights: no learner needed.
"""

from __future__ import annotations

import itertools
import json
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest

from echo_rl.cli.commands.evaluate import (
    EvalError,
    describe,
    eval_prompts,
    evaluate,
    main,
    resolve_policy,
)
from echo_rl.core.ci import mean_ci, paired_ci, t975

ROOT = Path(__file__).resolve().parents[1]
TINY = {
    "name": "tiny-qwen3",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_layers": 1,
    "num_heads": 2,
    "num_kv_heads": 1,
    "head_dim": 16,
    "max_positions": 512,
}


def make_run(
    tmp_path: Path, config: dict, steps=(3,), noise: float = 0.5, name: str = "run"
) -> Path:
    """A run folder: config.toml and one checkpoint per step, each the initial weights plus
    seeded noise (a LoRA run's: its adapter's tensors alone, lora_B made non-zero)."""
    import torch

    from echo_rl.core.config import EchoConfig, dump_toml
    from echo_rl.core.lora import adapter_parameters, load_policy_model
    from echo_rl.core.models import load_tokenizer
    from echo_rl.learner.checkpoint import checkpoint_name

    cfg = EchoConfig.model_validate({"model": TINY, **config})
    run = tmp_path / name
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.toml").write_text(dump_toml(cfg))
    lora = cfg.learner.lora if cfg.learner.lora.enabled else None
    model, _ = load_policy_model(cfg.model, lora, load_tokenizer(cfg.model))
    base = adapter_parameters(model) if lora else dict(model.named_parameters())
    for step in steps:
        g = torch.Generator().manual_seed(step)
        sd = {k: v.detach() + noise * torch.randn(v.shape, generator=g) for k, v in base.items()}
        name = checkpoint_name(step)  # the policy after `step` steps, as the learner names it
        torch.save({"step": step - 1, "model": sd}, run / "checkpoints" / name)
        (run / "checkpoints" / "latest").write_text(name)
    return run


# ----------------------------------------------------------------- the interval


def test_mean_ci_on_known_numbers():
    ci = mean_ci([1.0, 2.0, 3.0, 4.0, 5.0])
    # s = sqrt(2.5), t(0.975, 4) = 2.776: half-width 2.776 * 1.5811 / sqrt(5) = 1.9630
    assert ci.mean == 3.0 and ci.std == pytest.approx(math.sqrt(2.5))
    assert (ci.lo, ci.hi) == pytest.approx((3 - 1.96299, 3 + 1.96299), abs=1e-4)
    big = mean_ci([0.0, 1.0] * 500)  # n = 1000: the normal quantile
    assert big.half == pytest.approx(
        1.96 * math.sqrt(1000 / 999 * 0.25) / math.sqrt(1000), rel=1e-3
    )
    assert mean_ci([0.7] * 4).half == 0.0
    one = mean_ci([0.5])
    assert one.mean == 0.5 and math.isinf(one.lo) and math.isinf(one.hi)
    with pytest.raises(ValueError, match="no values"):
        mean_ci([])


def test_t_quantiles_fall_from_the_table_to_the_normal():
    assert t975(1) == 12.706 and t975(30) == 2.042
    qs = [t975(df) for df in range(1, 200)]
    assert all(a >= b for a, b in itertools.pairwise(qs))
    assert t975(60) == pytest.approx(2.000, abs=0.003) and t975(500) == pytest.approx(
        1.96, abs=1e-3
    )
    with pytest.raises(ValueError, match="at least two"):
        t975(0)


def test_paired_interval_is_that_of_the_differences():
    a = [0.1, 0.5, 0.9, 0.3]
    b = [0.3, 0.6, 1.0, 0.6]  # differences 0.2, 0.1, 0.1, 0.3
    d = paired_ci(a, b)
    assert d.mean == pytest.approx(0.175)
    assert d.half == pytest.approx(3.182 * 0.095743 / 2, rel=1e-4)
    # pairing removes the between-prompt spread: far narrower than either mean's own interval
    assert d.half < mean_ci(a).half / 3
    with pytest.raises(ValueError, match="same prompts"):
        paired_ci([1.0], [1.0, 2.0])


# ----------------------------------------------------------------- held-out splits


def test_toy_add_sets_heldout_pairs_aside_from_training():
    from echo_rl.adapters.toy_add import ToyAddAdapter
    from echo_rl.core.models import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    plain = ToyAddAdapter({}, tok)
    assert plain.heldout_prompts(random.Random(0)) is None
    ad = ToyAddAdapter({"heldout": 10}, tok)
    held = [tok.decode(p.prompt_ids) for p in ad.heldout_prompts(random.Random(0))]
    assert len(set(held)) == 10
    stream = ad.prompts(random.Random(1))
    trained = {tok.decode(next(stream).prompt_ids) for _ in range(2000)}
    assert len(trained) == 45 and not trained & set(held)
    with pytest.raises(Exception, match=r"heldout=55 must be 0\.\.54"):
        ToyAddAdapter({"heldout": 55}, tok)


def test_math_heldout_file_is_disjoint_and_an_overlap_is_refused(tmp_path):
    from echo_rl.adapters.math import MathAdapter
    from echo_rl.core.models import build_tiny_tokenizer
    from echo_rl.data.adapter import AdapterError

    tok = build_tiny_tokenizer()
    ad = MathAdapter(
        {
            "path": str(ROOT / "examples/data/arith.jsonl"),
            "heldout_path": str(ROOT / "examples/data/arith_heldout.jsonl"),
        },
        tok,
    )
    held = list(ad.heldout_prompts(random.Random(0)))
    train = {tuple(ids) for ids, _ in ad.items()}
    assert len(held) == 100 and not {tuple(p.prompt_ids) for p in held} & train
    ad.close()
    clash = tmp_path / "clash.jsonl"
    clash.write_text(
        '{"question": "1+1=", "answer": "2"}\n'
        + (ROOT / "examples/data/arith.jsonl").read_text().splitlines()[5]
        + "\n"
    )
    bad = MathAdapter(
        {"path": str(ROOT / "examples/data/arith.jsonl"), "heldout_path": str(clash)}, tok
    )
    with pytest.raises(
        AdapterError,
        match=r"1 question\(s\) of heldout_path .* also in path.*"
        r"remove them from one of the files",
    ):
        list(bad.heldout_prompts(random.Random(0)))
    bad.close()


def test_words_heldout_file_has_no_training_question():
    def questions(name):
        return {
            json.loads(x)["question"]
            for x in (ROOT / "examples/data" / name).read_text().splitlines()
        }

    assert len(questions("arith_words_heldout.jsonl")) == 100
    assert not questions("arith_words_heldout.jsonl") & questions("arith_words.jsonl")


def test_an_adapter_without_a_heldout_split_is_told_to_use_train():
    from echo_rl.adapters.toy_add import ToyAddAdapter
    from echo_rl.core.models import build_tiny_tokenizer

    ad = ToyAddAdapter({}, build_tiny_tokenizer())
    prompts, used = eval_prompts(ad, "auto", 7, 0, "toy-add")
    assert used == "train" and len(prompts) == 7
    with pytest.raises(EvalError, match="declares no held-out split.*--split train"):
        eval_prompts(ad, "heldout", 7, 0, "toy-add")


# ----------------------------------------------------------------- eval per adapter


@pytest.mark.timeout(120)
def test_toy_add_eval_pairs_two_checkpoints_on_the_same_prompts(tmp_path):
    run = make_run(
        tmp_path,
        {
            "adapter": {"name": "toy-add", "options": {"heldout": 12}},
            "worker": {"max_new_tokens": 4},
        },
        steps=(4, 5),
    )
    res = evaluate(run, "latest", compare="untrained", n=50, samples=3)
    assert res["split"] == "heldout" and res["prompts"] == 12  # the finite split, once each
    untrained, trained = res["policies"]
    assert untrained["policy"] == "untrained" and trained["policy"] == "step 5"
    for p in res["policies"]:
        r = p["reward"]
        assert r["lo"] <= r["mean"] <= r["hi"] and len(p["per_prompt"]) == 12
        assert all(0.0 <= x <= 1.0 for x in p["per_prompt"])
    diffs = [b - a for a, b in zip(untrained["per_prompt"], trained["per_prompt"])]
    assert res["paired"]["mean"] == pytest.approx(sum(diffs) / 12, abs=1e-5)
    # same prompts, same seeds: a checkpoint against itself differs by exactly nothing
    same = evaluate(run, "5", compare="latest", n=12, samples=2)
    assert same["paired"]["mean"] == 0.0 and same["paired"]["excludes_zero"] is False
    assert same["policies"][0]["per_prompt"] == same["policies"][1]["per_prompt"]
    # and another checkpoint is another policy
    other = evaluate(run, "4", n=12, samples=2)
    assert other["policies"][0]["per_prompt"] != same["policies"][0]["per_prompt"]
    text = describe(res)
    assert "paired difference (step 5 - untrained)" in text and "95% CI" in text


@pytest.mark.timeout(120)
def test_math_eval_scores_the_heldout_file(tmp_path):
    run = make_run(
        tmp_path,
        {
            "adapter": {
                "name": "math",
                "options": {
                    "path": str(ROOT / "examples/data/arith.jsonl"),
                    "heldout_path": str(ROOT / "examples/data/arith_heldout.jsonl"),
                    "format_reward": 0.1,
                },
            },
            "worker": {"max_new_tokens": 6},
        },
    )
    res = evaluate(run, "latest", n=20, samples=2)
    assert res["split"] == "heldout" and res["prompts"] == 20
    assert all(x in (0.0, 0.05, 0.1, 0.55, 0.5, 1.0) for x in res["policies"][0]["per_prompt"])
    train = evaluate(run, "untrained", split="train", n=5)
    assert train["split"] == "train" and train["policies"][0]["policy"] == "untrained"


@pytest.mark.timeout(120)
def test_poker_eval_plays_heldout_episodes(tmp_path):
    run = make_run(
        tmp_path,
        {
            "adapter": {
                "name": "poker",
                "options": {
                    "obs_format": "compact",
                    "opponents": ["station"],
                    "max_decisions": 4,
                    "max_episode_tokens": 300,
                    "bot_samples": 4,
                },
            },
            "worker": {"max_new_tokens": 5},
        },
    )
    res = evaluate(run, "latest", compare="untrained", n=4, samples=2)
    assert res["split"] == "heldout" and res["prompts"] == 4
    for p in res["policies"]:
        assert len(p["per_prompt"]) == 4 and all(math.isfinite(x) for x in p["per_prompt"])
    # held-out deals are not the training stream's
    from echo_rl.core.models import build_tiny_tokenizer
    from echo_rl.data.adapter import load_adapter

    ad = load_adapter("poker", {"obs_format": "compact"}, build_tiny_tokenizer())
    train = {p.task["deal_seed"] for p, _ in zip(ad.prompts(random.Random(0)), range(200))}
    held = {p.task["deal_seed"] for p, _ in zip(ad.heldout_prompts(random.Random(0)), range(200))}
    assert not train & held


TUTORIAL = "echo_sort/__init__.py"


@pytest.mark.timeout(120)
def test_the_tutorial_adapter_evaluates_on_its_heldout_split(tmp_path, monkeypatch):
    """docs/adapters.md's tutorial package, registered as pip would: its held-out strings
    (digit sum a multiple of 7) are never trained on, and eval scores them."""
    import re

    from echo_rl.data.testing import write_entry_points

    doc = (ROOT / "docs" / "adapters.md").read_text()
    code = re.search(r"```python file=echo_sort/__init__.py\n(.*?)```", doc, re.DOTALL).group(1)
    site = tmp_path / "site"
    (site / "echo_sort").mkdir(parents=True)
    (site / "echo_sort" / "__init__.py").write_text(code)
    write_entry_points(site, "echo-sort-digits", {"sort-digits": "echo_sort:SortDigits"})
    monkeypatch.syspath_prepend(str(site))
    run = make_run(
        tmp_path,
        {
            "adapter": {"name": "sort-digits", "options": {"length": 3}},
            "worker": {"max_new_tokens": 6},
        },
    )
    res = evaluate(run, "latest", compare="untrained", n=16)
    assert res["adapter"] == "sort-digits" and res["split"] == "heldout" and res["prompts"] == 16
    assert all(0.0 <= x <= 1.0 for p in res["policies"] for x in p["per_prompt"])
    from echo_rl.core.models import build_tiny_tokenizer
    from echo_rl.data.adapter import load_adapter

    tok = build_tiny_tokenizer()
    ad = load_adapter("sort-digits", {}, tok)
    digit_sum = lambda p: sum(int(c) for c in tok.decode(p.prompt_ids)[:-1])  # noqa: E731
    assert all(digit_sum(p) % 7 for p, _ in zip(ad.prompts(random.Random(0)), range(300)))
    assert all(
        digit_sum(p) % 7 == 0 for p, _ in zip(ad.heldout_prompts(random.Random(0)), range(50))
    )


@pytest.mark.timeout(120)
def test_lora_checkpoint_is_the_adapter_on_the_base(tmp_path):
    lora = {"enabled": True, "rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj"]}
    config = {
        "adapter": {"name": "toy-add"},
        "worker": {"max_new_tokens": 4},
        "learner": {"lora": lora},
    }
    run = make_run(tmp_path, config, noise=2.0)
    res = evaluate(run, "latest", compare="untrained", n=24, samples=2)
    assert res["lora"] is True
    untrained, trained = (p["per_prompt"] for p in res["policies"])
    assert untrained != trained  # the adapter changed the policy
    # the untrained LoRA policy is the base model: lora_B starts at zero
    full = make_run(tmp_path, {k: v for k, v in config.items() if k != "learner"}, name="full")
    base = evaluate(full, "untrained", n=24, samples=2)
    assert base["policies"][0]["per_prompt"] == untrained
    other = make_run(
        tmp_path,
        {**config, "learner": {"lora": {**lora, "target_modules": ["q_proj"]}}},
        name="other",
    )
    (other / "config.toml").write_text((run / "config.toml").read_text())
    with pytest.raises(EvalError, match="not this run's LoRA adapter"):
        evaluate(other, "latest", n=2)


# ----------------------------------------------------------------- errors and the CLI


def test_errors_name_the_problem_and_the_fix(tmp_path, capsys):
    assert main(["--run-dir", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert "no such folder" in err and "echo-rl learn or quickstart wrote" in err
    (tmp_path / "empty").mkdir()
    assert main(["--run-dir", str(tmp_path / "empty")]) == 2
    assert "no config.toml" in capsys.readouterr().err
    run = make_run(tmp_path, {"adapter": {"name": "toy-add"}}, steps=(8, 9))
    with pytest.raises(
        EvalError,
        match=r"no checkpoint of step 3 .*here steps: 8, 9\. Pass one of "
        r"them, or leave --checkpoint out for the latest",
    ):
        resolve_policy(run, "3")
    (run / "checkpoints" / "latest").unlink()
    with pytest.raises(EvalError, match=r"no checkpoint .*latest is missing.*pass --untrained"):
        resolve_policy(run, "latest")
    assert main(["--run-dir", str(run), "--n", "0"]) == 2
    assert "--n must be at least 1" in capsys.readouterr().err
    assert main(["--run-dir", str(run), "--temperature", "0"]) == 2
    assert "above 0" in capsys.readouterr().err


@pytest.mark.timeout(120)
@pytest.mark.integration
def test_cli_prints_json_and_help_is_instant(tmp_path):
    run = make_run(tmp_path, {"adapter": {"name": "toy-add"}, "worker": {"max_new_tokens": 4}})
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "echo_rl.cli.rl",
            "eval",
            "--run-dir",
            str(run),
            "--untrained",
            "--compare",
            "latest",
            "--n",
            "6",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=100,
        cwd=ROOT,
        check=False,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(r.stdout)
    assert res["paired"]["difference"] == "untrained - step 3" and res["prompts"] == 6
    code = (
        "import sys, echo_rl.cli.commands.evaluate as e; e.build_parser(); "
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=ROOT,
        check=False,
    )
    assert out.stdout.strip() == "[]"
    h = subprocess.run(
        [sys.executable, "-m", "echo_rl.cli.rl", "eval", "--help"],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=ROOT,
        check=False,
    )
    assert h.returncode == 0 and "--compare" in h.stdout and "eval poker" in h.stdout


@pytest.mark.timeout(120)
def test_a_config_alone_scores_the_model_before_any_run(tmp_path, capsys):
    """Issue 56, item 8: `echo-rl eval` wanted a run folder, and a fake one holding only
    config.toml was the way to score a model before training. --config with --untrained
    scores what a run would start from: the same numbers as that run's --untrained."""
    from echo_rl.core.config import EchoConfig, dump_toml

    config = {
        "adapter": {"name": "toy-add", "options": {"heldout": 12}},
        "worker": {"max_new_tokens": 4},
    }
    run = make_run(tmp_path, config, steps=(2,))
    cfg_file = tmp_path / "mine.toml"
    cfg_file.write_text(dump_toml(EchoConfig.model_validate({"model": TINY, **config})))
    argv = ["--n", "12", "--samples", "2", "--json"]
    assert main(["--config", str(cfg_file), "--untrained", *argv]) == 0
    before = json.loads(capsys.readouterr().out)
    assert main(["--run-dir", str(run), "--untrained", *argv]) == 0
    from_run = json.loads(capsys.readouterr().out)
    assert before["run_dir"] is None and before["prompts"] == 12
    assert before["policies"][0]["per_prompt"] == from_run["policies"][0]["per_prompt"]
    # --set reaches the config: another held-out split size, another count of prompts
    assert (
        main(
            ["--config", str(cfg_file), "--set", "adapter.options.heldout=6", "--untrained", *argv]
        )
        == 0
    )
    assert json.loads(capsys.readouterr().out)["prompts"] == 6
    # what a config cannot do, and a bad one, named with the fix
    assert main(["--config", str(cfg_file), *argv]) == 2
    assert "add --untrained" in capsys.readouterr().err
    assert main(["--run-dir", str(run), "--set", "seed=3", "--untrained"]) == 2
    assert "--set goes with --config" in capsys.readouterr().err
    assert main(["--config", str(tmp_path / "none.toml"), "--untrained"]) == 2
    assert "not found" in capsys.readouterr().err


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("rounding", "lora"),
    [("dither", False), ("stochastic", False), ("nearest", False), ("dither", True)],
)
def test_as_sampled_installs_the_snapshot_the_learner_published(tmp_path, rounding, lora):
    """--as-sampled: the checkpoint's weights as the learner's publication cast them for its
    version (the same tensors in the same order, so the same rounding streams), bit for bit;
    with LoRA, the adapter's tensors."""
    import torch

    from echo_rl.core.models import params_to_payload, rounding_seed
    from echo_rl.learner.evaluation import Scorer, as_sampled, install_policy, run_config
    from echo_rl.learner.policy import Policy as LearnerPolicy

    run = make_run(
        tmp_path,
        {
            "adapter": {"name": "toy-add", "options": {"heldout": 12}},
            "worker": {"max_new_tokens": 4},
            "broadcast": {"dtype": "bfloat16", "rounding": rounding},
            **({"learner": {"lora": {"enabled": True, "rank": 4, "alpha": 8.0}}} if lora else {}),
        },
        steps=(3,),
        noise=1e-3,  # small moves: most of them fall between two bf16 values
    )
    cfg = run_config(run)
    held = resolve_policy(run, "latest")
    sampled = as_sampled(held, cfg)
    how = {"stochastic": "rounded stochastically", "dither": "dithered"}.get(
        rounding, "rounded to nearest"
    )
    assert sampled.label == f"step 3 as sampled (bfloat16, {how})"
    # what the learner's Release.send publishes for version 3
    named = LearnerPolicy(cfg).named_tensors(held.state)
    index, payload = params_to_payload(named, "bfloat16", rounding_seed(cfg.seed, rounding, 3))
    scorer = Scorer(cfg, split="heldout", n=12, samples=1, seed=0, threads=1)
    try:
        install_policy(scorer.backend, sampled, {})
        got = dict(scorer.backend.model.named_parameters())
        buf, nearest_differs = memoryview(payload), 0
        for e in index:
            raw = bytearray(buf[e["offset"] : e["offset"] + e["nbytes"]])
            want = torch.frombuffer(raw, dtype=torch.bfloat16).view(e["shape"]).float()
            assert torch.equal(got[e["name"]].detach().float(), want), e["name"]
            nearest = held.state[e["name"]].to(torch.bfloat16).float()
            nearest_differs += int((want != nearest).sum())
        assert (nearest_differs > 0) == (rounding != "nearest")
        install_policy(scorer.backend, held, {})  # as held: the float32 checkpoint again
        assert torch.equal(
            scorer.backend.model.get_parameter(index[0]["name"]).detach(),
            held.state[index[0]["name"]],
        )
    finally:
        scorer.close()
    res = evaluate(run, "latest", compare="latest", n=12, samples=2, sampled=True)
    assert [p["policy"] for p in res["policies"]] == ["step 3", sampled.label]
    assert res["paired"]["difference"] == f"{sampled.label} - step 3"


def test_as_sampled_needs_a_checkpoint(tmp_path, capsys):
    run = make_run(tmp_path, {"adapter": {"name": "toy-add"}}, steps=(2,))
    assert main(["--run-dir", str(run), "--untrained", "--as-sampled"]) == 2
    assert "--as-sampled scores a checkpoint" in capsys.readouterr().err
