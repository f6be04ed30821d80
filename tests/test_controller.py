"""Closed-loop provisioning controller, driven by a fake clock (no sleeps)."""

import pytest
from fakes import FakeClock

from echo_rl.provisioning.controller import (
    ACTIVATE,
    RELEASE,
    SHORT,
    Controller,
    Policy,
    UnknownWorker,
)


def make(
    window_s: float = 60.0, tau_s: float = 60.0, avail_beta: float = 0.2, **kw
) -> tuple[Controller, FakeClock]:
    clock = FakeClock()
    policy = Policy(alpha=1.1, delta=0.2, window_s=window_s, **kw)
    return Controller(policy, clock=clock, tau_s=tau_s, avail_beta=avail_beta), clock


def run(ctl: Controller, clock: FakeClock, until: float, rates: dict[str, int], step: float = 1.0):
    """Advance to ``until``; each active worker asks for work (``ready``) and delivers at its
    true integer rate per second, so measured throughput equals the rate exactly. Returns all
    decisions taken."""
    decisions = []
    while clock.t < until:
        clock.t += step
        for wid in ctl.active_ids():
            ctl.ready(wid)
            ctl.observe(wid, int(rates[wid] * step))
        decisions += ctl.tick()
    return decisions


def test_no_action_before_the_window_then_activation():
    # mu_req 10 -> target alpha*mu_req = 11; active w0 delivers 5/s: C_eff 5 < 11 from t=1
    ctl, clock = make()
    ctl.add_worker("w0", price=1.0, state="active", mu_prior=5)
    # unit cost 0.19 against w0's 0.2: not the 20 % a swap needs, so only hysteresis acts
    ctl.add_worker("s1", price=1.9, mu_prior=10)
    ctl.set_requirement(10.0)
    rates = {"w0": 5, "s1": 10}
    assert run(ctl, clock, 60.0, rates) == []  # low since t=1, held 59 s < 60 s
    [d] = run(ctl, clock, 61.0, rates)  # held 60 s at t=61
    assert (d.action, d.worker_id, d.time) == (ACTIVATE, "s1", 61.0)
    assert ctl.active_ids() == ["s1", "w0"]
    assert ctl.c_eff() == pytest.approx(15.0)


def test_condition_must_hold_for_the_whole_window():
    ctl, clock = make()
    ctl.add_worker("w0", price=1.0, state="active", mu_prior=5)
    # unit cost 0.19 against w0's 0.2: not the 20 % a swap needs, so only hysteresis acts
    ctl.add_worker("s1", price=1.9, mu_prior=10)
    rates = {"w0": 5, "s1": 10}
    ctl.set_requirement(10.0)  # target 11 > 5: low
    assert run(ctl, clock, 30.0, rates) == []
    ctl.set_requirement(4.0)  # target 4.4 <= 5 <= (1.1+0.2)*4 = 5.2: neither low nor high
    assert run(ctl, clock, 40.0, rates) == []
    ctl.set_requirement(10.0)  # low again from t=41: the earlier 30 s do not count
    assert run(ctl, clock, 100.0, rates) == []  # held 59 s
    [d] = run(ctl, clock, 101.0, rates)
    assert d.action == ACTIVATE and d.time == 101.0


def test_activation_order_is_by_unit_cost_and_short_is_reported():
    # target 1.1 * 20 = 22; active w0 gives 5. Standby unit costs ($/h per traj/s):
    # big 3/10 = 0.3, mid 2/4 = 0.5, small 1/1 = 1.0 -> activate big (15), mid (19), small (20),
    # still 2 short of 22: a SHORT decision says so
    ctl, clock = make(window_s=10.0)
    ctl.add_worker("w0", price=1.0, state="active", mu_prior=5)
    ctl.add_worker("small", price=1.0, mu_prior=1)
    ctl.add_worker("mid", price=2.0, mu_prior=4)
    ctl.add_worker("big", price=3.0, mu_prior=10)
    ctl.set_requirement(20.0)
    decisions = run(ctl, clock, 11.0, {"w0": 5, "small": 1, "mid": 4, "big": 10})
    assert [(d.action, d.worker_id) for d in decisions] == [
        (ACTIVATE, "big"),
        (ACTIVATE, "mid"),
        (ACTIVATE, "small"),
        (SHORT, None),
    ]
    assert "still short by 2/s" in decisions[-1].reason


