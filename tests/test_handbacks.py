"""Issue 31, items 3 and 4: hand-backs are work products (echo_rl.control.handbacks) and staleness is
not free (learner.staleness, echo_rl.provisioning.controller). Hostile cases and the honest ones next
to them: a forged prefix is refused and its author struck, never the continuer; a hand-back
flood is bounded; a cherry-picker is flagged, an honest returner is not; a worker delivering
at the staleness edge earns less credit and is swapped first."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch
from fakes import FakeClock
from test_control import ask, batch, connect, ctx, plane, records  # noqa: F401 (fixtures)
from test_trust import _sample, honest

from echo_rl.broadcast.snapshot import RunKey
from echo_rl.control.auditor import Auditor
from echo_rl.control.handback import PrefixLimits
from echo_rl.control.handbacks import Handbacks, bias_threshold, checkpoint, midrank
from echo_rl.control.parts import Inputs
from echo_rl.control.server import LearnerServer
from echo_rl.control.staleness import Staleness, credit
from echo_rl.control.work import WorkQueue
from echo_rl.core import wire
from echo_rl.core.config import SecurityConfig
from echo_rl.core.models import load_model, params_to_payload
from echo_rl.data.adapter import Prompt, load_adapter
from echo_rl.data.buffer import ReplayBuffer
from echo_rl.data.records import Limits, Record
from echo_rl.provisioning.controller import ACTIVE, Controller, Policy

pytestmark = pytest.mark.timeout(120)


# ----------------------------------------------------------------------------- a checked plane


@pytest.fixture
def checked(small_cfg, tokenizer, tmp_path):
    """A control plane whose prefix checks go to a real auditor holding version 0 of a
    sharpened tiny model (a random-init model is near uniform); the test runs the auditor,
    as the trainer thread does between steps."""
    lc = small_cfg.learner
    small_cfg.transport.heartbeat_timeout_s = 120  # the test's clients send no heartbeats
    adapter = load_adapter("toy-add", {}, tokenizer)
    buffer = ReplayBuffer(lc.staleness, small_cfg.buffer.capacity_groups, lc.group_size)
    work = WorkQueue(
        adapter.prompts(random.Random(0)),
        group_size=lc.group_size,
        max_outstanding=16,
        lease_timeout_s=120,
        prefix="t",
    )
    torch.manual_seed(0)
    model = load_model(small_cfg.model, tokenizer, "float32").eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(5.0)
    box: list[LearnerServer] = []
    aud = Auditor(small_cfg, tokenizer, lambda v: box[0].report(v))
    aud.add_snapshot(0, *params_to_payload(model.named_parameters(), "float32"))
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
            audit=aud.submit,
        ),
    )
    box.append(cp)
    cp.start()
    cp.auditor, cp.model = aud, model
    yield cp
    cp.shutdown("test over")


def _handback(sock, worker, group, prefixes):
    return ask(
        sock,
        wire.Handback(
            worker_id=worker,
            reason="preempted",
            groups=[group.group_id],
            prefixes={group.group_id: prefixes},
        ),
    )


def _forged(group, n_tokens=3):
    """Tokens the sender never sampled, claimed at log-prob -9999 (issue 31, attack 2)."""
    pick = random.Random(5)
    return [
        wire.Prefix(
            sample_idx=i,
            ids=[pick.randrange(3, 24) for _ in range(n_tokens)],
            logprobs=[-9999.0] * n_tokens,
            versions=[[0, n_tokens]],
        )
        for i in range(group.n)
    ]


def test_a_forged_prefix_is_refused_and_its_author_struck_never_the_continuer(
    checked, ctx, tokenizer
):  # noqa: F811
    evil, b = connect(checked, ctx), connect(checked, ctx)
    ask(evil, wire.Join(worker_id="evil"))
    ask(b, wire.Join(worker_id="w1"))
    (g,) = ask(evil, wire.WorkRequest(worker_id="evil", max_groups=1)).groups
    ack = _handback(evil, "evil", g, _forged(g))
    assert ack.groups == 1 and ack.prefixes == g.n  # taken back, held for the check
    # held: nobody may continue it before the check
    first = ask(b, wire.WorkRequest(worker_id="w1", max_groups=4)).groups
    assert g.group_id not in [x.group_id for x in first]
    checked.auditor.run(budget_s=60)  # the trainer thread, between two steps
    stats = checked.stats()  # runs on the loop after the verdicts that were queued before it
    assert checked.reputation.strikes["evil"] >= 1 and "evil" in checked.reputation.quarantined
    assert stats.handbacks["checks_failed"] == 1 and stats.handbacks["refused_forged"] == g.n
    assert stats.checks.get("handback_logprob:fail") == 1
    # the group goes out again without the forged prefixes; its continuer is not blamed
    again = ask(
        b, wire.WorkRequest(worker_id="w1", max_groups=1, holding=[x.group_id for x in first])
    )
    assert [x.group_id for x in again.groups] == [g.group_id] and again.groups[0].prefixes == []
    assert (
        ask(b, batch([dict(r, worker_id="w1") for r in honest(checked, g, tokenizer)])).accepted
        == g.n
    )
    assert checked.reputation.strikes["w1"] == 0 and "w1" not in checked.reputation.quarantined
    assert ask(evil, wire.Heartbeat(worker_id="evil", version=0)).reason == "banned"


def test_an_honest_prefix_passes_its_check_and_is_continued(checked, ctx):  # noqa: F811
    a, b = connect(checked, ctx), connect(checked, ctx)
    ask(a, wire.Join(worker_id="w0"))
    ask(b, wire.Join(worker_id="w1"))
    (g,) = ask(a, wire.WorkRequest(worker_id="w0", max_groups=1)).groups
    rng = torch.Generator().manual_seed(3)
    sampled = _sample(checked.model, g.prompt_ids, g.n, 3, checked.cfg.worker.temperature, rng)
    cut = [
        wire.Prefix(sample_idx=i, ids=r.completion_ids, logprobs=r.logprobs, versions=[[0, 3]])
        for i, r in enumerate(sampled)
    ]
    ack = _handback(a, "w0", g, cut)
    assert isinstance(ack, wire.HandbackAck), ack
    assert ack.prefixes == g.n
    checked.auditor.run(budget_s=60)
    stats = checked.stats()
    assert stats.handbacks["checks_passed"] == 1 and not checked.reputation.strikes
    assert stats.checks == {"handback_logprob:ok": 1, "handback_sampling:ok": 1}
    (cont,) = ask(b, wire.WorkRequest(worker_id="w1", max_groups=1)).groups
    assert cont.group_id == g.group_id and cont.prefixes == cut  # continued, not regenerated


def test_prefix_checks_go_to_new_keys_then_to_a_random_share(small_cfg):
    sc = small_cfg.security
    sc.handback_probation, sc.handback_audit_rate = 2, 0.0
    work = _queue()
    jobs = []
    hb = Handbacks(sc, work, jobs.append, rng=random.Random(0))
    lim = PrefixLimits(100, 8, -1e4, 2)
    for i in range(4):
        (g,) = work.grant("w", 1, 0)
        hb.receive("w", "kw", _msg("w", g, [_prefix()]), 0, lim)
        if jobs and i < 2:
            hb.verdict(_pass(jobs[-1]))
            hb.verdict(_pass(jobs[-1], "handback_sampling"))
        work.fulfilled(g.group_id)  # someone continued it; the next grant is a new group
    assert len(jobs) == 2  # the first two groups of the key, then none at rate 0
    assert hb.counts["checks_passed"] == 2 and hb.counts["unchecked_groups"] == 2


def _pass(job, check="handback_logprob"):
    from echo_rl.control.reputation import Verdict

    return Verdict(job.worker_id, job.key, job.group_id, job.version, check, True, {})


def test_a_check_that_never_comes_back_releases_the_group_without_its_prefixes(small_cfg):
    clock = FakeClock()
    work = _queue()
    hb = Handbacks(small_cfg.security, work, lambda job: None, clock=clock)
    (g,) = work.grant("w", 1, 0)
    old = list(g.prefixes)
    hb.receive("w", "kw", _msg("w", g, [_prefix()]), 0, PrefixLimits(100, 8, -1e4, 2))
    assert work.grant("x", 1, 0)[0].group_id != g.group_id  # held
    clock.t = small_cfg.security.handback_hold_s + 1
    assert hb.expire() == 1
    (again,) = work.grant("y", 1, 0)
    assert again.group_id == g.group_id and again.prefixes == old


# ----------------------------------------------------------------------------- bounds


def _queue(clock=None) -> WorkQueue:
    prompts = (Prompt([1, 2], {"i": i}) for i in itertools.count())
    return WorkQueue(
        prompts,
        group_size=2,
        max_outstanding=64,
        lease_timeout_s=60,
        prefix="r",
        clock=clock or FakeClock(),
    )


def _prefix(i=0, ids=(5, 6)):
    return wire.Prefix(
        sample_idx=i, ids=list(ids), logprobs=[-0.5] * len(ids), versions=[[0, len(ids)]]
    )


def _msg(worker, g, prefixes):
    return wire.Handback(
        worker_id=worker, reason="preempted", groups=[g.group_id], prefixes={g.group_id: prefixes}
    )


def test_a_handback_flood_is_bounded_by_rate_and_share_and_counted(small_cfg):
    clock = FakeClock()
    sc = small_cfg.security  # defaults: share 0.5, allowance 16, 16 groups a minute
    work = _queue(clock)
    hb = Handbacks(sc, work, None, clock=clock)
    lim = PrefixLimits(100, 8, -1e4, 2)
    kept = []
    for _ in range(100):  # take one group, hand it back at once, 100 times in 10 s
        clock.t += 0.1
        (g,) = work.grant("flood", 1, 0)
        kept.append(hb.receive("flood", "kf", _msg("flood", g, [_prefix()]), 0, lim).prefixes)
        work.fulfilled(g.group_id)  # another worker completed it
    refused = {k: v for k, v in hb.counts.items() if k.startswith("refused_over")}
    assert sum(kept) <= sc.handback_allowance + 1  # the burst, and what 10 s of rate refills
    assert sum(refused.values()) == 100 - sum(kept)
    book = hb.per_worker("flood")
    assert book["handed_back"] == 100 and book["limited"] == 100 - sum(kept)
    assert work.handed_back["flood"] == 100 and hb.capped("flood")
    # over time the rate lets it hand back again, but past its share it stays refused
    clock.t += 3600
    (g,) = work.grant("flood", 1, 0)
    assert hb.receive("flood", "kf", _msg("flood", g, [_prefix()]), 0, lim).refused == {
        "over_share": 1
    }


def test_an_honest_preemption_keeps_its_prefixes(small_cfg):
    clock = FakeClock()
    work = _queue(clock)
    hb = Handbacks(small_cfg.security, work, None, clock=clock)
    lim = PrefixLimits(100, 8, -1e4, 2)
    delivered = work.grant("w", 40, 0)
    for g in delivered:
        work.fulfilled(g.group_id)
    grant = work.grant("w", 8, 0)  # preempted in the middle of this grant
    msg = wire.Handback(
        worker_id="w",
        reason="preempted",
        groups=[g.group_id for g in grant],
        prefixes={g.group_id: [_prefix(0), _prefix(1)] for g in grant},
    )
    ack = hb.receive("w", "kw", msg, 0, lim)
    assert ack.groups == 8 and ack.prefixes == 16 and not ack.refused
    assert not hb.capped("w")


def test_the_flood_is_refused_on_a_live_plane_and_the_flooder_gets_one_group_a_request(plane, ctx):  # noqa: F811
    a = connect(plane, ctx)
    ask(a, wire.Join(worker_id="w1"))
    kept = 0
    for _ in range(40):
        (g,) = ask(a, wire.WorkRequest(worker_id="w1", max_groups=1)).groups
        kept += _handback(a, "w1", g, [_prefix()]).prefixes
    stats = plane.stats()
    assert kept <= 17 and stats.workers["w1"]["handed_back"] == 40
    assert stats.workers["w1"]["limited"] >= 40 - 17
    assert stats.handbacks["refused_over_rate"] + stats.handbacks["refused_over_share"] >= 40 - 17
    assert len(ask(a, wire.WorkRequest(worker_id="w1", max_groups=4)).groups) == 1  # capped


# ----------------------------------------------------------------------------- cherry-picking


def _group_rewards(rng):
    return [rng.choice([0.0, 0.1, 0.5, 0.75, 1.0]) for _ in range(4)]


def _recs(rewards, worker):
    return [
        Record(
            group_id="g",
            sample_idx=i,
            prompt_ids=[1],
            completion_ids=[2],
            logprobs=[-1.0],
            reward=r,
            version=0,
            worker_id=worker,
        )
        for i, r in enumerate(rewards)
    ]


def _run_fleet(hb, rng, returner, share, picks, groups=600):
    """``groups`` completions; ``returner`` hands back ``share`` of the groups it got: at
    random, or (``picks``) the ones it likes least; an honest worker completes each group."""
    for _ in range(groups):
        rewards = _group_rewards(rng)
        mean = sum(rewards) / len(rewards)
        back = mean <= 0.3 if picks else rng.random() < share
        hb.completed("honest", _recs(rewards, "honest"), (returner,) if back else ())


def test_a_cherry_picker_is_flagged_and_its_prefixes_refused(small_cfg):
    work = _queue()
    hb = Handbacks(small_cfg.security, work, None)
    _run_fleet(hb, random.Random(1), "picker", 0.5, picks=True)
    book = hb.per_worker("picker")
    assert book["cherry_pick"] == "low" and book["returns_pct"] < 0.3
    assert hb.counts["cherry_pick_flagged"] == 1
    (g,) = work.grant("picker", 1, 0)
    ack = hb.receive(
        "picker", "kp", _msg("picker", g, [_prefix()]), 0, PrefixLimits(100, 8, -1e4, 2)
    )
    assert ack.groups == 1 and ack.refused == {"biased_returns": 1}


def test_honest_returners_are_not_flagged():
    """100 honest workers, each returning a random share of 600 groups: none is flagged (the
    bound allows at most alpha = 1e-3 per worker over its life, union bound: 0.1 expected)."""
    sc = SecurityConfig()
    for seed in range(100):
        hb = Handbacks(sc, _queue(), None)
        rng = random.Random(seed)
        _run_fleet(hb, rng, "w", rng.uniform(0.05, 0.5), picks=False)
        assert not hb.per_worker("w")["cherry_pick"], seed


def test_midrank_and_the_union_bound():
    assert midrank(0.5, [0.0, 0.5, 1.0, 0.5]) == 0.5
    assert midrank(2.0, [0.0, 1.0]) == 1.0 and midrank(-1.0, [0.0]) == 0.0
    assert bias_threshold(32, 1e-3, 0) > bias_threshold(256, 1e-3, 10) > 0.1
    # the levels alpha / ((k + 1) (k + 2)) of all checkpoints sum to alpha
    assert sum(1e-3 / ((k + 1) * (k + 2)) for k in range(10**6)) == pytest.approx(1e-3, rel=1e-5)
    ks = [k for k in range(60) if checkpoint(k, 32) <= 1000]
    assert len(ks) == 16 and checkpoint(ks[-1], 32) <= 1000 < checkpoint(ks[-1] + 1, 32)
    # a picker at a mean percentile of 0.40 over ~1,000 returns: flagged by the checkpoints,
    # not by a test at every n, which spends alpha on each of the 1,000
    n, k = checkpoint(ks[-1], 32), ks[-1]
    assert 0.5 - bias_threshold(n, 1e-3, k) > 0.40
    assert 0.5 - math.sqrt(math.log(2 * 1000 * 1001 / 1e-3) / 2000) < 0.40


def test_a_worker_returning_at_a_mean_percentile_of_040_is_flagged(small_cfg):
    """The drill's picker under load (security_drill.json): returns at mean 0.40."""
    hb = Handbacks(small_cfg.security, _queue(), None)
    b = hb._book("p")
    rng = random.Random(0)
    for _ in range(1000):
        b.returns_n += 1
        b.returns_u += min(1.0, max(0.0, rng.gauss(0.40, 0.25)))
        hb._judge("p", b)
    assert b.flagged == "low"


