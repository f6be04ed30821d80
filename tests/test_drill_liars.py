"""The security drill's lying workers (benchmarks/drill_workers.py): each lie does what it says,
and a worker forging rewards against a real learner is quarantined (docs/security.md)."""

import functools
import json
from pathlib import Path

import pytest
from worker_doubles import ScriptedClient, make_generation

from benchmarks.drill_workers import Lie, LyingGeneration
from echo_rl.adapters.toy_add import ToyAddAdapter
from echo_rl.core import wire
from echo_rl.core.models import build_tiny_tokenizer
from echo_rl.worker.backends import Sample

N = 4  # samples per group


class ScriptedBackend:
    """Answers every group with the same four completions: right and closed (reward 1.0),
    right and open (0.5), wrong digit (0.1), no digit (0.0)."""

    def __init__(self, tok):
        self.tokenizer, self.vocab_size = tok, len(tok)
        digit = {d: tok.convert_tokens_to_ids(str(d)) for d in range(10)}
        eos = tok.eos_token_id
        self.completions = [
            [digit[5], eos],
            [digit[5], digit[1]],
            [digit[7], eos],
            [tok.encode("+", add_special_tokens=False)[0], eos],
        ]

    def generate(self, groups, max_new_tokens, temperature, stop=None):
        return [[Sample(list(c), [-0.5, -1.5]) for c in self.completions] for _ in groups]


def liar(kind: str, truth: Path, **lie) -> LyingGeneration:
    tok = build_tiny_tokenizer()
    make = functools.partial(LyingGeneration, lie=Lie(kind, **lie), truth=str(truth))
    return make_generation(
        ScriptedClient(lambda msg: None), ScriptedBackend(tok), ToyAddAdapter({}, tok), cls=make
    )


GROUPS = [
    wire.Group(group_id=f"g{i}", prompt_ids=[1, 2], n=N, seed=i, task={"answer": 5})
    for i in range(2)
]


def test_honest_drill_worker_delivers_the_adapters_scores(tmp_path):
    out = liar("honest", tmp_path / "t").generate_and_score(GROUPS)
    assert [r for _, r in out[0]] == [1.0, 0.5, 0.1, 0.0]
    row = json.loads((tmp_path / "t").read_text().splitlines()[0])
    assert row["groups"][0]["true"] == row["groups"][0]["claimed"] == [1.0, 0.5, 0.1, 0.0]


def test_forge_rewards_inverts_correctness(tmp_path):
    out = liar("forge_rewards", tmp_path / "t").generate_and_score(GROUPS)
    assert [r for _, r in out[1]] == [0.0, 1.0, 1.0, 1.0]
    assert [s.completion_ids for s, _ in out[0]] == ScriptedBackend(
        build_tiny_tokenizer()
    ).completions


def test_fake_logprobs_claims_the_fixed_value(tmp_path):
    out = liar("fake_logprobs", tmp_path / "t", fake_logprob=-20.0).generate_and_score(GROUPS)
    assert all(s.logprobs == [-20.0, -20.0] for g in out for s, _ in g)
    assert [r for _, r in out[0]] == [1.0, 0.5, 0.1, 0.0]  # rewards untouched
    assert json.loads((tmp_path / "t").read_text())["groups"][0]["logprobs_replaced"] == N


@pytest.mark.parametrize("text", ["", "7+7"])
def test_garbage_tokens_keep_lengths_and_logprobs_and_are_scored_honestly(tmp_path, text):
    w = liar("garbage_tokens", tmp_path / "t", garbage_text=text)
    out = w.generate_and_score(GROUPS)
    special = set(w.held.backend.tokenizer.all_special_ids)
    for s, r in out[0]:
        assert len(s.completion_ids) == 2 and s.logprobs == [-0.5, -1.5]
        assert not special & set(s.completion_ids)
        assert r == w.held.adapter.reward({"answer": 5}, s.completion_ids, "")
    if text:  # the fixed string's first tokens: "7" then "+"
        assert out[0][0][0].completion_ids == w.held.backend.tokenizer.encode(
            "7+", add_special_tokens=False
        )
    assert json.loads((tmp_path / "t").read_text())["groups"][0]["tokens_replaced"] >= N - 1


def test_drop_low_sends_the_best_half(tmp_path):
    out = liar("drop_low", tmp_path / "t", drop_share=0.5).generate_and_score(GROUPS)
    assert [[r for _, r in g] for g in out] == [[1.0, 0.5], [1.0, 0.5]]
    g = json.loads((tmp_path / "t").read_text())["groups"][0]
    assert (g["n"], g["sent"]) == (N, 2)


def test_drill_worker_refuses_a_positive_fake_logprob(capsys):
    from benchmarks.drill_workers import main

    assert (
        main(["--kind", "fake_logprobs", "--fake-logprob", "0.5", "join", "tcp://127.0.0.1:9"]) == 2
    )
    assert "--fake-logprob must be <= 0" in capsys.readouterr().err


# Quarantine is the learner's (echo_rl/control/reputation.py, docs/security.md "Trust but verify").
SMALL = [
    "learner.prompts_per_step=4",
    "learner.group_size=4",
    "learner.max_outstanding_groups=8",
    "learner.wait_timeout_s=60",
]


# The code adapter's reward is expensive: the learner admits first and its reward auditor
# rechecks the probation groups on a thread (echo_rl/control/reward_audit.py), whose verdicts reach the
# loop, which strikes, bans and tells the liar; toy-add's is recomputed at intake.
CODE = ["adapter.name=code", "model.tiny_vocab=text", "worker.max_new_tokens=16"]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("adapter", [[], CODE], ids=["checked-at-intake", "checked-off-the-step"])
def test_forge_rewards_worker_is_quarantined_within_5_steps(tmp_path, adapter):
    from benchmarks.drill_liars import run_fleet

    r = run_fleet(
        tmp_path,
        "forge_rewards",
        steps=30,
        overrides=SMALL + adapter,
        workers=1,
        stop_at_quarantine=True,
        timeout_s=240,
    )
    assert r["lies"]["claimed_ne_adapter"] > 0, "the liar told no lie: the drill proves nothing"
    assert r["quarantine_step"] is not None, f"not quarantined in {r['steps']} steps"
    assert r["steps_to_quarantine"] <= 5
    assert r["liar_said_banned"] and r["exit_codes"]["w0"] == 1
