"""Restricted answers (echo_rl/data/answers.py): workers sample only the adapter's answer tokens,
the learner and the auditor compute log-probs under the same renormalised softmax, admission
refuses a trained token outside the set, and bad settings stop with the fix."""

import types

import pytest
import torch

from echo_rl.core import wire
from echo_rl.core.config import ModelConfig
from echo_rl.core.models import load_model, params_to_payload
from echo_rl.data.answers import AnswerTokensError, check_answer_tokens
from echo_rl.data.records import Limits, RecordError, parse_record
from echo_rl.learner.trainer import selective_logprobs, token_logprobs

LETTERS = (23, 20, 19)  # f, c, b in the tiny tokenizer


def test_selective_logprobs_renormalise_over_the_answer_set():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 24, generator=g)
    targets = torch.tensor([[23, 20, 19, 23, 20]] * 2)
    got = selective_logprobs(logits, targets, 0.7, LETTERS)
    sub = torch.log_softmax(logits[..., list(LETTERS)] / 0.7, -1)
    want = sub.gather(-1, torch.tensor([[0, 1, 2, 0, 1]] * 2).unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(got, want)
    # a target outside the set (context between an episode's answers) stays finite
    assert torch.isfinite(selective_logprobs(logits, torch.full((2, 5), 4), 1.0, LETTERS)).all()


def test_restricted_worker_samples_only_answers_and_the_learner_agrees(tokenizer):
    from echo_rl.worker.backends import make_backend

    backend = make_backend("transformers", model_cfg=ModelConfig(), threads=1)
    backend.restrict_answers(LETTERS)
    prompt = [4, 14, 5, 17]
    [samples] = backend.generate(
        [wire.Group(group_id="g", prompt_ids=prompt, n=16, seed=3)],
        max_new_tokens=1,
        temperature=1.0,
    )
    assert {s.completion_ids[0] for s in samples} <= set(LETTERS)
    assert len({s.completion_ids[0] for s in samples}) > 1  # near uniform over three letters
    learner = load_model(ModelConfig(), tokenizer)  # same seed, same weights
    for s in samples:
        ids = torch.tensor([prompt + s.completion_ids])
        with torch.no_grad():
            lp = token_logprobs(learner, ids, torch.ones_like(ids), answer_tokens=LETTERS)[0, 3:]
            free = token_logprobs(learner, ids, torch.ones_like(ids))[0, 3:]
        assert lp.tolist() == pytest.approx(s.logprobs, abs=1e-4)
        assert float(free[0]) < float(lp[0]) - 0.5  # the whole vocabulary: a different number


def test_admission_refuses_a_trained_token_outside_the_answer_set():
    lim = Limits(24, 8, 4, answer_tokens=frozenset(LETTERS))
    rec = {
        "group_id": "g",
        "sample_idx": 0,
        "prompt_ids": [4, 5],
        "completion_ids": [23, 7, 19],
        "logprobs": [-1.0, 0.0, -1.0],
        "reward": 0.0,
        "version": 0,
        "worker_id": "w",
        "gen_s": 0.1,
        "loss_mask": [1, 0, 1],
    }
    assert parse_record(rec, lim).completion_ids == [23, 7, 19]  # untrained context: any token
    with pytest.raises(RecordError) as err:
        parse_record({**rec, "completion_ids": [23, 7, 5]}, lim)  # a trained 5: not an answer
    assert err.value.reason == "bad_answer_token" and "[5]" in str(err.value)
    with pytest.raises(RecordError, match="answer tokens"):
        parse_record({**rec, "loss_mask": None, "completion_ids": [23, 7, 19]}, lim)


def test_the_auditor_passes_an_honest_restricted_worker(small_cfg, tokenizer):
    from echo_rl.control.auditor import Auditor
    from echo_rl.control.intake import AuditJob
    from echo_rl.data.records import Record
    from echo_rl.worker.backends import make_backend

    model = load_model(small_cfg.model, tokenizer, "float32").eval()
    tensors, payload = params_to_payload(model.named_parameters(), "float32")
    backend = make_backend("transformers", model_cfg=small_cfg.model, threads=1)
    backend.install(tensors, payload, 0)
    backend.restrict_answers(LETTERS)
    [samples] = backend.generate(
        [wire.Group(group_id="g", prompt_ids=[4, 14, 5], n=8, seed=1)],
        max_new_tokens=1,
        temperature=small_cfg.worker.temperature,
    )
    recs = [
        Record(
            group_id="g",
            sample_idx=i,
            prompt_ids=[4, 14, 5],
            completion_ids=s.completion_ids,
            logprobs=s.logprobs,
            reward=0.0,
            version=0,
            worker_id="w",
            gen_s=0.0,
        )
        for i, s in enumerate(samples)
    ]
    verdicts: list = []
    aud = Auditor(small_cfg, tokenizer, verdicts.append, answer_tokens=LETTERS)
    aud.add_snapshot(0, tensors, payload)
    aud.submit(AuditJob("w", "k", recs, probation=True))
    blind = Auditor(small_cfg, tokenizer, verdicts.append)  # one that ignores the restriction
    blind.add_snapshot(0, tensors, payload)
    blind.submit(AuditJob("w", "k", recs, probation=True))
    aud.run(budget_s=60)
    blind.run(budget_s=60)
    got = [(v.check, v.ok) for v in verdicts]
    assert got[:2] == [("logprob", True), ("sampling", True)]
    assert verdicts[0].stats["max_mean_gap"] < 1e-4
    assert ("logprob", False) in got[2:]  # the renormalisation is what makes them agree


@pytest.mark.parametrize(
    "tokens, max_new, match",
    [
        ((), 1, "empty"),
        ((23, 99), 1, "outside the vocabulary"),
        ((23, 20), 4, "worker.max_new_tokens = 1"),
    ],
)
def test_bad_answer_sets_name_the_fix(tokens, max_new, match):
    with pytest.raises(AnswerTokensError, match=match):
        check_answer_tokens(tokens, 24, max_new, eos_token_id=1)


def test_answer_sets_that_can_end_pass():
    assert check_answer_tokens(None, 24, 8, 1) is None
    assert check_answer_tokens([20, 23, 20], 24, 1, 1) == (20, 23)
    assert check_answer_tokens([20, 1], 24, 8, 1) == (1, 20)  # with end-of-sequence: any length


def test_the_vllm_backend_refuses_a_restricted_adapter():
    from echo_rl.worker.backends.vllm import VLLMBackend

    stub = types.SimpleNamespace(answer_tokens=None)
    with pytest.raises(ValueError, match="--backend transformers"):
        VLLMBackend.restrict_answers(stub, LETTERS)
    VLLMBackend.restrict_answers(stub, None)  # unrestricted adapters run as before
    assert stub.answer_tokens is None


@pytest.mark.timeout(300)
@pytest.mark.integration
def test_poker_learn_trains_with_restricted_answers_end_to_end(tmp_path):
    """examples/poker-learn.toml over loopback: a learner and a worker, every group of the
    worker's probation audited under the restricted distribution, none refused; then
    echo-rl sample plays the checkpoint with the same letters."""
    import json
    import subprocess
    import sys

    run = tmp_path / "run"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "echo_rl.cli.rl",
            "quickstart",
            "--config",
            "examples/poker-learn.toml",
            "--workers",
            "1",
            "--run-dir",
            str(run),
            "--set",
            "learner.max_steps=3",
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3
    assert rows[-1]["audits"] > 0 and rows[-1]["audit_failures"] == 0
    assert not any(rows[-1]["rejected"].values())
    out = tmp_path / "sample.json"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "echo_rl.cli.rl",
            "sample",
            str(run),
            "--n",
            "2",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    answers = [
        line for s in json.loads(out.read_text()) for line in s["completion"].split("a=")[1:]
    ]
    assert answers and all(a[0] in "fcb" for a in answers)


def test_intake_counts_non_answers_and_junk_and_keeps_admitting(tmp_path):
    """A hostile worker's batch: a group with a trained non-answer token, records of junk
    types and huge lists, repeated as a flood. Each bad record is refused with its reason
    counted; the same batch's honest group and another worker's later group are admitted."""
    import itertools

    from echo_rl.control.intake import Intake
    from echo_rl.control.reputation import Reputation
    from echo_rl.control.work import WorkQueue
    from echo_rl.data.adapter import Prompt
    from echo_rl.data.buffer import ReplayBuffer

    prompts = (Prompt([1, 2], {"i": i}) for i in itertools.count())
    work = WorkQueue(prompts, group_size=2, max_outstanding=64, lease_timeout_s=60, prefix="r")
    buffer = ReplayBuffer(staleness=2, capacity_groups=64, group_size=2)
    it = Intake(
        limits=Limits(24, 8, 2, answer_tokens=frozenset(LETTERS)),
        buffer=buffer,
        work=work,
        reputation=Reputation(tmp_path, 2, lambda: 0),
    )

    def rec(gid, i, ids, worker="evil"):
        return {
            "group_id": gid,
            "sample_idx": i,
            "prompt_ids": [1, 2],
            "completion_ids": ids,
            "logprobs": [-1.0] * len(ids) if isinstance(ids, list) else [],
            "reward": 0.5,
            "version": 0,
            "worker_id": worker,
            "gen_s": 0.1,
        }

    bad_g, good_g = work.grant("evil", 2, 0)
    junk = [
        rec(bad_g.group_id, 0, [23, 5]),  # 5 is no answer
        rec(bad_g.group_id, 1, "fcb"),
        rec(bad_g.group_id, 1, [23] * 100_000),
        {**rec(bad_g.group_id, 1, [20]), "loss_mask": "x"},
        7,
        None,
    ]
    out = it.batch(
        "evil", "k", junk * 50 + [rec(good_g.group_id, 0, [23]), rec(good_g.group_id, 1, [19])]
    )
    assert out.rejected["bad_answer_token"] == 50
    assert sum(out.rejected.values()) == len(junk) * 50
    assert [r.group_id for r in out.accepted] == [good_g.group_id] * 2
    (later,) = work.grant("honest", 1, 0)
    out = it.batch("honest", "k2", [rec(later.group_id, i, [20], "honest") for i in range(2)])
    assert len(out.accepted) == 2 and not out.rejected


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_bad_answer_set_stops_quickstart_with_one_line_and_its_fix(tmp_path):
    """Issue 37, point 17: the check's message used to arrive inside a traceback (the learner's,
    then quickstart's RuntimeError). Now the learner prints it as one line, and quickstart
    repeats that line with the log's path and exits 1."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "echo_rl.cli.rl",
            "quickstart",
            "--config",
            str(root / "examples" / "poker-learn.toml"),
            "--run-dir",
            str(tmp_path / "r"),
            "--set",
            "worker.max_new_tokens=4",
        ],
        capture_output=True,
        check=False,
        text=True,
        timeout=220,
    )
    assert r.returncode == 1
    assert "Traceback" not in r.stderr + r.stdout
    [line] = r.stderr.strip().splitlines()
    assert (
        line.startswith(
            "echo-rl quickstart: the learner stopped at start-up: the adapter restricts answers"
        )
        and "set worker.max_new_tokens = 1" in line
    )
    log = (tmp_path / "r" / "learner.stderr.log").read_text()
    assert "Traceback" not in log and "set worker.max_new_tokens = 1" in log
