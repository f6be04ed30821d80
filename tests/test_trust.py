"""Issue 12: what a worker reports is checked before it trains (echo_rl.control.intake, echo_rl.control.auditor,
echo_rl.control.reputation, echo_rl.control.work)."""

import json
import math
import random

import pytest
import torch
from test_control import ask, batch, connect, ctx, records  # noqa: F401 (fixtures)
from test_security import eventually

from echo_rl.broadcast.snapshot import RunKey
from echo_rl.control.auditor import Auditor, TokenStats, logprob_check, sampling_check
from echo_rl.control.gate import security_dir
from echo_rl.control.intake import AuditJob
from echo_rl.control.parts import Inputs
from echo_rl.control.server import LearnerServer
from echo_rl.control.work import WorkQueue
from echo_rl.core import wire
from echo_rl.core.models import load_model, params_to_payload
from echo_rl.data.adapter import load_adapter
from echo_rl.data.buffer import ReplayBuffer
from echo_rl.data.records import Limits, Record

pytestmark = pytest.mark.timeout(120)


# ----------------------------------------------------------------------------- the statistics


def _draw(rng: random.Random, probs: list[float]) -> int:
    return rng.choices(range(len(probs)), probs)[0]


def _peaked(rng: random.Random, vocab: int = 32) -> list[float]:
    """A distribution like a trained model's: one to three likely tokens, a long tail."""
    logits = [
        rng.gauss(0, 1) + (rng.uniform(3, 8) if rng.random() < 0.15 else 0.0) for _ in range(vocab)
    ]
    z = sum(math.exp(x) for x in logits)
    return [math.exp(x) / z for x in logits]


def _stats(rng: random.Random, tokens: int, honest: bool) -> TokenStats:
    lps, ents = [], []
    for _ in range(tokens):
        p = _peaked(rng)
        tok = _draw(rng, p) if honest else rng.randrange(len(p))  # garbage: not from p
        lps.append(math.log(p[tok]))
        ents.append(-sum(q * math.log(q) for q in p))
    return TokenStats(lps, ents, list(lps))


def test_sampling_check_passes_honest_samples_and_fails_chosen_tokens():
    rng = random.Random(7)
    honest = [
        sampling_check([_stats(rng, 4, True) for _ in range(8)], 1e-3, 4.0)[0] for _ in range(2000)
    ]
    # The Azuma bound allows at most 0.1% false alarms per group at alpha 1e-3 (2 expected):
    # more than 10 would mean the bound does not hold.
    assert honest.count(False) <= 10
    garbage = [
        sampling_check([_stats(rng, 4, False) for _ in range(8)], 1e-3, 4.0)[0] for _ in range(200)
    ]
    assert garbage.count(False) >= 190


def test_sampling_check_without_trained_tokens_is_no_evidence():
    # a multi-turn group where the policy never acted (the opponent folded first): nothing to
    # judge, so no strike; one garbage token in it is judged again
    empty = [TokenStats([], [], []) for _ in range(8)]
    assert sampling_check(empty, 1e-3, 4.0) == (True, {"sum": 0.0, "threshold": -0.0, "tokens": 0})
    garbage = TokenStats([math.log(1e-4)] * 6, [0.05] * 6, [math.log(1e-4)] * 6)
    assert not sampling_check([*empty, garbage], 1e-3, 4.0)[0]


def test_logprob_check_compares_per_sample_means_with_a_tolerance():
    s = TokenStats([-1.0, -2.0], [1.0, 1.0], [-1.01, -1.99])  # backend noise
    assert logprob_check([s], 0.5)[0]
    s.claimed = [-0.01, -0.01]  # fabricated: "the model was sure"
    ok, stats = logprob_check([s], 0.5)
    assert not ok and stats["max_mean_gap"] == pytest.approx(1.49)


# ----------------------------------------------------------------------------- grants


def test_group_seeds_come_from_the_learner_secret():
    def seeds(secret):
        q = WorkQueue(
            iter(lambda: _prompt(), None),
            group_size=2,
            max_outstanding=8,
            lease_timeout_s=10,
            prefix="p",
            secret=secret,
        )
        return [g.seed for g in q.grant("w", 4, 0)]

    a, b = seeds(b"s" * 32), seeds(b"t" * 32)
    assert a == seeds(b"s" * 32) and len(set(a)) == 4  # reproducible under one secret
    assert not set(a) & set(b)  # unguessable without it
    assert all(0 <= s < 2**63 for s in a)


