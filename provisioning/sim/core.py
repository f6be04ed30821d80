"""The simulation itself: ``Sim`` and the records it keeps (the model is described in
``provisioning.sim``'s docstring)."""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import simpy

from broadcast.coordinator import quantile_rank
from dataplane import rules
from dataplane.rules import ReadyQueue
from provisioning import capacity
from provisioning.controller import Controller
from provisioning.sim.broadcast import BroadcastModel
from provisioning.sim.fleet import FleetMixin
from provisioning.sim.scenario import Scenario, build_pool, read_trace


@dataclass
class StepRecord:
    step: int
    version: int
    t_start: float
    wait_s: float
    train_s: float
    staleness: int
    n_active: int
    mu_active: float
    cost_usd: float


@dataclass
class Publication:
    version: int
    time: float
    recipients: int
    t_bcast_s: float  # until fraction q of recipients installed (includes reload)
    tail_s: float  # last recipient
    predicted_s: float  # planner's prediction (arrival of the slowest, before reload)
    lower_bound_s: float | None
    streams: int
    egress_gb: float
    mode: str


@dataclass
class _Counters:
    delivered_groups: int = 0
    admitted_groups: int = 0
    dropped_stale_groups: int = 0  # at admission or evicted when the version moved
    lost_groups: int = 0  # in flight on a worker that left
    trained_groups: int = 0
    installs: int = 0
    leaves: int = 0
    joins: int = 0
    activations: int = 0
    releases: int = 0
    short: int = 0


# ============================================================================ the simulation