def test_activation_stops_once_the_gap_is_closed():
    # target 11, C_eff 5: the cheapest per trajectory (big, 10/s) alone closes it
    ctl, clock = make(window_s=10.0)
    ctl.add_worker("w0", price=1.0, state="active", mu_prior=5)
    ctl.add_worker("mid", price=2.0, mu_prior=4)
    ctl.add_worker("big", price=3.0, mu_prior=10)
    ctl.set_requirement(10.0)
    decisions = run(ctl, clock, 11.0, {"w0": 5, "mid": 4, "big": 10})
    assert [d.worker_id for d in decisions] == ["big"]


def test_release_priciest_that_keeps_the_constraint_one_per_window():
    # mu_req 10: target 11, release above (1.1+0.2)*10 = 13. Active a($3, 2/s), b($2, 2/s),
    # c($1, 12/s): C_eff 16. Without a: 14 >= 11 ok; without b: 14 ok; without c: 4 no.
    # -> release a (priciest) at t=11. C_eff 14 > 13 still, but the timers restart: high again
    # from the tick at t=12, so b goes at t=22 (14 - 2 = 12 >= 11). Then 12 <= 13: stop.
    ctl, clock = make(window_s=10.0)
    for wid, price, mu in (("a", 3.0, 2), ("b", 2.0, 2), ("c", 1.0, 12)):
        ctl.add_worker(wid, price=price, state="active", mu_prior=mu)
    ctl.set_requirement(10.0)
    rates = {"a": 2, "b": 2, "c": 12}
    decisions = run(ctl, clock, 11.0, rates)
    assert [(d.action, d.worker_id, d.time) for d in decisions] == [(RELEASE, "a", 11.0)]
    assert run(ctl, clock, 21.0, rates) == []  # timers restarted after the release
    decisions = run(ctl, clock, 100.0, rates)
    assert [(d.action, d.worker_id, d.time) for d in decisions] == [(RELEASE, "b", 22.0)]
    assert ctl.active_ids() == ["c"]
    assert ctl.c_eff() == pytest.approx(12.0)  # >= target 11
    assert ctl.cost_per_hour() == pytest.approx(1.0)


def test_no_release_when_every_removal_would_undershoot():
    # C_eff 20 > 13 but the only worker is needed (20 - 20 < 11)
    ctl, clock = make(window_s=10.0)
    ctl.add_worker("only", price=5.0, state="active", mu_prior=20)
    ctl.set_requirement(10.0)
    assert run(ctl, clock, 100.0, {"only": 20}) == []


def test_decisions_carry_reasons_with_numbers():
    ctl, clock = make(window_s=10.0)
    # w0 $0.2/h at 5/s and s1 $0.36/h at 10/s: s1 only 10 % cheaper per trajectory, no swap
    ctl.add_worker("w0", price=0.2, state="active", mu_prior=5)
    ctl.add_worker("s1", price=0.36, mu_prior=10)
    ctl.set_requirement(10.0)
    [d] = run(ctl, clock, 11.0, {"w0": 5, "s1": 10})
    assert "C_eff 5/s < alpha*mu_req = 1.1 x 10 = 11/s for 10 s (window 10 s)" in d.reason
    # $0.36/h at 10/s: 0.36 / 3600 / 10 * 1000 = $0.01 per 1k trajectories
    assert "s1 ($0.36/h" in d.reason and "$0.01 per 1k trajectories" in d.reason
    assert (d.c_eff, d.target) == (pytest.approx(5.0), pytest.approx(11.0))
    assert list(ctl.history) == [d]


def test_estimate_follows_measurements_not_the_claim():
    # claims 20/s, delivers 2/s. mu_req 1: target 1.1, release above 1.3.
    # At first C_eff = 20 (prior); measurements pull it to 2 (EWMA, tau 60 s).
    ctl, clock = make(window_s=1e9, tau_s=60.0, warmup_s=30.0)
    ctl.add_worker("liar", price=1.0, state="active", mu_prior=20)
    ctl.set_requirement(1.0)
    run(ctl, clock, 29.0, {"liar": 2})
    assert ctl.c_eff() == pytest.approx(20.0)  # warm-up (30 s): prior kept
    run(ctl, clock, 29.0 + 600.0, {"liar": 2})  # 10 time constants: 2 + 18 e^-10 = 2.0008
    assert ctl.c_eff() == pytest.approx(2.0, rel=1e-3)