def _prompt():
    from echo_rl.data.adapter import Prompt

    return Prompt([4, 14, 5], {"a": 1, "b": 2})


# ----------------------------------------------------------------------------- admission


@pytest.fixture
def trusting(small_cfg, tokenizer, tmp_path, request):
    """A control plane that recomputes toy-add rewards and hands audit jobs to a list
    (``@pytest.mark.strikes(N)`` sets security.strikes)."""
    mark = request.node.get_closest_marker("strikes")
    small_cfg.security.strikes = mark.args[0] if mark else 2
    lc = small_cfg.learner
    adapter = load_adapter("toy-add", {}, tokenizer)
    buffer = ReplayBuffer(lc.staleness, small_cfg.buffer.capacity_groups, lc.group_size)
    work = WorkQueue(
        adapter.prompts(random.Random(0)),
        group_size=lc.group_size,
        max_outstanding=16,
        lease_timeout_s=30,
        prefix="t",
    )
    jobs: list[AuditJob] = []
    cp = LearnerServer(
        small_cfg,
        Inputs(
            run_id="t",
            key=RunKey.generate(),
            buffer=buffer,
            work=work,
            limits=Limits(len(tokenizer), small_cfg.worker.max_new_tokens, lc.group_size),
            run_dir=tmp_path,
            adapter=adapter,
            audit=jobs.append,
        ),
    )
    cp.start()
    cp.jobs = jobs
    yield cp
    cp.shutdown("test over")


def honest(plane, group, tokenizer, **patch):
    """Records whose rewards are the adapter's own."""
    recs = records(group, **patch)
    for r in recs:
        text = tokenizer.decode(r["completion_ids"], skip_special_tokens=True)
        r["reward"] = plane.intake.adapter.reward(group.task, r["completion_ids"], text)
    return recs


@pytest.mark.strikes(3)
def test_partial_forged_and_foreign_groups_are_refused(trusting, ctx, tokenizer):  # noqa: F811
    a, b = connect(trusting, ctx), connect(trusting, ctx)
    ask(a, wire.Join(worker_id="w1"))
    ask(b, wire.Join(worker_id="w2"))
    g = ask(a, wire.WorkRequest(worker_id="w1", max_groups=3)).groups
    theirs = ask(b, wire.WorkRequest(worker_id="w2", max_groups=1)).groups[0]
    forged = honest(trusting, g[1], tokenizer)
    forged[0]["reward"] = 1.0 - forged[0]["reward"]
    ack = ask(
        a,
        batch(
            honest(trusting, g[0], tokenizer)[1:]
            + forged
            + honest(trusting, theirs, tokenizer)
            + honest(trusting, g[2], tokenizer)
        ),
    )
    assert ack.rejected == {"partial_group": 3, "reward_mismatch": 4, "not_your_group": 4}
    assert ack.accepted == 4  # g[2], whole and true
    checks = trusting.stats().checks
    assert checks == {"whole_group:fail": 1, "reward:fail": 1, "reward:ok": 1}
    assert [j.group_id for j in trusting.jobs] == [g[2].group_id]  # probation: audited


def test_two_strikes_quarantine_the_worker_and_take_its_records_out(
    trusting, ctx, tokenizer, tmp_path
):  # noqa: F811
    a = connect(trusting, ctx)
    ask(a, wire.Join(worker_id="w1"))
    g = ask(a, wire.WorkRequest(worker_id="w1", max_groups=3)).groups
    assert ask(a, batch(honest(trusting, g[0], tokenizer), "b0")).accepted == 4
    assert trusting.buffer.depth().ready_groups == 1
    lies = [
        [{**r, "reward": 1.0 - r["reward"]} for r in honest(trusting, x, tokenizer)] for x in g[1:]
    ]  # wrong answers scored 1, right ones 0
    a.send(wire.encode(batch(lies[0] + lies[1], "b1")))
    got = [wire.decode(a.recv(), 1 << 24)]
    while not isinstance(got[-1], wire.Error):
        got.append(wire.decode(a.recv(), 1 << 24))
    reply, farewell = got[-1], [m for m in got if isinstance(m, wire.Farewell)][-1]
    assert reply.reason == "banned" and "2 failed checks" in reply.detail  # told why
    # the final books, complete (the batch's refusals included), before the refusal
    assert farewell.account.state == "quarantined" and farewell.account.accepted == 4
    assert farewell.account.rejected == {"reward_mismatch": 8}
    assert farewell.account.message.startswith("quarantined: 2 failed checks")
    assert trusting.buffer.depth().ready_groups == 0  # its honest-looking group left too
    row = json.loads((security_dir(tmp_path) / "quarantine.jsonl").read_text())
    assert row["worker_id"] == "w1" and row["strikes"] == 2
    assert ask(a, wire.Heartbeat(worker_id="w1", version=0)).reason == "banned"
    assert trusting.stats().reputation["w1"] == {"audits": 3, "failures": 2, "quarantined": 1}