# ----------------------------------------------------------------------------- staleness


def test_credit_falls_with_staleness_and_never_to_zero():
    assert [credit(s, 2, 0.5) for s in (0, 1, 2, 5)] == [1.0, 0.75, 0.5, 0.5]
    assert credit(3, 0, 0.5) == 1.0
    st = Staleness(bound=2, discount=0.5)
    fresh = _recs([0.0] * 4, "f")
    cont = [Record(**{**vars(r), "version": 1, "versions": [[1, 1], [4, 1]]}) for r in fresh]
    assert st.admitted("f", fresh, 0) == 4.0
    assert st.admitted("edge", fresh, 2) == 2.0
    assert st.admitted("cont", cont, 4) == 4.0  # the prefix author's staleness is not its own
    assert st.view("edge")["at_edge"] == 1.0 and st.view("f")["credit_per_trajectory"] == 1.0


def _controller(clock):
    c = Controller(Policy(alpha=1.0, delta=0.5, window_s=10, warmup_s=0), clock=clock, tau_s=10)
    for w in ("fresh", "edge"):
        c.add_worker(w, price=1.0, state=ACTIVE, mu_prior=1.0)
    c.add_worker("standby", price=1.0, mu_prior=1.0)
    c.set_requirement(1.5)
    return c


@pytest.mark.parametrize("discounted", [True, False])
def test_the_edge_holder_earns_less_and_is_swapped_first(discounted):
    """Two active workers at the same price and rate; one delivers at the staleness edge.
    With the discount its credit halves and it is swapped for the measured standby worker;
    without it (credit = delivered, the old rule) nobody is swapped."""
    clock = FakeClock()
    c = _controller(clock)
    decisions = []
    for _ in range(30):
        clock.t += 1.0
        for w in c.active_ids():  # the same rate for all; "edge" delivers 2 versions behind
            s = 2 if w == "edge" else 0
            c.observe(w, 4, busy_s=4.0, credit=4 * credit(s, 2, 0.5) if discounted else None)
        decisions += c.tick()
    mu = {w.worker_id: w.mu_hat for w in c.workers()}
    swaps = [(d.action, d.worker_id) for d in decisions]
    if discounted:
        assert mu["edge"] < 0.8 * mu["fresh"]  # swapped once its credit fell below 80 %
        assert ("release", "edge") in swaps and ("release", "fresh") not in swaps
        assert c.active_ids() == ["fresh", "standby"]
    else:
        assert swaps == [] and c.active_ids() == ["edge", "fresh"]