def test_silent_worker_decays_and_triggers_activation():
    ctl, clock = make(window_s=10.0, tau_s=10.0, warmup_s=0.0)
    ctl.add_worker("dead", price=1.0, state="active", mu_prior=20)
    ctl.add_worker("spare", price=1.0, mu_prior=20)
    # target 11. dead: mu_hat = 20 e^(-t/10), so its unit cost is e^(t/10) / 20 per traj/s
    # against spare's 1 / 20. The swap check at every tick trades them once spare is 20 %
    # cheaper: e^(t/10) >= 1.25, t >= 2.23, the tick at t = 3 (C_eff 14.8 -> 20), long
    # before dead alone would have made the loop short for a whole window.
    ctl.set_requirement(10.0)
    decisions = run(ctl, clock, 200.0, {"dead": 0, "spare": 20})
    assert [(d.action, d.worker_id, d.time) for d in decisions] == [
        (ACTIVATE, "spare", 3.0),
        (RELEASE, "dead", 3.0),
    ]
    assert ctl.active_ids() == ["spare"] and ctl.c_eff() == pytest.approx(20.0, rel=0.01)


def test_availability_from_heartbeats_scales_capacity():
    ctl, clock = make(avail_beta=0.5)
    ctl.add_worker("w", price=1.0, state="active", mu_prior=10)
    ctl.heartbeat("w", up=False)  # a: 1 -> 0.5
    assert ctl.c_eff() == pytest.approx(5.0)
    ctl.heartbeat("w", up=False)  # 0.5 -> 0.25
    ctl.heartbeat("w", up=True)  # 0.25 -> 0.625
    assert ctl.c_eff() == pytest.approx(6.25)


def test_standby_deliveries_are_ignored_and_unknown_workers_raise():
    ctl, clock = make(warmup_s=0.0)
    ctl.add_worker("s", price=1.0, mu_prior=3)
    ctl.observe("s", 1000)  # finishing old leases after a release: not a measurement
    clock.t = 10.0
    ctl.tick()
    [status] = ctl.workers()
    assert status.mu_hat == 3 and status.state == "standby"
    with pytest.raises(UnknownWorker, match="add_worker first"):
        ctl.observe("nobody", 1)
    ctl.remove_worker("s")
    with pytest.raises(UnknownWorker):
        ctl.heartbeat("s")


def test_no_requirement_no_decisions():
    ctl, clock = make(window_s=0.0)
    ctl.add_worker("s", price=1.0, mu_prior=3)
    clock.t = 100.0
    assert ctl.tick() == []


def test_invalid_arguments():
    ctl, _ = make()
    ctl.add_worker("w", price=1.0)
    with pytest.raises(ValueError, match="already registered"):
        ctl.add_worker("w", price=1.0)
    with pytest.raises(ValueError, match="state must be"):
        ctl.add_worker("x", price=1.0, state="on")
    with pytest.raises(ValueError, match="price"):
        ctl.add_worker("y", price=-1.0)
    with pytest.raises(ValueError, match="mu_req"):
        ctl.set_requirement(float("nan"))
    with pytest.raises(ValueError, match="alpha"):
        Controller(Policy(alpha=0.0))


def test_every_release_keeps_the_target():
    # 12 workers of mixed speed (1..4 /s, 30 in all), requirement stepping down: after every
    # tick that released someone, C_eff >= alpha * mu_req still holds
    ctl, clock = make(window_s=5.0)
    rates = {f"w{i}": 1 + i % 4 for i in range(12)}
    for wid, mu in rates.items():
        ctl.add_worker(wid, price=1.0 + mu / 10, state="active", mu_prior=mu)
    releases = 0
    for req in (20.0, 12.0, 5.0):
        ctl.set_requirement(req)
        end = clock.t + 200.0
        while clock.t < end:
            decisions = run(ctl, clock, clock.t + 1.0, rates)
            assert all(d.action == RELEASE for d in decisions)
            releases += len(decisions)
            assert ctl.c_eff() >= 1.1 * req - 1e-9
    assert releases > 0


