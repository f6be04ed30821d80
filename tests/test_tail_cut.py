"""Long-tail cut (``worker.tail_cut``, docs/scheduling.md): the backend cuts a request once
most of its fresh samples have ended, never a continued group's; a group its worker carried
across an install is audited on one of its versions, drawn at random. The worker's side
(deliver what ended, carry the rest into the next rollout) is
tests/test_worker_parts.py::test_a_tail_cut_delivers_the_groups_that_ended_and_carries_the_others."""

from __future__ import annotations

import pytest
from test_control import ask, batch, connect, ctx, plane, records  # noqa: F401 (fixtures)
from test_handbacks import checked  # noqa: F401 (fixture)
from test_preemption import _record, intake  # noqa: F401 (fixture)
from test_trust import _sample

from echo_rl.control.intake import one_version
from echo_rl.core import wire

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module", params=["transformers", "engine"])
def backend(request):
    """Both backends cut alike: Hugging Face generate's (a stopping criterion) and the
    engine's (echo_rl/worker/backends/engine.py, at its look at the slots)."""
    from echo_rl.core.config import ModelConfig
    from echo_rl.worker.backends import make_backend

    return make_backend(request.param, model_cfg=ModelConfig(max_positions=256), threads=1)


def test_the_backend_cuts_once_the_share_of_fresh_samples_has_ended(backend):
    eos = backend.tokenizer.eos_token_id
    g = wire.Group(group_id="g", prompt_ids=[3, 4], n=32, seed=5)
    (whole,) = backend.generate([g], 200, 1.0)
    (cut,) = backend.generate([g], 200, 1.0, tail=0.5)
    assert all(s.finished for s in whole)
    ended = [s for s in cut if s.finished]
    running = [s for s in cut if not s.finished]
    assert running and len(ended) >= 16  # it stopped at the token where half had ended
    lengths = {len(s.completion_ids) for s in running}
    assert len(lengths) == 1 and all(s.completion_ids[-1] != eos for s in running)
    assert max(len(s.completion_ids) for s in whole) > lengths.pop()  # it saved tokens
    assert all(s.completion_ids[-1] == eos for s in ended)


def test_a_continued_group_is_never_cut(backend):
    """A continuation's rows must end: the call runs on until they do, whatever the share of
    fresh rows that ended; otherwise a straggler could be cut and handed back forever."""
    long = wire.Prefix(sample_idx=0, ids=[7], logprobs=[-0.1], versions=[[1, 1]])
    cont = wire.Group(group_id="c", prompt_ids=[3, 4], n=1, seed=1, prefixes=[long])
    fresh = wire.Group(group_id="f", prompt_ids=[3, 4], n=8, seed=2)
    cuts = 0
    for seed in range(6):
        c, f = backend.generate([cont.model_copy(update={"seed": seed}), fresh], 200, 1.0, tail=0.1)
        assert c[0].finished  # never cut
        running = [s for s in f if not s.finished]
        if running:  # fresh rows are cut only once the continuation has ended
            cuts += 1
            assert len(running[0].completion_ids) >= len(c[0].completion_ids) - c[0].prefix_len
    assert cuts  # the rule was exercised


# ----------------------------------------------------------------------------- the learner's audit


def test_a_group_carried_across_an_install_is_audited_on_one_version_drawn_at_random(intake):
    """The carried sample's tokens are of versions 3 and 4, all the deliverer's own: each
    audit checks one version's tokens (the others masked), and both versions get drawn. A
    forger of either run of tokens is therefore checked with at least half the audit rate;
    auditing both at the version of the oldest would strike an honest carrier."""
    it, work, buffer, audits = intake
    seen = set()
    for _ in range(40):
        (g,) = work.grant("B", 1, 0)
        out = it.batch(
            "B",
            "kB",
            [
                _record(g.group_id, 0, [5, 6, 7], [-0.5, -1.0, -0.3], 3, [[3, 2], [4, 1]]),
                _record(g.group_id, 1, [8, 9], [-0.2, -0.4], 3),
            ],
        )
        assert len(out.accepted) == 2 and not out.rejected
        assert len(buffer.take(1, timeout=1.0)) == 1  # trained: room for the next one
        job = audits[-1]
        want = {3: ([1, 1, 0], [1, 1]), 4: ([0, 0, 1], [0, 0])}[job.version]
        assert (job.records[0].loss_mask, job.records[1].loss_mask) == want
        seen.add(job.version)
    assert seen == {3, 4}