def test_a_stale_honest_worker_is_still_activated_when_capacity_is_short():
    """A slow link's deliveries are discounted by what they are worth, never refused: short of
    capacity, the controller activates it (at 0.75 credit per trajectory) all the same."""
    clock = FakeClock()
    c = Controller(Policy(alpha=1.0, delta=0.5, window_s=10, warmup_s=0), clock=clock, tau_s=10)
    c.add_worker("slow", price=0.1, state=ACTIVE)
    c.set_requirement(10.0)
    for _ in range(30):
        clock.t += 1.0
        c.observe("slow", 4, busy_s=4.0, credit=4 * credit(1, 2, 0.5))
        c.tick()
    assert "slow" in c.active_ids()
    assert [w.mu_hat for w in c.workers()][0] == pytest.approx(0.75, rel=0.05)


def test_deliveries_at_the_edge_show_in_the_books_of_a_live_plane(plane, ctx):  # noqa: F811
    a, b = connect(plane, ctx), connect(plane, ctx)
    ask(a, wire.Join(worker_id="w1"))
    ask(b, wire.Join(worker_id="w2"))
    (ga,) = ask(a, wire.WorkRequest(worker_id="w1", max_groups=1)).groups
    (gb,) = ask(b, wire.WorkRequest(worker_id="w2", max_groups=1)).groups
    plane.buffer.set_version(2)
    assert ask(a, batch(records(ga, version=0))).accepted == ga.n  # held to the edge
    recs = [dict(r, worker_id="w2") for r in records(gb, version=2)]
    assert (
        ask(
            b,
            wire.Trajectories(
                worker_id="w2", batch_id="b2", count=len(recs), payload=wire.pack_records(recs)
            ),
        ).accepted
        == gb.n
    )
    workers = plane.stats().workers
    assert workers["w1"]["credit_per_trajectory"] == 0.5 and workers["w1"]["at_edge"] == 1.0
    assert workers["w2"]["credit_per_trajectory"] == 1.0 and workers["w2"]["staleness_mean"] == 0.0