def test_busy_time_measures_capacity_not_demand():
    """A worker handed little work (the learner's outstanding cap) is not mistaken for a slow
    one when deliveries come with the seconds spent producing them."""
    from echo_rl.provisioning.controller import Controller

    clock = FakeClockForBusy()
    c = Controller(Policy(alpha=1.1, delta=0.2, window_s=5, warmup_s=0.0), clock=clock, tau_s=1.0)
    c.add_worker("idle-ish", price=1.0, state="active", mu_prior=1.0)
    c.add_worker("demand", price=1.0, state="active", mu_prior=1.0)
    for _ in range(60):  # each second: 10 trajectories made in 0.1 s of work, then idle
        clock.t += 1.0
        c.observe("idle-ish", 10, busy_s=0.1)
        c.observe("demand", 10)
        c.tick()
    rates = {w.worker_id: w.mu_hat for w in c.workers()}
    assert rates["idle-ish"] == pytest.approx(100.0, rel=0.01)  # capacity: 10 / 0.1 s
    assert rates["demand"] == pytest.approx(10.0, rel=0.01)  # wall-clock rate: 10 / 1 s
    clock.t += 10.0  # no deliveries for a while: no evidence of slowness in busy mode
    c.tick()
    assert {w.worker_id: w.mu_hat for w in c.workers()}["idle-ish"] == pytest.approx(
        100.0, rel=0.01
    )


class FakeClockForBusy:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


# ------------------------------------------------------------------ no credit before delivery


def test_fake_free_joiners_never_outbid_a_measured_paying_worker():
    # honest: $2/h, unmeasured at first (mu_prior 0, as the learner registers every joiner),
    # delivers 10/s. mu_req 8: target 8.8 <= 10 <= 10.4, neither low nor high once measured.
    ctl, clock = make(window_s=20.0, tau_s=5.0, warmup_s=10.0, probation_slots=3)
    ctl.add_worker("honest", price=2.0, state="active")
    ctl.set_requirement(8.0)
    rates = {"honest": 10}
    run(ctl, clock, 60.0, rates)
    fakes = [f"fake{i:04d}" for i in range(1000)]
    for f in fakes:  # $0 and silent: the cheapest bid there is
        ctl.add_worker(f, price=0.0)
        rates[f] = 0
    # Capacity met: the fakes get trials (echo_rl.provisioning.trades), one at a time, one per window,
    # each at most once; none gains credit or displaces the honest worker.
    most, decisions = 0, []
    while clock.t < 400.0:
        decisions += run(ctl, clock, clock.t + 1.0, rates)
        active = ctl.active_ids()
        assert "honest" in active and len(active) <= 2
        most = max(most, len(active) - 1)
    trials = [d for d in decisions if d.action == ACTIVATE]
    assert most == 1 and trials and all(d.cause == "trial" for d in trials)
    assert len({d.worker_id for d in trials}) == len(trials)  # nobody tried twice
    gaps = [b.time - a.time for a, b in zip(trials, trials[1:])]
    assert min(gaps) >= 20.0  # one per window
    assert all(d.cause == "probation_over" for d in decisions if d.action == RELEASE)
    assert ctl.c_eff() == pytest.approx(10.0, rel=1e-3)
    # Now short (target 22 > 10): unmeasured workers go on probation, a bounded few at a time.
    ctl.set_requirement(20.0)
    most = 0
    for _ in range(600):
        run(ctl, clock, clock.t + 1.0, rates)
        active = ctl.active_ids()
        assert "honest" in active
        most = max(most, len(active) - 1)
    # As many as the shortfall is worth in typical measured workers (ceil(12 / 10) = 2, each
    # expected to add the honest worker's 10/s), within probation_slots, and never more.
    assert most == 2
    assert ctl.c_eff() == pytest.approx(10.0, rel=1e-3)  # the fakes added no credit
    status = {w.worker_id: w for w in ctl.workers()}
    assert all(status[f].mu_hat == 0 for f in fakes)
    released = [d for d in ctl.history if d.action == RELEASE]
    assert released and all("probation over" in d.reason for d in released)


def test_probation_measures_a_real_worker_and_credits_it():
    ctl, clock = make(window_s=20.0, tau_s=5.0, warmup_s=10.0, probation_slots=1)
    ctl.add_worker("honest", price=2.0, state="active", mu_prior=10)
    ctl.add_worker("fake", price=0.0)
    ctl.add_worker("new", price=1.0)
    ctl.set_requirement(15.0)  # target 16.5 > 10: short
    rates = {"honest": 10, "fake": 0, "new": 8}
    run(ctl, clock, 400.0, rates)
    # fake (cheaper) went first, delivered nothing and was sent back; new then got the slot,
    # delivered and now counts; fake never gained credit.
    first = [(d.action, d.worker_id) for d in ctl.history if d.action != SHORT][:3]
    assert first == [(ACTIVATE, "fake"), (RELEASE, "fake"), (ACTIVATE, "new")]
    status = {w.worker_id: w for w in ctl.workers()}
    assert status["new"].state == "active" and status["new"].mu_hat == pytest.approx(8, rel=0.01)
    assert status["fake"].mu_hat == 0
    assert ctl.c_eff() == pytest.approx(18.0, rel=0.01)


