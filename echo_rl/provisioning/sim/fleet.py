"""The simulator's fleet side, two objects: ``Provisioner`` (initial selection, the controller
and its loop, activation and release) and ``Churn`` (leaves, returns, rates and traces). Both
act on the books of ``echo_rl.provisioning.sim.state``; neither knows the learner."""

from __future__ import annotations

import heapq
from collections.abc import Callable, Generator
from typing import Any

import numpy as np
import simpy

from echo_rl.broadcast.coordinator import quantile_rank
from echo_rl.provisioning import capacity, selection
from echo_rl.provisioning.controller import (
    ACTIVATE,
    ACTIVE,
    RELEASE,
    SHORT,
    STANDBY,
    Controller,
    Decision,
    Policy,
)
from echo_rl.provisioning.sim.broadcast import BroadcastModel
from echo_rl.provisioning.sim.population import Pool
from echo_rl.provisioning.sim.state import Shared


class Provisioner:
    """Which workers are active: the initial set, then (with ``echo_rl.provisioning.controller``) the
    closed loop, fed what the control plane feeds it."""

    def __init__(
        self, shared: Shared, pool: Pool, bmodel: BroadcastModel, warnings: list[str]
    ) -> None:
        self.env, self.sc, self.rng, self.pool = shared.env, shared.sc, shared.rng, pool
        self.ws, self.snaps = shared.ws, shared.snaps
        self.ledger, self.counters = shared.ledger, shared.counters
        self.bmodel, self.warnings = bmodel, warnings
        self.ctl: Controller | None = None
        self.observe_delivered = False  # feed deliveries to the controller (measure=delivered)
        self.observe_busy = False  # ... with the batch's generation seconds (measure=busy)
        self.nominal_prior = False
        self.initial: dict[str, Any] = {}
        self.decisions: list[dict[str, Any]] = []

    def activate(self, i: int) -> None:
        ws = self.ws
        if ws.active[i]:
            return
        ws.active[i] = True
        if ws.present[i]:
            self.ledger.switch(i, True)
            self.snaps.pull_latest(i)
            ws.wake_up(i)

    def release(self, i: int) -> None:
        ws = self.ws
        if not ws.active[i]:
            return
        ws.active[i] = False
        if ws.present[i]:
            self.ledger.switch(i, False)

    def _t_bcast_for(self, chosen: np.ndarray) -> float:
        p = self.sc.provisioning
        if p.t_bcast_initial_s is not None:
            return p.t_bcast_initial_s
        plan = self.bmodel.plan(chosen)
        done = np.sort(plan.offsets) + self.snaps.reload
        if not len(done):
            return 0.0
        return float(done[quantile_rank(self.sc.broadcast.q, len(done)) - 1])

    def initial_selection(self) -> tuple[np.ndarray, float]:
        """The initial active set and the T_bcast predicted for it."""
        sc, p = self.sc, self.sc.provisioning
        L = sc.learner
        cand = np.array([i for i in range(self.ws.n) if self.ws.present[i]], dtype=np.int64)
        mu, price = self.pool.mu[cand], self.pool.price[cand]
        info: dict[str, Any] = {"method": p.selection, "candidates": int(len(cand))}
        self.initial = info

        perm = self.rng.permutation(len(cand)) if p.selection == "random" else None

        def choose(target: float) -> np.ndarray:
            if p.selection == "all":
                return cand
            if perm is not None:
                order = perm
            elif p.selection == "first":  # join order, as the learner's initial_active boot
                order = np.arange(len(cand))
            else:
                order = selection.unit_cost_order(mu, price)
            if p.active:
                return cand[np.sort(order[: p.active])]
            if p.selection == "random":
                reach = np.searchsorted(np.cumsum(mu[order]), target * (1 - 1e-9)) + 1
                return cand[np.sort(order[:reach])]
            solver = {"ours": selection.ours, "greedy": selection.greedy, "exact": selection.exact}[
                p.selection
            ]
            sel = solver(mu, price, target)
            if not sel.feasible:
                info["message"] = sel.message
            chosen: np.ndarray = cand[sel.indices]
            return chosen

        if p.selection == "all" or p.active or not len(cand):
            chosen = choose(0.0)  # no requirement involved
            t_b = self._t_bcast_for(chosen)
        else:
            # T_bcast depends on the set and the set on mu_req(T_bcast): start from the
            # broadcast to the single cheapest worker (a lower bound for growing sets) and
            # iterate to a fixed point
            chosen = cand[selection.unit_cost_order(mu, price)[:1]]
            t_b = self._t_bcast_for(chosen)
            for _ in range(6):
                try:
                    req = capacity.mu_req(L.n, L.effective_kappa, L.t_train_s, t_b)
                except capacity.Infeasible as err:
                    self.warnings.append(f"initial selection: {err}; activating every candidate")
                    chosen = cand
                    t_b = self._t_bcast_for(chosen)
                    break
                new = choose(p.alpha * req)
                new_tb = self._t_bcast_for(new)
                stable = np.array_equal(new, chosen)
                chosen, t_b = new, new_tb
                if stable:
                    break
        info.update(
            t_bcast_predicted_s=t_b,
            chosen=int(len(chosen)),
            mu=float(self.pool.mu[chosen].sum()),
            cost_per_hour=float(self.pool.price[chosen].sum()),
        )
        return chosen, t_b

    def setup_controller(self) -> None:
        p = self.sc.provisioning
        env = self.env
        self.ctl = Controller(
            Policy(
                alpha=p.alpha,
                delta=p.delta,
                window_s=p.window_s,
                warmup_s=p.warmup_s,
                probation_slots=p.probation_slots,
                probation_ready_s=p.probation_ready_s,
            ),
            clock=lambda: env.now,
            tau_s=p.tau_s,
        )
        # As the learner: no credit before delivery, unless the scenario grants the oracle's.
        self.nominal_prior = p.prior == "nominal" or p.measure == "capacity"
        for i in range(self.ws.n):
            if self.ws.present[i]:
                self.register(i)
        self.observe_delivered = p.measure in ("delivered", "busy")
        self.observe_busy = p.measure == "busy"

    def register(self, i: int) -> None:
        assert self.ctl is not None
        self.ctl.add_worker(
            self.pool.ids[i],
            self.ledger.price[i],
            state=ACTIVE if self.ws.active[i] else STANDBY,
            mu_prior=self.ledger.mu[i] if self.nominal_prior else 0.0,
            identity=self.pool.ids[i],
        )
        self.ws.registered[i] = True

    def controller_loop(self, done: Callable[[], bool]) -> Generator[simpy.Event, object, None]:
        assert self.ctl is not None
        index = {wid: i for i, wid in enumerate(self.pool.ids)}
        tick = self.sc.provisioning.tick_s
        acc = np.zeros(self.ws.n)
        mu = self.pool.mu
        ws = self.ws
        while not done():
            yield self.env.timeout(tick)
            if not self.observe_delivered:  # measure = "capacity": nominal mu_i x time
                up = (
                    np.array(ws.present)
                    & np.array(ws.active)
                    & np.array(ws.registered)
                    & (np.array(self.snaps.inst_ver) >= 0)
                )
                acc[up] += mu[up] * tick
                for i in np.flatnonzero(acc >= 1).tolist():
                    k = int(acc[i])
                    acc[i] -= k
                    self.ctl.observe(self.pool.ids[i], k)
            for d in self.ctl.tick():
                self._carry_out(d, index)

    def _carry_out(self, d: Decision, index: dict[str, int]) -> None:
        rec = {
            "time": d.time,
            "action": d.action,
            "worker": d.worker_id,
            "c_eff": d.c_eff,
            "target": d.target,
        }
        if len(self.decisions) < 300:  # the first ones; counts are in summary
            rec["reason"] = d.reason if len(self.decisions) < 50 else None
            self.decisions.append(rec)
        if d.action == ACTIVATE:
            assert d.worker_id is not None  # only SHORT names no worker
            self.counters.activations += 1
            self.activate(index[d.worker_id])
        elif d.action == RELEASE:
            assert d.worker_id is not None
            self.counters.releases += 1
            self.release(index[d.worker_id])
        elif d.action == SHORT:
            self.counters.short += 1