def test_one_version_leaves_single_version_and_multi_turn_groups_alone():
    from echo_rl.data.records import Record

    def rec(versions=None, mask=None):
        return Record(
            group_id="g", sample_idx=0, prompt_ids=[1], completion_ids=[5, 6], logprobs=[-1, -1],
            reward=0.0, version=3, worker_id="w", gen_s=0.1, versions=versions, loss_mask=mask,
        )  # fmt: skip

    assert one_version([rec()], min) == ([rec()], None)
    mixed = rec([[3, 1], [4, 1]], [1, 1])
    assert one_version([mixed], min) == ([mixed], None)  # multi-turn: audited as before
    (only,), at = one_version([rec([[3, 1], [4, 1]])], max)
    assert at == 4 and only.loss_mask == [0, 1]


# ----------------------------------------------------------------------------- real processes


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_run_with_the_tail_cut_trains_its_carried_groups_and_strikes_nobody(tmp_path):
    """docs/scheduling.md's benchmark, shortened: a learner and a worker with 128-token
    completions and tail_cut 0.75. Groups are carried, the learner steps, every delivery is
    admitted (no partial or duplicate group), and no audit of a carried group fails."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    run = tmp_path / "run"
    argv = [
        sys.executable, "-m", "echo_rl.cli.rl", "quickstart", "--config", "examples/quickstart.toml",
        "--run-dir", str(run), "--workers", "1", "--set", "learner.max_steps=6",
        "--set", "worker.max_new_tokens=128", "--set", "worker.tail_cut=0.75",
        "--set", "learner.prompts_per_step=8",
    ]  # fmt: skip
    subprocess.run(argv, cwd=root, check=True, stdout=subprocess.DEVNULL, timeout=280)
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x]
    assert len(rows) == 6
    status = json.loads((run / "status" / "worker-0.json").read_text())
    assert status["tail_groups"] > 0
    assert rows[-1]["rejected"] == {} and rows[-1]["audit_failures"] == 0
    assert rows[-1]["audits"] > 0


# ----------------------------------------------------------------------------- the simulator


def _lengths(cut: float, row_cost: float = 0.0):
    import numpy as np

    from echo_rl.provisioning.sim.scenario import RolloutSection
    from echo_rl.provisioning.sim.tail import Lengths

    ro = RolloutSection(
        groups_per_request=2, length_mean=200, length_cap=800, tail_cut=cut,
        decode_row_cost=row_cost,
    )  # fmt: skip
    return Lengths(ro, 16, np.random.default_rng(1), 1)


def test_the_simulated_request_without_a_cut_completes_its_groups_at_the_worker_s_rate():
    L = _lengths(0.0)
    shares = []
    for _ in range(2000):
        share, done = L.request(0, 2, 7)
        assert done == [(7, 2)] and not len(L.carry[0])
        shares.append(share)
    assert abs(sum(shares) / len(shares) - 1.0) < 0.03  # calibrated: mean duration G x g / mu


def test_a_simulated_cut_carries_groups_with_their_version_into_the_next_request():
    L = _lengths(0.75)
    started = completed = 0
    for u in range(300):
        before = list(L.carry[0].version)
        share, done = L.request(0, 2, u)
        started += 2
        completed += sum(n for _, n in done)
        versions = dict(done)
        for v in set(before):  # every carried group completed, under the version it started with
            assert versions.get(v, 0) >= before.count(v)
        assert share > 0
    assert completed == started - len(L.carry[0])  # nothing lost, nothing twice


def test_the_cut_buys_throughput_only_where_a_decode_step_costs_by_the_row():
    """The model behind docs/scheduling.md's simulated figure: per worker, groups completed
    per unit of time with the cut, over without, for flat and per-row decode costs."""

    def rate(cut, row_cost):
        L = _lengths(cut, row_cost)
        time = groups = 0.0
        for _ in range(3000):
            share, done = L.request(0, max(1, 2 - len(L.carry[0])), 0)
            time, groups = time + share, groups + sum(n for _, n in done)
        return groups / time

    assert rate(0.75, 1.0) / rate(0.0, 1.0) > 1.3
    assert rate(0.75, 0.0) / rate(0.0, 0.0) < rate(0.75, 1.0) / rate(0.0, 1.0)


# ----------------------------------------------------------------------------- hostile


class _Pick:
    """The intake's randomness with its draw of a version fixed (``min`` or ``max``)."""

    def __init__(self, how):
        self.how = how

    def random(self):
        return 0.0

    def choice(self, seq):
        return self.how(seq)