def test_no_probation_slots_means_only_measured_workers():
    ctl, clock = make(window_s=5.0, warmup_s=0.0, probation_slots=0)
    ctl.add_worker("honest", price=2.0, state="active", mu_prior=10)
    ctl.add_worker("new", price=0.0)
    ctl.set_requirement(15.0)
    decisions = run(ctl, clock, 100.0, {"honest": 10, "new": 5})
    assert ctl.active_ids() == ["honest"]
    assert decisions and all(d.action == SHORT for d in decisions)


def test_probation_clock_starts_when_the_worker_asks_for_work():
    """Loading a real model takes minutes: a probationer is judged from its first work request,
    and one that never asks is sent back after probation_ready_s."""
    ctl, clock = make(window_s=5.0, warmup_s=2.0, probation_slots=2, probation_ready_s=100.0)
    ctl.add_worker("slow_loader", price=1.0)
    ctl.add_worker("silent", price=1.0)
    ctl.set_requirement(5.0)
    while clock.t < 60:  # both on probation; neither has asked for work yet
        clock.t += 1
        ctl.tick()
    assert sorted(ctl.active_ids()) == ["silent", "slow_loader"]
    ctl.ready("slow_loader")  # loaded at t=60, delivers from t=61
    while clock.t < 120:
        clock.t += 1
        ctl.observe("slow_loader", 4)
        ctl.tick()
    assert "slow_loader" in ctl.active_ids()
    released = [d for d in ctl.history if d.action == RELEASE]
    assert [d.worker_id for d in released] == ["silent"] and "never asked" in released[0].reason


# ------------------------------------------------------------------ memory, estimates, exploration


def busy_run(ctl: Controller, clock: FakeClock, until: float, rates: dict[str, float]):
    """As ``run``, but each delivery carries its busy seconds (what the control plane feeds)."""
    decisions = []
    while clock.t < until:
        clock.t += 1.0
        for wid in ctl.active_ids():
            ctl.ready(wid)
            if rates.get(wid):
                ctl.observe(wid, int(rates[wid]), busy_s=1.0)
        decisions += ctl.tick()
    return decisions


def test_first_measurement_is_the_rate_not_an_ewma_from_zero():
    ctl, clock = make(window_s=20.0, tau_s=600.0, warmup_s=5.0)
    ctl.add_worker("w", price=1.0, state="active")
    busy_run(ctl, clock, 7.0, {"w": 10})
    assert {w.worker_id: w.mu_hat for w in ctl.workers()}["w"] == pytest.approx(10.0)


def test_a_returning_identity_keeps_its_measurement_a_new_one_does_not():
    ctl, clock = make(window_s=20.0, tau_s=5.0, warmup_s=5.0)
    ctl.add_worker("w", price=1.0, state="active", identity="key-A")
    busy_run(ctl, clock, 30.0, {"w": 10})
    ctl.remove_worker("w")
    ctl.add_worker("w", price=1.0, identity="key-B")  # same name, another key: a stranger
    assert {w.worker_id: w.mu_hat for w in ctl.workers()}["w"] == 0.0
    ctl.remove_worker("w")
    ctl.add_worker("w", price=1.0, identity="key-A")
    status = {w.worker_id: w for w in ctl.workers()}["w"]
    assert status.mu_hat == pytest.approx(10.0) and status.state == "standby"