class Churn:
    """Workers leave and return, at random rates or from a trace. A leaver's groups in flight
    are lost, its chain children re-attach upstream, and the controller forgets it after
    ``heartbeat_timeout_s``."""

    def __init__(self, shared: Shared, prov: Provisioner, done: Callable[[], bool]) -> None:
        self.env, self.sc, self.rng = shared.env, shared.sc, shared.rng
        self.ws, self.snaps = shared.ws, shared.snaps
        self.ledger, self.counters = shared.ledger, shared.counters
        self.prov, self.done = prov, done

    def leave(self, i: int) -> None:
        ws = self.ws
        if not ws.present[i]:
            return
        self.counters.leaves += 1
        if ws.active[i]:
            self.ledger.switch(i, False)
        ws.present[i] = False
        ws.leave_epoch[i] += 1
        self.snaps.reattach_children(i, self.sc.broadcast.reattach_s)
        if ws.busy[i]:  # generating: stop now; its groups are lost (epoch check)
            ws.procs[i].interrupt("left")
        if self.prov.ctl is not None and ws.registered[i]:
            self.env.process(self._forget(i, ws.leave_epoch[i]))

    def _forget(self, i: int, epoch: int) -> Generator[simpy.Event, object, None]:
        yield self.env.timeout(self.sc.churn.heartbeat_timeout_s)
        ws = self.ws
        if ws.leave_epoch[i] == epoch and not ws.present[i] and ws.registered[i]:
            assert self.prov.ctl is not None
            self.prov.ctl.remove_worker(self.prov.pool.ids[i])
            ws.registered[i] = False
            if ws.active[i]:
                ws.active[i] = False  # the controller no longer counts it

    def join(self, i: int) -> None:
        ws = self.ws
        if ws.present[i]:
            return
        self.counters.joins += 1
        ws.present[i] = True
        if self.prov.ctl is not None:
            if not ws.registered[i]:
                ws.active[i] = False
                self.prov.register(i)
        if ws.active[i]:
            self.ledger.switch(i, True)
            self.snaps.pull_latest(i)
        ws.wake_up(i)

    def rates(self) -> Generator[simpy.Event, object, None]:
        """Random leaves and returns at the scenario's per-hour rates."""
        ch, ws = self.sc.churn, self.ws
        lam_l, lam_j = ch.leave_per_hour / 3600.0, ch.rejoin_per_hour / 3600.0
        heap: list[tuple[float, int, int]] = []
        rng = self.rng

        def schedule(i: int) -> None:
            lam = lam_l if ws.present[i] else lam_j
            if lam > 0:
                heapq.heappush(
                    heap,
                    (
                        self.env.now + float(rng.exponential(1.0 / lam)),
                        i,
                        ws.leave_epoch[i] * 2 + ws.present[i],
                    ),
                )

        for i in range(ws.n):
            schedule(i)
        while heap and not self.done():
            t, i, tag = heapq.heappop(heap)
            if t > self.env.now:
                yield self.env.timeout(t - self.env.now)
            if self.done():
                return
            if tag != ws.leave_epoch[i] * 2 + ws.present[i]:
                schedule(i)  # a trace changed its state: random churn goes on from the new one
                continue
            if ws.present[i]:
                self.leave(i)
            else:
                self.join(i)
            schedule(i)

    def trace(self, events: list[tuple[float, int, str]]) -> Generator[simpy.Event, object, None]:
        """Leaves and returns replayed from a trace (time_s, worker index, event)."""
        for t, i, ev in events:
            if t > self.env.now:
                yield self.env.timeout(t - self.env.now)
            if self.done():
                return
            (self.leave if ev == "leave" else self.join)(i)