# ----------------------------------------------------------------------------- audits


def _auditor(cfg, tokenizer, sharpen: float, **borrow):
    """An auditor holding version 0 of a model whose output layer is scaled by ``sharpen``
    (a random-init model is near uniform: nothing can tell its samples from chosen tokens)."""
    torch.manual_seed(0)
    model = load_model(cfg.model, tokenizer, "float32").eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpen)
    tensors, payload = params_to_payload(model.named_parameters(), "float32")
    verdicts = []
    aud = Auditor(cfg, tokenizer, verdicts.append, **borrow)
    aud.add_snapshot(0, tensors, payload)
    return aud, model, verdicts


def _sample(model, prompt, n, tokens, temperature, rng):
    """``n`` honest samples: token by token from the model at ``temperature``."""
    out = []
    for i in range(n):
        ids, lps = list(prompt), []
        for _ in range(tokens):
            with torch.no_grad():
                logp = torch.log_softmax(
                    model(input_ids=torch.tensor([ids])).logits[0, -1] / temperature, -1
                )
            tok = int(torch.multinomial(logp.exp(), 1, generator=rng))
            ids.append(tok)
            lps.append(float(logp[tok]))
        out.append(
            Record(
                group_id="g",
                sample_idx=i,
                prompt_ids=list(prompt),
                completion_ids=ids[len(prompt) :],
                logprobs=lps,
                reward=0.0,
                version=0,
                worker_id="w",
                gen_s=0.0,
            )
        )
    return out


@pytest.mark.parametrize("audit_model", ["copy", "policy"])
def test_audit_passes_honest_samples_and_catches_fabrications(
    small_cfg, tokenizer, tmp_path, audit_model
):
    """Both audit models (security.audit_model) give the same verdicts; "policy" borrows the
    trainer's model between steps and hands it back bit for bit, in its training mode."""
    trainer = load_model(small_cfg.model, tokenizer, "float32").train()  # other weights: v5, say
    before = {n: p.detach().clone() for n, p in trainer.named_parameters()}
    borrow = {"borrow": trainer, "spill_to": tmp_path} if audit_model == "policy" else {}
    aud, model, verdicts = _auditor(small_cfg, tokenizer, sharpen=5.0, **borrow)  # ~0.4 nats/token
    rng = torch.Generator().manual_seed(1)
    temp = small_cfg.worker.temperature
    recs = _sample(model, [4, 14, 5], 8, 6, temp, rng)
    aud.submit(AuditJob("w", "k", recs, probation=True))
    faked = [Record(**{**vars(r), "logprobs": [x - 2.0 for x in r.logprobs]}) for r in recs]
    aud.submit(AuditJob("w", "k", faked, probation=True))
    pick = random.Random(2)  # garbage: tokens drawn from the vocabulary, not the model
    chosen = [
        Record(
            **{
                **vars(r),
                "completion_ids": [pick.randrange(3, len(tokenizer)) for _ in r.completion_ids],
                "logprobs": [-0.5] * len(r.completion_ids),
            }
        )
        for r in recs
    ]
    aud.submit(AuditJob("w", "k", chosen, probation=True))
    aud.run(budget_s=60)
    got = [(v.check, v.ok) for v in verdicts]
    assert got == [
        ("logprob", True),
        ("sampling", True),  # honest
        ("logprob", False),
        ("sampling", True),  # log-probs made up, tokens sampled
        ("logprob", False),
        ("sampling", False),
    ]  # tokens chosen
    assert verdicts[0].stats["max_mean_gap"] < 1e-4  # same weights, same arithmetic
    after = dict(trainer.named_parameters())
    assert all(torch.equal(before[n], after[n]) for n in before) and trainer.training
    assert aud.model_tensors() == [] or audit_model == "copy"  # no model of its own kept
    assert list(tmp_path.iterdir()) == []  # the saved weights' file is gone with its map