def test_a_cheap_newcomer_is_tried_before_a_measured_pricey_worker():
    # measured: "base" 10/s at $1; "pricey" 10/s at $5 (standby). New "cheap" at $0.5,
    # unmeasured: estimated at the typical 10/s, so $0.05 per traj/s against pricey's $0.5.
    ctl, clock = make(window_s=10.0, tau_s=5.0, warmup_s=2.0, probation_slots=1)
    ctl.add_worker("base", price=1.0, state="active")
    ctl.add_worker("pricey", price=5.0, mu_prior=10.0)
    ctl.set_requirement(5.0)
    busy_run(ctl, clock, 30.0, {"base": 10})
    ctl.add_worker("cheap", price=0.5)
    ctl.set_requirement(15.0)  # target 16.5: short by one typical worker
    decisions = busy_run(ctl, clock, 60.0, {"base": 10, "cheap": 10, "pricey": 10})
    activated = [d.worker_id for d in decisions if d.action == "activate"]
    assert activated[0] == "cheap" and "pricey" not in activated
    assert ctl.c_eff() == pytest.approx(20.0, rel=0.01)


def test_probation_grows_with_the_shortfall_in_typical_workers():
    ctl, clock = make(window_s=10.0, tau_s=5.0, warmup_s=2.0, probation_slots=1)
    ctl.add_worker("base", price=1.0, state="active")
    ctl.set_requirement(5.0)
    busy_run(ctl, clock, 30.0, {"base": 10})
    for i in range(20):
        ctl.add_worker(f"n{i:02d}", price=1.0)
    ctl.set_requirement(45.0)  # target 49.5: short by 39.5, i.e. 4 typical workers
    decisions = busy_run(ctl, clock, 41.0, {"base": 10})
    assert sum(d.action == "activate" for d in decisions) == 4


def test_swap_trades_a_pricey_active_worker_for_a_cheaper_measured_standby_one():
    ctl, clock = make(window_s=10.0, tau_s=5.0, warmup_s=0.0)
    ctl.add_worker("pricey", price=5.0, state="active", mu_prior=10)
    ctl.add_worker("cheap", price=1.0, mu_prior=10)  # measured before (a trusted prior here)
    ctl.add_worker("close", price=4.5, mu_prior=10)  # only 10 % cheaper: never swapped in
    ctl.set_requirement(8.0)  # target 8.8 <= 10 <= 10.4: steady
    decisions = run(ctl, clock, 30.0, {"pricey": 10, "cheap": 10, "close": 10})
    assert [(d.action, d.worker_id) for d in decisions] == [
        (ACTIVATE, "cheap"),
        (RELEASE, "pricey"),
    ]
    assert ctl.active_ids() == ["cheap"]


def test_a_worker_without_a_proven_key_is_not_remembered():
    ctl, clock = make(window_s=20.0, tau_s=5.0, warmup_s=5.0)
    ctl.add_worker("w", price=1.0, state="active", identity=None)  # plaintext: no key proven
    busy_run(ctl, clock, 30.0, {"w": 10})
    ctl.remove_worker("w")
    ctl.add_worker("w", price=1.0, identity=None)
    assert {w.worker_id: w.mu_hat for w in ctl.workers()}["w"] == 0.0


def test_a_yielded_worker_is_standby_not_dead_and_comes_back_when_needed():
    """docs/preemption.md: the owner took the machine. The worker goes to standby with its
    measured throughput kept, is not picked while yielded, and is picked again after."""
    ctl, clock = make(window_s=5.0, warmup_s=0.0, tau_s=1.0)
    ctl.add_worker("cheap", 0.2, state="active", mu_prior=10.0)
    ctl.add_worker("dear", 0.9, mu_prior=10.0)
    ctl.set_requirement(8.0)  # one worker's 10/s covers 1.1 x 8
    run(ctl, clock, 10, {"cheap": 10, "dear": 10})
    assert ctl.active_ids() == ["cheap"]
    release = ctl.set_yielded("cheap", True)
    assert release is not None and release.action == RELEASE and "yielded" in release.reason
    assert ctl.set_yielded("cheap", True) is None  # already yielded: nothing to do
    decisions = run(ctl, clock, 30, {"cheap": 10, "dear": 10})
    assert ctl.active_ids() == ["dear"]  # the gap is closed by the other worker, not by it
    assert not any(d.worker_id == "cheap" and d.action == ACTIVATE for d in decisions)
    (cheap,) = [w for w in ctl.workers() if w.worker_id == "cheap"]
    assert cheap.state == "standby" and cheap.mu_hat == pytest.approx(10.0, rel=0.05)
    assert ctl.set_yielded("cheap", False) is None
    run(ctl, clock, 60, {"cheap": 10, "dear": 10})
    assert "cheap" in ctl.active_ids()  # back in the pool, and the cheapest per trajectory


