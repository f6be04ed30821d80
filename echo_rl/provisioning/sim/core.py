"""The simulation itself: ``Sim`` runs the learner and publishes snapshots, and composes the
parts that do the rest (the model is described in ``echo_rl.provisioning.sim``'s docstring): the books
(``state.py``), work grants and the workers' processes (``work.py``), provisioning and churn
(``fleet.py``) and the broadcast model (``broadcast.py``)."""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Sequence
from typing import TYPE_CHECKING, NotRequired, TypedDict

import numpy as np
import simpy

from echo_rl.broadcast.coordinator import quantile_rank
from echo_rl.core.jsontypes import JsonObject, JsonValue
from echo_rl.core.steprow import COL
from echo_rl.provisioning import capacity
from echo_rl.provisioning.sim.broadcast import BroadcastModel
from echo_rl.provisioning.sim.fleet import Churn, Provisioner
from echo_rl.provisioning.sim.population import build_pool, read_trace
from echo_rl.provisioning.sim.scenario import Scenario
from echo_rl.provisioning.sim.state import Counters, Ledger, Shared, Snapshots, WorkerState
from echo_rl.provisioning.sim.summary import SimSummary
from echo_rl.provisioning.sim.work import Work

if TYPE_CHECKING:
    from echo_rl.provisioning.sim.centralized import Comparison


class StepRow(TypedDict):
    """One learner step of a simulated run, as its result lists it."""

    step: int
    version: int
    t_start: float
    wait_s: float
    train_s: float
    staleness: int
    n_active: int
    mu_active: float
    cost_usd: float


class PublicationRow(TypedDict):
    """One publication of a simulated run, as its result lists it."""

    version: int
    time: float
    recipients: int
    t_bcast_s: float
    tail_s: float
    predicted_s: float
    lower_bound_s: float | None
    streams: int
    egress_gb: float
    mode: str


class PoolInfo(TypedDict):
    workers: int  # candidates
    mu_total: float  # trajectories/s, all of them
    price_total: float  # $/h, all of them
    classes: list[str]


class SimResult(TypedDict):
    """What a simulated run returns (``Sim.run``; ``echo-rl sim --json`` writes it). The
    scenario is its dump (``Scenario.model_dump``); ``api.run_scenario`` adds the last three."""

    scenario: JsonObject
    pool: PoolInfo
    initial: JsonObject  # how the initial active set was chosen
    summary: JsonObject  # SimSummary.to_json()
    steps: list[StepRow]
    publications: list[PublicationRow]
    active_timeline: list[list[float]]  # (time, active workers, capacity, cost rate), sampled
    mu_req_history: list[tuple[float, float | None]]
    decisions: list[JsonObject]  # the controller's first ones
    warnings: list[str]
    centralized: NotRequired[Comparison]
    machine: NotRequired[JsonObject]
    started_at: NotRequired[str]


def scenario_value(result: SimResult, section: str, key: str) -> JsonValue:
    """``result["scenario"][section][key]``: a key of the scenario a result was run with."""
    table = result["scenario"][section]
    if not isinstance(table, dict):
        raise TypeError(f"scenario section {section!r} is not a table: {table!r:.80}")
    return table[key]


def scenario_number(result: SimResult, section: str, key: str) -> float:
    """``scenario_value`` of a number (an int stays one)."""
    value = scenario_value(result, section, key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"scenario key {section}.{key} is not a number: {value!r:.80}")
    return value


