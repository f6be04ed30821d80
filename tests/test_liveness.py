"""The provisioner's liveness invariant and its memory across a learner restart (issue 39).

Invariant (echo_rl/provisioning/controller.py, "Liveness"): while the learner waits for data and a
standby worker exists, someone is activated within one window, whatever the controller
believes about rates. The property test drives the controller with random event sequences:
joins (new and returning keys), leaves, crashes (missed heartbeats, then removal), learner
restarts (a new controller restored from the old one's ``state()``), owners yielding, and
workers that are fast, slow or never deliver, under a requirement that may be unknown,
tiny or huge. A fake clock: no sleeps.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
from fakes import FakeClock

from echo_rl.provisioning.controller import ACTIVATE, RELEASE, STANDBY, Controller, Policy
from echo_rl.provisioning.scaling import Scaler

pytestmark = pytest.mark.timeout(120)


@dataclass
class SimWorker:
    wid: str
    identity: str
    price: float
    rate: float  # trajectories/s once ready; 0: never delivers
    load_s: float  # seconds from activation to its first work request
    yielded: bool = False
    crashed: bool = False
    ready_at: float | None = None
    carry: float = 0.0


class World:
    """A learner that consumes ``need`` trajectories per step and the workers feeding it."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.clock = FakeClock()
        self.window_s = rng.choice([1.0, 3.0, 10.0])
        tau_s = rng.choice([1.0, 10.0])
        self.policy = Policy(
            alpha=1.1,
            delta=0.2,
            window_s=self.window_s,
            warmup_s=rng.choice([0.0, 2.0, 5.0]),
            probation_slots=rng.choice([0, 1, 4]),
            probation_ready_s=rng.choice([5.0, 60.0]),
            group_size=4,
            probation_group_s=rng.choice([0.0, 5.0]),
        )
        self.tau_s = tau_s
        self.ctl = Controller(self.policy, clock=self.clock, tau_s=tau_s)
        self.workers: dict[str, SimWorker] = {}
        self.gone: list[SimWorker] = []  # left earlier; may come back with the same key
        self.buffer = 0.0
        self.waiting = True
        self.need = rng.choice([4, 16, 64])
        self.n = 0

    def join(self) -> None:
        if self.gone and self.rng.random() < 0.5:
            w = self.gone.pop(self.rng.randrange(len(self.gone)))
            w.crashed, w.ready_at, w.yielded = False, None, False
        else:
            self.n += 1
            w = SimWorker(
                f"w{self.n}",
                f"key{self.n}",
                self.rng.choice([0.0, 0.1, 0.35, 2.0]),
                self.rng.choice([0.0, 0.5, 5.0, 50.0]),
                self.rng.choice([0.0, 1.0, 20.0]),
            )
        self.workers[w.wid] = w
        boot = not self.ctl.measured_any() and len(self.ctl.active_ids()) < 1
        self.ctl.add_worker(
            w.wid, w.price, state="active" if boot else STANDBY, identity=w.identity
        )

    def leave(self, w: SimWorker) -> None:
        self.ctl.remove_worker(w.wid)
        del self.workers[w.wid]
        self.gone.append(w)

    def restart(self) -> None:
        """The learner dies and comes back with the books it saved; the workers re-join."""
        state = self.ctl.state()
        self.ctl = Controller(self.policy, clock=self.clock, tau_s=self.tau_s)
        self.ctl.restore(state)
        for w in self.workers.values():
            w.ready_at = None
            self.ctl.add_worker(w.wid, w.price, identity=w.identity)
            if w.yielded:
                self.ctl.set_yielded(w.wid, True)

    def event(self) -> None:
        r = self.rng.random()
        live = [w for w in self.workers.values() if not w.crashed]
        if r < 0.04 or not self.workers:
            self.join()
        elif r < 0.06 and live:
            self.leave(self.rng.choice(live))
        elif r < 0.07 and live:
            self.rng.choice(live).crashed = True  # silent from now on, removed later
        elif r < 0.075:
            self.restart()
        elif r < 0.09 and live:
            w = self.rng.choice(live)
            w.yielded = not w.yielded
            self.ctl.set_yielded(w.wid, w.yielded)
        elif r < 0.10:
            self.ctl.set_requirement(self.rng.choice([None, 0.0, 0.01, 5.0, 1e4]))

    def advance(self, dt: float) -> list:
        self.clock.t += dt
        active = set(self.ctl.active_ids())
        for w in list(self.workers.values()):
            if w.crashed:
                self.ctl.heartbeat(w.wid, up=False)
                if self.rng.random() < 0.2:  # the heartbeat timeout reaps it
                    self.leave(w)
                continue
            self.ctl.heartbeat(w.wid, up=True)
            if w.wid not in active:
                w.ready_at = None
                continue
            if w.ready_at is None:
                w.ready_at = self.clock.t + w.load_s
            if self.clock.t >= w.ready_at:
                self.ctl.ready(w.wid)
                w.carry += w.rate * dt
                made = int(w.carry)
                if made:
                    w.carry -= made
                    self.buffer += made
                    self.ctl.observe(w.wid, made, busy_s=made / w.rate)
        self.waiting = self.buffer < self.need
        if not self.waiting:
            self.buffer -= self.need  # one learner step
        self.ctl.waiting(self.waiting)
        return self.ctl.tick()

    def standby_candidate(self) -> bool:
        active = set(self.ctl.active_ids())
        return any(w.wid not in active and not w.yielded for w in self.workers.values())