def test_audit_queue_is_bounded_and_drops_non_probation_first(small_cfg, tokenizer):
    small_cfg.security.audit_queue = 2
    aud = Auditor(small_cfg, tokenizer, lambda v: None)
    rec = Record(
        group_id="g",
        sample_idx=0,
        prompt_ids=[4],
        completion_ids=[5],
        logprobs=[-1.0],
        reward=0.0,
        version=3,
        worker_id="w",
        gen_s=0.0,
    )
    jobs = [AuditJob("w", "k", [rec], probation=p) for p in (True, False, True)]
    for j in jobs:
        aud.submit(j)
    assert aud.dropped == 1 and aud.waiting == 2
    aud.run(budget_s=10)  # version 3 was never published here: skipped and counted
    assert aud.expired == 2 and aud.done == 0


def test_a_resume_sets_aside_what_quarantined_workers_had_buffered(tmp_path):
    from echo_rl.control.reputation import Reputation, Verdict, without_quarantined

    rep = Reputation(tmp_path, strikes=1, step=lambda: 7)
    rep.record(Verdict("evil", "k", "g1", 0, "reward", False, {}))
    live = [
        Record(
            group_id=f"g{i}",
            sample_idx=0,
            prompt_ids=[4],
            completion_ids=[5],
            logprobs=[-1.0],
            reward=0.0,
            version=0,
            worker_id=w,
            gen_s=0.0,
        )
        for i, w in enumerate(["evil", "w1"])
    ]
    kept, aside = without_quarantined(live, tmp_path)
    assert [r.worker_id for r in kept] == ["w1"]
    assert [a.reason for a in aside] == ["quarantined"]
    assert json.loads((tmp_path / "quarantine.jsonl").read_text())["step"] == 7


def test_probation_audits_go_round_robin_over_workers(small_cfg, tokenizer):
    """Each newcomer's first group before anyone's second: a liar's groups wait for one round
    of the others' at most, not for all their probation groups."""
    aud = Auditor(small_cfg, tokenizer, lambda v: None)
    rec = Record(
        group_id="g",
        sample_idx=0,
        prompt_ids=[4],
        completion_ids=[5],
        logprobs=[-1.0],
        reward=0.0,
        version=0,
        worker_id="w",
        gen_s=0.0,
    )
    for w in ("a", "a", "a", "b", "b", "liar"):
        aud.submit(AuditJob(w, "k", [rec], probation=True))
    aud.submit(AuditJob("c", "k", [rec], probation=False))
    order = [aud._next().worker_id for _ in range(7)]
    assert order[:3] == ["a", "b", "liar"] and order[-1] == "c"


def test_hostile_link_reports_end_one_message_and_are_counted(trusting, ctx):  # noqa: F811
    """Installed carries the link rates the planner uses: junk types, negative, NaN and huge
    values, reports for versions never published and floods cost one message each."""
    import msgpack

    a = connect(trusting, ctx)
    ask(a, wire.Join(worker_id="w1"))
    base = {"v": wire.WIRE_VERSION, "type": "installed", "worker_id": "w1", "version": 0}
    for patch in (
        {"down_mbit": -5.0},
        {"up_mbit": float("nan")},
        {"down_mbit": "fast"},
        {"version": [1]},
    ):
        reply = ask(a, msgpack.packb({**base, **patch}))
        assert isinstance(reply, wire.Error) and reply.reason == "invalid_fields", patch
    a.send(
        wire.encode(wire.Installed(worker_id="w1", version=99, down_mbit=1e300))
    )  # never published
    for _ in range(600):  # a flood: past the per-key message rate it is refused, not served
        a.send(
            wire.encode(wire.Installed(worker_id="w1", version=0, down_mbit=1e300, up_mbit=1e300))
        )
    # the flood is served on the learner's thread: wait until it has got that far
    assert eventually(lambda: trusting.stats().limited.get("rate_limited", 0) > 0)
    assert trusting.stats().rejected["invalid_fields"] == 4
    assert "w1" not in trusting.coordinator.links.down  # no published version: nothing measured
    assert isinstance(ask(connect(trusting, ctx), wire.Join(worker_id="w2")), wire.JoinAck)