class Sim:
    """One simulated run: ``Sim(scenario).run()`` returns the result dict."""

    def __init__(self, sc: Scenario, *, on_step: Callable[[int], None] | None = None):
        self.sc = sc
        self.rng = np.random.default_rng(sc.run.seed)
        self.pool = build_pool(sc, self.rng)
        self.env = simpy.Environment()
        self.bmodel = BroadcastModel(sc, self.pool)
        self.on_step = on_step
        L = sc.learner
        self.S, self.kappa, self.need = L.staleness, L.effective_kappa, L.prompts_per_step
        self.n = n = len(self.pool)
        clock = self._now
        self.counters = Counters()
        self.warnings: list[str] = []
        self.ws = WorkerState(n)
        self.ledger = Ledger(self.pool.price.tolist(), self.pool.mu.tolist(), clock)
        self.snaps = Snapshots(
            n,
            sc.broadcast.reload_s,
            sc.rollout.generate_during_download,
            clock,
            self.counters,
            self.bmodel.pull_s,
        )
        shared = Shared(self.env, sc, self.rng, self.ws, self.snaps, self.ledger, self.counters)
        self.prov = Provisioner(shared, self.pool, self.bmodel, self.warnings)
        self.work = Work(
            shared,
            self.pool.ids,
            self.ledger.mu,
            self.prov,
            lambda: self.version,
            self._batch_arrived,
        )
        self.churn = Churn(shared, self.prov, lambda: self.done)
        # learner
        self.version = 0
        self.learner_ev: simpy.Event | None = None
        self.done = False
        self.stalled = False
        self.steps: list[StepRow] = []
        self.pubs: list[PublicationRow] = []
        self.t_bcast_est: float | None = None
        self.t_train_avg: float | None = None  # as the learner averages it (capacity.py)
        self.mu_req_now: float | None = None
        self.mu_req_history: list[tuple[float, float | None]] = []

    def _now(self) -> float:
        return self.env.now

    def _batch_arrived(self, buffered: int) -> None:
        ev = self.learner_ev
        if ev is not None and buffered >= self.need and not ev.triggered:
            ev.succeed()

    # ------------------------------------------------------------------ learner

    def _wait_for_batch(self, step: int) -> Generator[simpy.Event, object, bool]:
        """Wait until a batch is buffered; False when the run stalled instead."""
        env, sc, ctl = self.env, self.sc, self.prov.ctl
        self.learner_ev = env.event()
        if ctl is not None:  # the liveness rule, as echo_rl/learner/main.py tells it
            ctl.waiting(True)
        yield self.learner_ev | env.timeout(sc.run.stall_timeout_s)
        if ctl is not None:
            ctl.waiting(False)
        if not self.learner_ev.triggered:
            self.stalled = True
            self.warnings.append(
                f"stalled at step {step}: no batch for {sc.run.stall_timeout_s:g} s "
                f"(buffer {self.work.buffered}/{self.need} groups, "
                f"{self.ledger.n_active} active workers)"
            )
            return False
        self.learner_ev = None
        return True

    def _learner(self) -> Generator[simpy.Event, object, None]:
        env, sc, work, ledger = self.env, self.sc, self.work, self.ledger
        L = sc.learner
        for step in range(sc.run.steps):
            t0 = env.now
            n_active, mu_active = ledger.n_active, ledger.mu_active
            ledger.bill()
            cost0 = ledger.cost_workers
            work.evict_stale(self.version)
            if work.buffered < self.need and not (yield from self._wait_for_batch(step)):
                break
            wait = env.now - t0
            oldest = work.take(self.need, self.version)
            self.counters.trained_groups += self.need
            work.fill()
            train = L.t_train_s
            if L.t_train_cv:
                s = L.t_train_cv
                train *= float(self.rng.lognormal(-s * s / 2, s))
            yield env.timeout(train)
            ledger.bill()
            cost = L.price_per_hour * (wait + train) / 3600.0 + ledger.cost_workers - cost0
            self.steps.append(
                StepRow(
                    step=step,
                    version=self.version,
                    t_start=t0,
                    wait_s=wait,
                    train_s=train,
                    staleness=self.version - oldest,
                    n_active=n_active,
                    mu_active=mu_active,
                    cost_usd=cost,
                )
            )
            self.version += 1
            # The learner recomputes mu_req after every step from its T_train average and the
            # latest T_bcast (echo_rl/learner/provision.py CapacityFeedback): so does the simulation.
            self.t_train_avg = capacity.t_train_average(self.t_train_avg, train)
            self._update_requirement()
            work.evict_stale(self.version)
            work.fill()
            if self.version % self.kappa == 0:
                self._publish(self.version)
            if self.on_step:
                self.on_step(step)
        self.done = True

    # ------------------------------------------------------------------ broadcast

    def _publish(self, v: int) -> None:
        now = self.env.now
        self.snaps.latest = v
        idx = np.array([i for i in range(self.n) if self.ws.working(i)], dtype=np.int64)
        plan = self.bmodel.plan(idx)
        arrival = now + plan.offsets
        for j, i in enumerate(idx.tolist()):
            self.snaps.offer(i, v, float(arrival[j]))
        self.snaps.set_chains(plan.chains or [])
        done = np.sort(plan.offsets) + self.snaps.reload
        if len(done):
            k = quantile_rank(self.sc.broadcast.q, len(done))
            t_b, tail = float(done[k - 1]), float(done[-1])
        else:
            t_b = tail = 0.0
        self.pubs.append(
            PublicationRow(
                version=v,
                time=now,
                recipients=len(idx),
                t_bcast_s=t_b,  # until fraction q of recipients installed (includes reload)
                tail_s=tail,  # the last recipient
                predicted_s=plan.predicted_s,  # the planner's (slowest arrival, before reload)
                lower_bound_s=plan.lower_bound_s,
                streams=plan.streams,
                egress_gb=plan.egress_bytes / 1e9,
                mode=plan.mode,
            )
        )
        if len(idx):
            self.t_bcast_est = t_b
            self._update_requirement()

    def _update_requirement(self) -> None:
        L = self.sc.learner
        if self.t_bcast_est is None:
            return
        try:
            req = capacity.mu_req(
                L.n, self.kappa, self.t_train_avg or L.t_train_s, self.t_bcast_est
            )
        except capacity.Infeasible as err:
            req = None
            msg = f"mu_req infeasible at t={self.env.now:.0f} s: {err}"
            if not any(w.startswith("mu_req infeasible") for w in self.warnings):
                self.warnings.append(msg)
        self.mu_req_now = req
        self.mu_req_history.append((self.env.now, req))
        if self.prov.ctl is not None:
            self.prov.ctl.set_requirement(req)

    # ------------------------------------------------------------------ run

    def _start_absent(self, trace: list[tuple[float, int, str]]) -> None:
        """Workers whose first trace event is a join, and a random share, start absent."""
        first: dict[int, str] = {}
        for _, i, ev in trace:
            first.setdefault(i, ev)
        for i, ev in first.items():
            if ev == "join":
                self.ws.present[i] = False
        if self.sc.churn.start_absent:
            absent = self.rng.random(self.n) < self.sc.churn.start_absent
            for i in np.flatnonzero(absent).tolist():
                self.ws.present[i] = False

    def _provision(self) -> np.ndarray:
        sc = self.sc
        chosen, self.t_bcast_est = self.prov.initial_selection()
        for i in chosen.tolist():
            self.ws.active[i] = True
        if sc.provisioning.selection == "all" and not sc.provisioning.controller:
            # "all" means the whole pool: workers absent now work when they (re)join
            self.ws.active = [True] * self.n
        self.ledger.start(
            float(self.pool.price[chosen].sum()),
            float(self.pool.mu[chosen].sum()),
            int(len(chosen)),
        )
        return chosen

    def run(self) -> SimResult:
        sc, env = self.sc, self.env
        wall0, cpu0 = time.perf_counter(), time.process_time()
        trace = read_trace(sc, self.pool) if sc.churn.trace else []
        self._start_absent(trace)
        chosen = self._provision()
        if sc.run.warm_start:
            for i in chosen.tolist():
                self.snaps.inst_ver[i] = 0
        else:
            self._publish(0)
        if sc.provisioning.controller:
            self.prov.setup_controller()
        self._update_requirement()
        self.ws.procs = [env.process(self.work.worker(i)) for i in range(self.n)]
        learner = env.process(self._learner())
        if sc.provisioning.controller:
            env.process(self.prov.controller_loop(lambda: self.done))
        if sc.churn.trace:
            env.process(self.churn.trace(trace))
        if sc.churn.leave_per_hour or sc.churn.rejoin_per_hour:
            env.process(self.churn.rates())
        env.run(until=learner)
        self.ledger.bill()
        return results(self, time.perf_counter() - wall0, time.process_time() - cpu0)