def run_sequence(seed: int, ticks: int = 250, dt: float = 0.5) -> float:
    """Asserts the invariant along one random sequence; returns the longest time the learner
    waited with a standby worker available and nobody activated."""
    world = World(random.Random(seed))
    since: float | None = None
    worst = 0.0
    for _ in range(ticks):
        before = world.ctl
        world.event()
        restarted = world.ctl is not before
        decisions = world.advance(dt)
        waiting, candidate = world.waiting, world.standby_candidate()
        t = world.clock.t
        if restarted or any(d.action == ACTIVATE for d in decisions) or not (waiting and candidate):
            since = t if (waiting and candidate) else None
            continue
        since = t if since is None else since
        worst = max(worst, t - since)
        assert t - since <= world.window_s + dt, (
            f"seed {seed}: the learner waited {t - since:.1f} s with a standby worker and no "
            f"activation (window {world.window_s} s)"
        )
    return worst


def test_liveness_holds_over_a_thousand_random_sequences():
    worst = max(run_sequence(seed) for seed in range(1000))
    assert worst > 0  # the sequences did reach waits with standby workers (the test can fail)


def test_the_invariant_catches_a_controller_without_the_rule(monkeypatch):
    """Negative control: with the liveness rule switched off, some sequence breaks it."""
    monkeypatch.setattr(Scaler, "_liveness", lambda self, now: [])
    with pytest.raises(AssertionError, match="no activation"):
        for seed in range(1000):
            run_sequence(seed)


def test_liveness_activates_with_no_requirement_and_every_probation_failed():
    clock = FakeClock()
    ctl = Controller(Policy(window_s=3.0, warmup_s=2.0, probation_slots=0), clock=clock)
    for wid in ("a", "b"):
        ctl.add_worker(wid, 0.3)
    ctl.waiting(True)
    decisions = []
    while clock.t < 3.0:
        clock.t += 0.5
        decisions += ctl.tick()
    [d] = decisions
    assert (d.action, d.time) == (ACTIVATE, 3.0) and "liveness" in d.reason
    assert len(ctl.active_ids()) == 1
    ctl.waiting(False)  # data arrived: nothing more
    clock.t += 10.0
    assert ctl.tick() == []


def test_a_restored_controller_knows_returning_keys():
    clock = FakeClock()
    ctl = Controller(Policy(window_s=3.0, warmup_s=0.0, group_size=4), clock=clock)
    ctl.add_worker("a", 0.3, state="active", identity="KA")
    ctl.add_worker("b", 0.3, identity="KB")
    clock.t = 1.0
    ctl.ready("a")
    ctl.observe("a", 8, busy_s=2.0)
    ctl.tick()
    state = ctl.state()
    assert state["KA"] == {"mu_hat": 4.0, "failed_probations": 0, "active": True}
    again = Controller(Policy(window_s=3.0, warmup_s=0.0, group_size=4), clock=clock)
    assert again.restore({**state, "junk": {"mu_hat": -1}, "": state["KA"]}) == 2
    again.add_worker("a", 0.3, identity="KA")  # re-joins after the restart: active, measured
    again.add_worker("b", 0.3, identity="KB")
    assert again.active_ids() == ["a"]
    assert not again.on_probation("a")
    clock.t = 100.0  # nothing delivered for a long time: a measured worker is not on probation
    assert [d for d in again.tick() if d.action == RELEASE] == []


def test_probation_scales_with_the_measured_group_time():
    clock = FakeClock()
    ctl = Controller(
        Policy(window_s=3.0, warmup_s=2.0, group_size=16, probation_group_s=30.0), clock=clock
    )
    assert ctl.probation_s() == 2.0 + 3.0 + 60.0  # nothing measured: the expected group time
    ctl.add_worker("fast", 0.3, state="active", mu_prior=0.5)  # 16 / 0.5 = 32 s a group
    assert ctl.probation_s() == 2.0 + 3.0 + 64.0
    ctl.add_worker("new", 0.3, state="active")
    clock.t = 1.0
    ctl.ready("new")
    clock.t = 60.0
    ctl.observe("fast", 16, busy_s=32.0)  # still 0.5/s, measured on its busy time
    assert ctl.tick() == []  # a real model's group takes this long: still on probation
    clock.t = 70.0
    [d] = ctl.tick()
    assert (d.action, d.worker_id) == (RELEASE, "new") and "probation over" in d.reason
