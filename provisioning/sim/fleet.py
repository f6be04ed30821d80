"""The simulator's fleet side: provisioning (initial selection, the controller loop,
activation, release) and churn (leaves, returns, traces). A mixin of ``provisioning.sim.Sim``:
the methods use the simulation's state, split from it by job so each part reads on its own."""

from __future__ import annotations

import heapq
from typing import Any

import numpy as np

from broadcast.coordinator import quantile_rank
from provisioning import capacity, selection
from provisioning.controller import ACTIVATE, ACTIVE, RELEASE, SHORT, STANDBY, Controller


class FleetMixin:
    """Provisioning and churn for ``Sim`` (which defines the state these methods use)."""

    # ------------------------------------------------------------------ provisioning

    def _activate(self, i: int) -> None:
        if self.active[i]:
            return
        self.active[i] = True
        if self.present[i]:
            self._billing_on(i, True)
            self._pull_latest(i)
            self._wake(i)

    def _release(self, i: int) -> None:
        if not self.active[i]:
            return
        self.active[i] = False
        if self.present[i]:
            self._billing_on(i, False)

    def _initial_selection(self) -> np.ndarray:
        sc, p = self.sc, self.sc.provisioning
        L = sc.learner
        cand = np.array([i for i in range(self.n) if self.present[i]], dtype=np.int64)
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
                return cand[np.sort(order[:p.active])]
            if p.selection == "random":
                reach = np.searchsorted(np.cumsum(mu[order]), target * (1 - 1e-9)) + 1
                return cand[np.sort(order[:reach])]
            solver = {"ours": selection.ours, "greedy": selection.greedy,
                      "exact": selection.exact}[p.selection]
            sel = solver(mu, price, target)
            if not sel.feasible:
                info["message"] = sel.message
            return cand[sel.indices]

        def t_bcast_for(chosen: np.ndarray) -> float:
            if p.t_bcast_initial_s is not None:
                return p.t_bcast_initial_s
            plan = self.bmodel.plan(chosen)
            done = np.sort(plan.offsets) + self.reload
            if not len(done):
                return 0.0
            return float(done[quantile_rank(sc.broadcast.q, len(done)) - 1])

        if p.selection == "all" or p.active or not len(cand):
            chosen = choose(0.0)  # no requirement involved
            t_b = t_bcast_for(chosen)
        else:
            # T_bcast depends on the set and the set on mu_req(T_bcast): start from the
            # broadcast to the single cheapest worker (a lower bound for growing sets) and
            # iterate to a fixed point
            chosen = cand[selection.unit_cost_order(mu, price)[:1]]
            t_b = t_bcast_for(chosen)
            for _ in range(6):
                try:
                    req = capacity.mu_req(L.n, self.kappa, L.t_train_s, t_b)
                except capacity.Infeasible as err:
                    self.warnings.append(f"initial selection: {err}; activating every "
                                         f"candidate")
                    chosen = cand
                    t_b = t_bcast_for(chosen)
                    break
                new = choose(p.alpha * req)
                new_tb = t_bcast_for(new)
                stable = np.array_equal(new, chosen)
                chosen, t_b = new, new_tb
                if stable:
                    break
        self.t_bcast_est = t_b
        info.update(t_bcast_predicted_s=t_b, chosen=int(len(chosen)),
                    mu=float(self.pool.mu[chosen].sum()), cost_per_hour=float(
                        self.pool.price[chosen].sum()))
        return chosen

    def _setup_controller(self) -> None:
        p = self.sc.provisioning
        env = self.env
        self.ctl = Controller(alpha=p.alpha, delta=p.delta, window_s=p.window_s,
                              clock=lambda: env.now, tau_s=p.tau_s, warmup_s=p.warmup_s,
                              probation_slots=p.probation_slots,
                              probation_ready_s=p.probation_ready_s)
        # As the learner: no credit before delivery, unless the scenario grants the oracle's.
        self.nominal_prior = p.prior == "nominal" or p.measure == "capacity"
        for i in range(self.n):
            if self.present[i]:
                self._register(i)
        self.observe_delivered = p.measure in ("delivered", "busy")
        self.observe_busy = p.measure == "busy"
        self._update_requirement()

    def _register(self, i: int) -> None:
        assert self.ctl is not None
        self.ctl.add_worker(self.pool.ids[i], self.price[i],
                            state=ACTIVE if self.active[i] else STANDBY,
                            mu_prior=self.mu[i] if self.nominal_prior else 0.0,
                            identity=self.pool.ids[i])
        self.registered[i] = True

    def registered_np(self) -> np.ndarray:
        return np.array(self.registered)

    def _controller_loop(self):
        assert self.ctl is not None
        index = {wid: i for i, wid in enumerate(self.pool.ids)}
        tick = self.sc.provisioning.tick_s
        acc = np.zeros(self.n)
        mu = self.pool.mu
        while not self.done:
            yield self.env.timeout(tick)
            if not self.observe_delivered:  # measure = "capacity": nominal mu_i x time
                up = (np.array(self.present) & np.array(self.active) & self.registered_np()
                      & (np.array(self.inst_ver) >= 0))
                acc[up] += mu[up] * tick
                for i in np.flatnonzero(acc >= 1).tolist():
                    k = int(acc[i])
                    acc[i] -= k
                    self.ctl.observe(self.pool.ids[i], k)
            for d in self.ctl.tick():
                rec = {"time": d.time, "action": d.action, "worker": d.worker_id,
                       "c_eff": d.c_eff, "target": d.target}
                if len(self.decisions) < 300:  # the first ones; counts are in summary
                    rec["reason"] = d.reason if len(self.decisions) < 50 else None
                    self.decisions.append(rec)
                if d.action == ACTIVATE:
                    self.counters.activations += 1
                    self._activate(index[d.worker_id])
                elif d.action == RELEASE:
                    self.counters.releases += 1
                    self._release(index[d.worker_id])
                elif d.action == SHORT:
                    self.counters.short += 1

    # ------------------------------------------------------------------ churn

    def _leave(self, i: int) -> None:
        if not self.present[i]:
            return
        self.counters.leaves += 1
        if self.active[i]:
            self._billing_on(i, False)
        self.present[i] = False
        self.leave_epoch[i] += 1
        now = self.env.now
        c = int(self.chain_of[i])
        if c >= 0:  # children re-attach upstream and resume: a short delay, no restart
            chain = self.cur_chains[c]
            for j in chain[int(self.chain_pos[i]) + 1:].tolist():
                if self.pend_ver[j] == self.latest and self.pend_arrival[j] > now:
                    self.pend_arrival[j] += self.sc.broadcast.reattach_s
                    self.pend_install[j] += self.sc.broadcast.reattach_s
                elif self.nxt_ver[j] == self.latest and self.nxt_arrival[j] > now:
                    self.nxt_arrival[j] += self.sc.broadcast.reattach_s
            self.chain_of[i] = -1
        if self.busy[i]:  # generating: stop now; its groups are lost (epoch check)
            self.procs[i].interrupt("left")
        if self.ctl is not None and self.registered[i]:
            epoch = self.leave_epoch[i]
            self.env.process(self._forget(i, epoch))

    def _forget(self, i: int, epoch: int):
        yield self.env.timeout(self.sc.churn.heartbeat_timeout_s)
        if self.leave_epoch[i] == epoch and not self.present[i] and self.registered[i]:
            assert self.ctl is not None
            self.ctl.remove_worker(self.pool.ids[i])
            self.registered[i] = False
            if self.active[i]:
                self.active[i] = False  # the controller no longer counts it

    def _join(self, i: int) -> None:
        if self.present[i]:
            return
        self.counters.joins += 1
        self.present[i] = True
        if self.ctl is not None:
            if not self.registered[i]:
                self.active[i] = False
                self._register(i)
        if self.active[i]:
            self._billing_on(i, True)
            self._pull_latest(i)
        self._wake(i)

    def _churn_rates(self):
        ch = self.sc.churn
        lam_l, lam_j = ch.leave_per_hour / 3600.0, ch.rejoin_per_hour / 3600.0
        heap: list[tuple[float, int, int]] = []
        rng = self.rng

        def schedule(i: int) -> None:
            lam = lam_l if self.present[i] else lam_j
            if lam > 0:
                heapq.heappush(heap, (self.env.now + float(rng.exponential(1.0 / lam)), i,
                                      self.leave_epoch[i] * 2 + self.present[i]))

        for i in range(self.n):
            schedule(i)
        while heap and not self.done:
            t, i, tag = heapq.heappop(heap)
            if t > self.env.now:
                yield self.env.timeout(t - self.env.now)
            if self.done:
                return
            if tag != self.leave_epoch[i] * 2 + self.present[i]:
                schedule(i)  # a trace changed its state: random churn goes on from the new one
                continue
            if self.present[i]:
                self._leave(i)
            else:
                self._join(i)
            schedule(i)

    def _churn_trace(self, events: list[tuple[float, int, str]]):
        for t, i, ev in events:
            if t > self.env.now:
                yield self.env.timeout(t - self.env.now)
            if self.done:
                return
            (self._leave if ev == "leave" else self._join)(i)