def results(sim: Sim, wall_s: float, cpu_s: float) -> SimResult:
    """The result dict of a finished run: summary, steps, publications, timelines."""
    sc = sim.sc
    L = sc.learner
    steps = [s for s in sim.steps if s["step"] >= sc.run.measure_from_step]
    wait = sum(s["wait_s"] for s in steps)
    busy = sum(s["train_s"] for s in steps)
    cost = sum(s["cost_usd"] for s in steps)
    trained = len(steps) * L.n
    pubs = [p for p in sim.pubs if p["recipients"]]
    c = sim.counters
    G = L.group_size
    tb = [p["t_bcast_s"] for p in pubs]
    t_b_mean = float(np.mean(tb)) if tb else None
    try:
        req = (
            capacity.mu_req(L.n, sim.kappa, L.t_train_s, t_b_mean) if t_b_mean is not None else None
        )
    except capacity.Infeasible:
        req = None
    n = len(steps)
    summary = SimSummary(
        steps_done=len(sim.steps),
        steps_measured=n,
        stalled=sim.stalled,
        bubble_ratio=wait / (wait + busy) if steps else None,
        wait_s_per_step=wait / n if steps else None,
        t_train_s_per_step=busy / n if steps else None,
        staleness_max=max((s["staleness"] for s in steps), default=None),
        staleness_mean=float(np.mean([s["staleness"] for s in steps])) if steps else None,
        cost_per_step_usd=cost / n if steps else None,
        usd_per_1k_trajectories=cost / trained * 1000 if trained else None,
        cost_total_usd=cost,
        t_bcast_mean_s=t_b_mean,
        t_bcast_max_s=max(tb) if tb else None,
        publications=len(pubs),
        active_mean=float(np.mean([s["n_active"] for s in steps])) if steps else None,
        mu_active_mean=float(np.mean([s["mu_active"] for s in steps])) if steps else None,
        mu_req_at_mean_t_bcast=req,
        kappa=sim.kappa,
        n_per_step=L.n,
        sim_time_s=sim.env.now,
        trajectories={
            "delivered": c.delivered_groups * G,
            "admitted": c.admitted_groups * G,
            "trained": c.trained_groups * G,
            COL.dropped_stale: c.dropped_stale_groups * G,  # the row's name
            "lost_to_churn": c.lost_groups * G,
        },
        events={
            "installs": c.installs,
            "leaves": c.leaves,
            "joins": c.joins,
            "activations": c.activations,
            "releases": c.releases,
            "short": c.short,
        },
        wall_s=wall_s,
        cpu_s=cpu_s,
        planner_wall_s=sim.bmodel.plan_wall_s,
    )
    return {
        "scenario": sc.model_dump(exclude={"base_dir"}),
        "pool": {
            "workers": sim.n,
            "mu_total": float(sim.pool.mu.sum()),
            "price_total": float(sim.pool.price.sum()),
            "classes": sorted(set(sim.pool.cls)),
        },
        "initial": sim.prov.initial,
        "summary": summary.to_json(),  # the declared SimSummary, as the result files hold it
        "steps": list(sim.steps),
        "publications": list(sim.pubs),
        "active_timeline": _downsample(sim.ledger.timeline, 2000),
        "mu_req_history": sim.mu_req_history[-2000:],
        "decisions": sim.prov.decisions,
        "warnings": sim.warnings,
    }


def _downsample(rows: Sequence[tuple[float, ...]], limit: int) -> list[list[float]]:
    if len(rows) <= limit:
        return [list(r) for r in rows]
    keep = np.unique(np.linspace(0, len(rows) - 1, limit).astype(int))
    return [list(rows[k]) for k in keep]