class Sim(FleetMixin):
    def __init__(self, sc: Scenario, *, on_step: Callable[[int], None] | None = None):
        self.sc = sc
        self.rng = np.random.default_rng(sc.run.seed)
        self.pool = build_pool(sc, self.rng)
        self.env = simpy.Environment()
        self.bmodel = BroadcastModel(sc, self.pool)
        self.on_step = on_step
        L = sc.learner
        self.G, self.S, self.kappa = L.group_size, L.staleness, L.effective_kappa
        self.need = L.prompts_per_step
        self.max_out = L.effective_outstanding
        self.gpr = sc.rollout.groups_per_request
        self.gdd = sc.rollout.generate_during_download
        self.reload = sc.broadcast.reload_s
        n = len(self.pool)
        self.n = n
        self.mu = self.pool.mu.tolist()
        self.price = self.pool.price.tolist()
        # per-worker state (lists: touched one element at a time in the hot loop)
        self.present = [True] * n
        self.active = [False] * n
        self.inst_ver = [-1] * n
        self.pend_ver = [-1] * n
        self.pend_arrival = [0.0] * n
        self.pend_install = [0.0] * n
        self.nxt_ver = [-1] * n  # published while the worker still fetches pend_ver
        self.nxt_arrival = [0.0] * n
        self.busy = [0] * n  # groups being generated
        self.granted = [0] * n  # groups reserved by _fill for a woken worker
        self.queued = [False] * n  # in the idle queue
        self.wake: list[simpy.Event | None] = [None] * n
        self.leave_epoch = [0] * n
        self.registered = [False] * n
        self.procs: list[simpy.Process] = []
        self.chain_of = np.full(n, -1, dtype=np.int64)
        self.chain_pos = np.full(n, -1, dtype=np.int64)
        self.cur_chains: list[np.ndarray] = []
        # learner / buffer
        self.version = 0
        self.latest = 0  # newest published snapshot
        self.buffer: ReadyQueue[None] = ReadyQueue()  # counts per version, arrival order
        self.in_flight = 0
        self.idle: deque[int] = deque()
        self.learner_ev: simpy.Event | None = None
        self.done = False
        self.stalled = False
        # accounting
        self.price_active = 0.0
        self.mu_active = 0.0
        self.n_active = 0
        self.cost_workers = 0.0  # cumulative $ of workers up to self.cost_t
        self.cost_t = 0.0
        self.timeline: list[tuple[float, int, float, float]] = []
        self.steps: list[StepRecord] = []
        self.pubs: list[Publication] = []
        self.decisions: list[dict[str, Any]] = []
        self.counters = _Counters()
        self.warnings: list[str] = []
        self.t_bcast_est: float | None = None
        self.t_train_avg: float | None = None  # as the learner averages it (capacity.py)
        self.mu_req_now: float | None = None
        self.mu_req_history: list[tuple[float, float | None]] = []
        self._jitter = np.empty(0)
        self._jit_pos = 0
        self.ctl: Controller | None = None
        self.observe_delivered = False  # feed deliveries to the controller (measure=delivered)
        self.observe_busy = False  # ... with the batch's generation seconds (measure=busy)
        self.initial: dict[str, Any] = {}

    # ------------------------------------------------------------------ helpers

    def _rand_jitter(self) -> float:
        sigma = self.sc.rollout.duration_sigma
        if not sigma:
            return 1.0
        if self._jit_pos >= len(self._jitter):
            # mean-one lognormal, drawn in batches (one numpy call per 65k requests)
            self._jitter = self.rng.lognormal(-sigma * sigma / 2, sigma, 65536)
            self._jit_pos = 0
        x = self._jitter[self._jit_pos]
        self._jit_pos += 1
        return float(x)

    def _bill(self) -> None:
        now = self.env.now
        self.cost_workers += self.price_active * (now - self.cost_t) / 3600.0
        self.cost_t = now

    def _mark_timeline(self) -> None:
        now = self.env.now
        row = (now, self.n_active, self.mu_active, self.price_active)
        if self.timeline and self.timeline[-1][0] == now:
            self.timeline[-1] = row
        else:
            self.timeline.append(row)

    def _billing_on(self, i: int, on: bool) -> None:
        self._bill()
        sign = 1 if on else -1
        self.price_active += sign * self.price[i]
        self.mu_active += sign * self.mu[i]
        self.n_active += sign
        self._mark_timeline()

    def _wake(self, i: int) -> None:
        ev = self.wake[i]
        if ev is not None and not ev.triggered:
            ev.succeed()

    # ------------------------------------------------------------------ snapshot state

    def _install_wait(self, i: int) -> float:
        """0 if worker i may start generating now, else how long to wait for its pending
        snapshot. Applies every install that is due first (a worker installs what it has
        downloaded even while it has no work, as worker/agent.py does in its loop)."""
        now = self.env.now
        while self.pend_ver[i] > self.inst_ver[i] and now >= self.pend_install[i] - 1e-9:
            self._installed(i)
        if self.pend_ver[i] > self.inst_ver[i]:
            if not self.gdd or self.inst_ver[i] < 0 or now >= self.pend_arrival[i] - 1e-9:
                return self.pend_install[i] - now
            return 0.0
        if self.inst_ver[i] < 0:
            return math.inf  # nothing to install and nothing pending: not provisioned yet
        return 0.0

    def _installed(self, i: int) -> None:
        """The pending snapshot is installed; a newer one queued behind it becomes pending
        (its bytes may have arrived meanwhile; loading waits for this install)."""
        done = self.pend_install[i]
        self.inst_ver[i] = self.pend_ver[i]
        self.counters.installs += 1
        if self.nxt_ver[i] > self.inst_ver[i]:
            self.pend_ver[i] = self.nxt_ver[i]
            self.pend_arrival[i] = max(self.nxt_arrival[i], done)
            self.pend_install[i] = self.pend_arrival[i] + self.reload
        else:
            self.pend_ver[i] = -1
        self.nxt_ver[i] = -1

    def _offer(self, i: int, v: int, arrival: float) -> None:
        """Snapshot v reaches worker i at ``arrival``. A worker still fetching an older one
        finishes that first (worker/agent.py fetches one snapshot at a time)."""
        now = self.env.now
        while self.pend_ver[i] > self.inst_ver[i] and now >= self.pend_install[i] - 1e-9:
            self._installed(i)
        if self.pend_ver[i] > self.inst_ver[i]:
            self.nxt_ver[i], self.nxt_arrival[i] = v, arrival
        else:
            self.pend_ver[i], self.pend_arrival[i] = v, arrival
            self.pend_install[i] = arrival + self.reload

    def _pull_latest(self, i: int) -> None:
        """Activation or return: fetch the current snapshot from a peer unless it has it."""
        if max(self.inst_ver[i], self.pend_ver[i], self.nxt_ver[i]) >= self.latest:
            return
        self.nxt_ver[i] = -1
        self.pend_ver[i] = -1  # a fresh pull fetches the newest directly
        self._offer(i, self.latest, self.env.now + self.bmodel.pull_s(i))

    # ------------------------------------------------------------------ work grants

    @property
    def buffered(self) -> int:
        return len(self.buffer)

    def _free_slots(self) -> int:
        return rules.room(self.max_out, self.in_flight, self.buffered)

    def _grant_size(self, i: int) -> int:
        probation = (self.ctl is not None and self.registered[i]
                     and self.ctl.on_probation(self.pool.ids[i]))
        return rules.grant_size(self.gpr, self.max_out, self.in_flight, self.buffered,
                                self.n_active, probation)

    def _fill(self) -> None:
        """Hand free slots to queued idle workers (oldest request first)."""
        while self.idle and self._free_slots() > 0:
            i = self.idle.popleft()
            self.queued[i] = False
            if not (self.present[i] and self.active[i]) or self.granted[i] or self.busy[i]:
                continue  # gone, or it already found work by itself
            if self._install_wait(i) > 0:
                self._wake(i)  # it goes to wait for its snapshot, and queues again later
                continue
            g = self._grant_size(i)
            self.granted[i] = g
            self.in_flight += g
            self._wake(i)

    def _sleep(self, i: int):
        ev = self.env.event()
        self.wake[i] = ev
        try:
            yield ev
        except simpy.Interrupt:
            pass
        self.wake[i] = None

    def _worker(self, i: int):
        env = self.env
        Gmu = self.G / self.mu[i]
        while True:
            if not (self.present[i] and self.active[i]):
                if self.granted[i]:  # reserved for it, but it was released/left meanwhile
                    self.in_flight -= self.granted[i]
                    self.granted[i] = 0
                    self._fill()
                yield from self._sleep(i)
                continue
            g = self.granted[i]
            if not g:
                wait = self._install_wait(i)
                if wait > 0:
                    if not math.isinf(wait) and self._free_slots() <= 0:
                        # no work for it anyway: queue now, _fill re-checks the install
                        # (saves one wake-up per worker and publication on large fleets)
                        if not self.queued[i]:
                            self.queued[i] = True
                            self.idle.append(i)
                        yield from self._sleep(i)
                    elif math.isinf(wait):
                        yield from self._sleep(i)
                    else:
                        try:
                            yield env.timeout(wait)
                        except simpy.Interrupt:
                            pass
                    continue
                free = self._free_slots()
                if free <= 0 or self.idle:
                    if not self.queued[i]:
                        self.queued[i] = True
                        self.idle.append(i)
                        self._fill()
                    if not self.granted[i]:
                        yield from self._sleep(i)
                    continue
                g = self._grant_size(i)
                self.in_flight += g
            else:
                self.granted[i] = 0
            u = self.inst_ver[i]
            if self.ctl is not None and self.registered[i]:
                self.ctl.ready(self.pool.ids[i])  # as a work request does (learner/control.py)
            self.busy[i] = g
            epoch = self.leave_epoch[i]
            gen_s = g * Gmu * self._rand_jitter()
            try:
                yield env.timeout(gen_s)
            except simpy.Interrupt:
                pass
            self.busy[i] = 0
            if epoch != self.leave_epoch[i]:
                # left while generating: the groups are lost (the learner re-issues them)
                self.in_flight -= g
                self.counters.lost_groups += g
                self._fill()
                continue
            self._deliver(i, g, u, gen_s)

    def _deliver(self, i: int, g: int, u: int, gen_s: float) -> None:
        self.in_flight -= g
        c = self.counters
        c.delivered_groups += g
        admitted = rules.admission(u, self.version, self.S) == rules.OK
        if self.observe_delivered and self.registered[i]:
            # learner/control.py: admitted records only, with the batch's generation seconds
            # (none when nothing was admitted: refused work earns nothing).
            self.ctl.observe(self.pool.ids[i], g * self.G if admitted else 0,
                             busy_s=gen_s if self.observe_busy and admitted else None)
        if not admitted:
            c.dropped_stale_groups += g
        else:
            c.admitted_groups += g
            self.buffer.push(u, count=g)
            ev = self.learner_ev
            if ev is not None and self.buffered >= self.need and not ev.triggered:
                ev.succeed()
        self._fill()

    # ------------------------------------------------------------------ learner

    def _evict_stale(self) -> None:
        self.counters.dropped_stale_groups += self.buffer.evict(self.version, self.S)[0]

    def _take(self, k: int) -> int:
        """Take the k oldest admissible groups; returns their oldest version."""
        return self.buffer.take(k, self.version)[0]

    def _learner(self):
        env, sc = self.env, self.sc
        L = sc.learner
        for step in range(sc.run.steps):
            t0 = env.now
            n_active, mu_active = self.n_active, self.mu_active
            self._bill()
            cost0 = self.cost_workers
            self._evict_stale()
            if self.buffered < self.need:
                self.learner_ev = env.event()
                if self.ctl is not None:  # the liveness rule, as learner/main.py tells it
                    self.ctl.waiting(True)
                yield self.learner_ev | env.timeout(sc.run.stall_timeout_s)
                if self.ctl is not None:
                    self.ctl.waiting(False)
                if not self.learner_ev.triggered:
                    self.stalled = True
                    self.warnings.append(
                        f"stalled at step {step}: no batch for {sc.run.stall_timeout_s:g} s "
                        f"(buffer {self.buffered}/{self.need} groups, "
                        f"{self.n_active} active workers)")
                    break
                self.learner_ev = None
            wait = env.now - t0
            oldest = self._take(self.need)
            self.counters.trained_groups += self.need
            self._fill()
            train = L.t_train_s
            if L.t_train_cv:
                s = L.t_train_cv
                train *= float(self.rng.lognormal(-s * s / 2, s))
            yield env.timeout(train)
            self._bill()
            cost = (L.price_per_hour * (wait + train) / 3600.0 + self.cost_workers - cost0)
            self.steps.append(StepRecord(step, self.version, t0, wait, train,
                                         self.version - oldest, n_active, mu_active, cost))
            self.version += 1
            # The learner recomputes mu_req after every step from its T_train average and the
            # latest T_bcast (learner/main.py _provisioning): so does the simulation.
            self.t_train_avg = capacity.t_train_average(self.t_train_avg, train)
            self._update_requirement()
            self._evict_stale()
            self._fill()
            if self.version % self.kappa == 0:
                self._publish(self.version)
            if self.on_step:
                self.on_step(step)
        self.done = True

    # ------------------------------------------------------------------ broadcast

    def _recipients(self) -> np.ndarray:
        return np.array([i for i in range(self.n) if self.present[i] and self.active[i]],
                        dtype=np.int64)

    def _publish(self, v: int) -> None:
        now = self.env.now
        self.latest = v
        idx = self._recipients()
        plan = self.bmodel.plan(idx)
        arrival = now + plan.offsets
        for j, i in enumerate(idx.tolist()):
            self._offer(i, v, float(arrival[j]))
        self.chain_of[:] = -1
        self.chain_pos[:] = -1
        self.cur_chains = plan.chains or []
        for c, ch in enumerate(self.cur_chains):
            self.chain_of[ch] = c
            self.chain_pos[ch] = np.arange(len(ch))
        done = np.sort(plan.offsets) + self.reload
        if len(done):
            k = quantile_rank(self.sc.broadcast.q, len(done))
            t_b, tail = float(done[k - 1]), float(done[-1])
        else:
            t_b = tail = 0.0
        self.pubs.append(Publication(v, now, len(idx), t_b, tail, plan.predicted_s,
                                     plan.lower_bound_s, plan.streams, plan.egress_bytes / 1e9,
                                     plan.mode))
        if len(idx):
            self.t_bcast_est = t_b
            self._update_requirement()

    def _update_requirement(self) -> None:
        L = self.sc.learner
        if self.t_bcast_est is None:
            return
        try:
            req = capacity.mu_req(L.n, self.kappa, self.t_train_avg or L.t_train_s,
                                  self.t_bcast_est)
        except capacity.Infeasible as err:
            req = None
            msg = f"mu_req infeasible at t={self.env.now:.0f} s: {err}"
            if not any(w.startswith("mu_req infeasible") for w in self.warnings):
                self.warnings.append(msg)
        self.mu_req_now = req
        self.mu_req_history.append((self.env.now, req))
        if self.ctl is not None:
            self.ctl.set_requirement(req)

    # ------------------------------------------------------------------ run

    def run(self) -> dict[str, Any]:
        sc, env = self.sc, self.env
        wall0, cpu0 = time.perf_counter(), time.process_time()
        trace = read_trace(sc, self.pool) if sc.churn.trace else []
        first: dict[int, str] = {}
        for _, i, ev in trace:
            first.setdefault(i, ev)
        for i, ev in first.items():
            if ev == "join":
                self.present[i] = False
        if sc.churn.start_absent:
            absent = self.rng.random(self.n) < sc.churn.start_absent
            for i in np.flatnonzero(absent).tolist():
                self.present[i] = False
        chosen = self._initial_selection()
        for i in chosen.tolist():
            self.active[i] = True
        if sc.provisioning.selection == "all" and not sc.provisioning.controller:
            # "all" means the whole pool: workers absent now work when they (re)join
            self.active = [True] * self.n
        self._bill()
        self.price_active = float(self.pool.price[chosen].sum())
        self.mu_active = float(self.pool.mu[chosen].sum())
        self.n_active = int(len(chosen))
        self._mark_timeline()
        if sc.run.warm_start:
            for i in chosen.tolist():
                self.inst_ver[i] = 0
        else:
            self._publish(0)
        if sc.provisioning.controller:
            self._setup_controller()
        else:
            self._update_requirement()
        self.procs = [env.process(self._worker(i)) for i in range(self.n)]
        learner = env.process(self._learner())
        if sc.provisioning.controller:
            env.process(self._controller_loop())
        if sc.churn.trace:
            env.process(self._churn_trace(trace))
        if sc.churn.leave_per_hour or sc.churn.rejoin_per_hour:
            env.process(self._churn_rates())
        env.run(until=learner)
        self._bill()
        return self._results(time.perf_counter() - wall0, time.process_time() - cpu0)

    # ------------------------------------------------------------------ report

    def _results(self, wall_s: float, cpu_s: float) -> dict[str, Any]:
        sc = self.sc
        L = sc.learner
        steps = [s for s in self.steps if s.step >= sc.run.measure_from_step]
        wait = sum(s.wait_s for s in steps)
        busy = sum(s.train_s for s in steps)
        cost = sum(s.cost_usd for s in steps)
        trained = len(steps) * L.n
        pubs = [p for p in self.pubs if p.recipients]
        c = self.counters
        G = self.G
        tb = [p.t_bcast_s for p in pubs]
        t_b_mean = float(np.mean(tb)) if tb else None
        try:
            req = (capacity.mu_req(L.n, self.kappa, L.t_train_s, t_b_mean)
                   if t_b_mean is not None else None)
        except capacity.Infeasible:
            req = None
        summary = {
            "steps_done": len(self.steps),
            "steps_measured": len(steps),
            "stalled": self.stalled,
            "bubble_ratio": wait / (wait + busy) if steps else None,
            "wait_s_per_step": wait / len(steps) if steps else None,
            "t_train_s_per_step": busy / len(steps) if steps else None,
            "staleness_max": max((s.staleness for s in steps), default=None),
            "staleness_mean": float(np.mean([s.staleness for s in steps])) if steps else None,
            "cost_per_step_usd": cost / len(steps) if steps else None,
            "usd_per_1k_trajectories": cost / trained * 1000 if trained else None,
            "cost_total_usd": cost,
            "t_bcast_mean_s": t_b_mean,
            "t_bcast_max_s": max(tb) if tb else None,
            "publications": len(pubs),
            "active_mean": float(np.mean([s.n_active for s in steps])) if steps else None,
            "mu_active_mean": float(np.mean([s.mu_active for s in steps])) if steps else None,
            "mu_req_at_mean_t_bcast": req,
            "kappa": self.kappa,
            "n_per_step": L.n,
            "sim_time_s": self.env.now,
            "trajectories": {"delivered": c.delivered_groups * G, "admitted": c.admitted_groups * G,
                             "trained": c.trained_groups * G,
                             "dropped_stale": c.dropped_stale_groups * G,
                             "lost_to_churn": c.lost_groups * G},
            "events": {"installs": c.installs, "leaves": c.leaves, "joins": c.joins,
                       "activations": c.activations, "releases": c.releases, "short": c.short},
            "wall_s": wall_s,
            "cpu_s": cpu_s,  # this process's CPU time: robust to other load on the machine
            "planner_wall_s": self.bmodel.plan_wall_s,
        }
        return {
            "scenario": sc.model_dump(exclude={"base_dir"}),
            "pool": {"workers": self.n, "mu_total": float(self.pool.mu.sum()),
                     "price_total": float(self.pool.price.sum()),
                     "classes": sorted(set(self.pool.cls))},
            "initial": self.initial,
            "summary": summary,
            "steps": [s.__dict__ for s in self.steps],
            "publications": [p.__dict__ for p in self.pubs],
            "active_timeline": _downsample(self.timeline, 2000),
            "mu_req_history": self.mu_req_history[-2000:],
            "decisions": self.decisions,
            "warnings": self.warnings,
        }


def _downsample(rows: list[tuple], limit: int) -> list[list[float]]:
    if len(rows) <= limit:
        return [list(r) for r in rows]
    keep = np.unique(np.linspace(0, len(rows) - 1, limit).astype(int))
    return [list(rows[k]) for k in keep]