@pytest.mark.parametrize("forge", [False, True], ids=["honest", "forged-older-run"])
def test_a_carrier_forging_its_older_tokens_is_struck_when_that_version_is_drawn(
    checked, ctx, tokenizer, forge
):  # noqa: F811
    """A real auditor holding versions 0 and 1 (the same weights). The worker claims its
    samples were carried across an install: half their tokens of version 0, then version 1. With
    version 0 drawn, forged version-0 log-probs fail the check and strike the worker; honest
    ones pass. (The draw is after receipt: a forger cannot choose the run that is checked.)"""
    import torch

    from echo_rl.core.models import params_to_payload

    checked.auditor.add_snapshot(1, *params_to_payload(checked.model.named_parameters(), "float32"))
    checked.buffer.set_version(1)
    checked.intake._rng = _Pick(min)
    w = connect(checked, ctx)
    ask(w, wire.Join(worker_id="w1"))
    (g,) = ask(w, wire.WorkRequest(worker_id="w1", max_groups=1)).groups
    rng = torch.Generator().manual_seed(4)
    temp = checked.cfg.worker.temperature
    n = checked.cfg.worker.max_new_tokens  # first half version 0, second half version 1
    sampled = _sample(checked.model, g.prompt_ids, g.n, n, temp, rng)
    recs = records(g)
    for r, s in zip(recs, sampled):
        lps = list(s.logprobs)
        if forge:
            lps[: n // 2] = [-9999.0] * (n // 2)
        r.update(completion_ids=list(s.completion_ids), logprobs=lps, version=0)
        r["versions"] = [[0, n // 2], [1, n - n // 2]]
        text = tokenizer.decode(r["completion_ids"], skip_special_tokens=True)
        r["reward"] = checked.intake.adapter.reward(g.task, r["completion_ids"], text)
    assert ask(w, batch(recs)).accepted == g.n
    checked.auditor.run(budget_s=60)
    checked.stats()  # the verdicts, on the loop
    assert (checked.reputation.strikes["w1"] >= 1) == forge


@pytest.mark.parametrize("junk", ["0.75", None, True, -1, 1.0, 5, float("nan"), [0.5], {"x": 1}])
def test_a_learner_s_junk_tail_cut_turns_the_cut_off_and_generation_goes_on(junk):
    """The worker's view comes from the learner, a stranger: a tail_cut that is not a share in
    (0, 1) means no cut, never an exception out of the rollout."""
    import threading

    from echo_rl.worker.scoring import generate_and_score, tail_share

    assert tail_share(junk) == 0.0 and tail_share(0.75) == 0.75

    class Plain:  # a backend that predates tail: a passed-on tail would be a TypeError
        tokenizer = type("T", (), {"decode": staticmethod(lambda ids, **kw: "")})()

        def generate(self, groups, max_new_tokens, temperature, stop=None):
            from echo_rl.worker.backends.base import Sample

            return [[Sample([5, 2], [-0.1, -0.1]) for _ in range(g.n)] for g in groups]

    adapter = type("A", (), {"reward": staticmethod(lambda task, ids, text: 1.0)})()
    g = wire.Group(group_id="g", prompt_ids=[3], n=2, seed=0)
    wv = {"max_new_tokens": 4, "temperature": 1.0, "tail_cut": junk}
    out = generate_and_score(Plain(), adapter, wv, threading.Event(), [g])
    assert [r for _, r in out[0]] == [1.0, 1.0]