def test_an_active_worker_gone_for_good_is_replaced_at_the_next_tick_not_after_a_window():
    """Issue 55: a small fleet with public.toml's 300 s windows banned one of its two active
    volunteers; the standby one was not activated within 45 s (it would have waited 5 minutes).
    Capacity that left for good (a goodbye, a ban, a quarantine) is gone for certain: replaced
    at once. A standby worker's departure changes nothing, and a silent timeout (which may be a
    blip, and is the simulator's churn) waits the window."""
    ctl, clock = make(window_s=300.0)
    ctl.add_worker("w0", price=1.0, state="active", mu_prior=6)
    ctl.add_worker("w1", price=1.0, state="active", mu_prior=6)
    ctl.add_worker("s1", price=1.0, mu_prior=6)
    ctl.add_worker("s2", price=1.0, mu_prior=6)
    ctl.set_requirement(10.0)  # target 11 <= 12: enough
    rates = {w: 6 for w in ("w0", "w1", "s1", "s2")}
    assert run(ctl, clock, 30.0, rates) == []
    ctl.remove_worker("s2", gone_for_good=True)  # a standby leaving: nothing to replace
    assert run(ctl, clock, 40.0, rates) == []
    ctl.remove_worker("w1", gone_for_good=True)  # banned: C_eff 6 < 11
    [d] = run(ctl, clock, 41.0, rates)
    assert (d.action, d.worker_id, d.time) == (ACTIVATE, "s1", 41.0)
    assert "an active worker left" in d.reason and "replaced at once" in d.reason
    # the next shortfall is a measured one again: it waits its window
    ctl.add_worker("s3", price=1.0, mu_prior=6)
    rates["s3"] = 6
    ctl.set_requirement(20.0)
    assert run(ctl, clock, 300.0, rates) == []
    acted = run(ctl, clock, 345.0, rates)  # (and SHORT: 18 < 22 with every worker active)
    assert [d.worker_id for d in acted if d.action == ACTIVATE] == ["s3"]


def test_an_active_worker_timing_out_waits_the_window_as_a_blip_may():
    ctl, clock = make(window_s=300.0)
    for w, state in (("w0", "active"), ("w1", "active"), ("s1", "standby")):
        ctl.add_worker(w, price=1.0, state=state, mu_prior=6)
    ctl.set_requirement(10.0)
    rates = {"w0": 6, "w1": 6, "s1": 6}
    assert run(ctl, clock, 30.0, rates) == []
    ctl.remove_worker("w1")  # no heartbeat: it may be back in a minute
    assert run(ctl, clock, 330.0, rates) == []
    [d] = run(ctl, clock, 332.0, rates)
    assert d.worker_id == "s1" and "for 300 s (window 300 s)" in d.reason


def test_a_member_that_joins_a_full_fleet_is_tried_and_kept_if_cheaper():
    # Issue 55: a small fleet's third volunteer joined after two were active and met the
    # level; nobody is activated when capacity is met, so it stood by unmeasured (and unpaid)
    # for the whole run. mu_req 13: target 14.3 <= 16 <= 16.9, neither low nor high.
    ctl, clock = make(window_s=20.0, tau_s=5.0, warmup_s=10.0)
    ctl.add_worker("a", price=1.0, state="active")
    ctl.add_worker("b", price=1.0, state="active")
    ctl.set_requirement(13.0)
    rates = {"a": 10, "b": 6, "late": 10, "dear": 10}
    run(ctl, clock, 80.0, rates)
    ctl.add_worker("dear", price=5.0)  # $5/h at the typical 10/s: dearer than any active one
    ctl.add_worker("late", price=1.0)
    decisions = run(ctl, clock, 120.0, rates)
    trial = [d for d in decisions if d.action == ACTIVATE]
    assert [(d.worker_id, d.cause) for d in trial] == [("late", "trial")]
    assert trial[0].time <= 80.0 + 20.0 + 1.0  # within a window
    assert "unmeasured" in trial[0].reason and "dearest active" in trial[0].reason
    decisions += run(ctl, clock, 300.0, rates)
    # measured at 10/s, C_eff 26 > 16.9: the surplus rule releases the worst unit cost, b's
    assert sorted(ctl.active_ids()) == ["a", "late"]
    assert [(d.worker_id, d.cause) for d in decisions if d.action == RELEASE] == [("b", "surplus")]
    assert "dear" not in {d.worker_id for d in decisions}  # never tried: it could not win
