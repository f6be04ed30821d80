"""The controller's scaling rules: when to activate, release or swap workers, probations and
the liveness rule (the rules are described in ``echo_rl.provisioning.controller``'s docstring). A
``Scaler`` owns the hysteresis timers and the requirement and reads and updates the books of a
``echo_rl.provisioning.registry.Registry``; the controller calls it under its lock."""

from __future__ import annotations

import math

from echo_rl.provisioning.decisions import (
    ACTIVATE,
    RELEASE,
    SHORT,
    Decision,
    Policy,
    describe,
)
from echo_rl.provisioning.registry import ACTIVE, STANDBY, Registry, WorkerRecord
from echo_rl.provisioning.trades import Trades


class Scaler:
    """Decides on the books of ``reg``: call ``tick(now)`` after the measurements were folded."""

    def __init__(self, reg: Registry, policy: Policy) -> None:
        self.reg, self.p = reg, policy
        self.mu_req: float | None = None
        self._low_since: float | None = None  # C_eff < target since (None: not now)
        self._high_since: float | None = None  # C_eff > (alpha + delta) mu_req since
        self._trades = Trades(reg, policy)  # swaps and trials
        self.waiting_since: float | None = None  # the learner waits for data since (liveness)
        self._last_activation = -math.inf
        # An active worker left for good (said goodbye, banned, quarantined): capacity lost for
        # certain, not a noisy measurement, so a shortfall it leaves is met at the next tick,
        # without waiting a window (``lost_active``)
        self._replace = False

    def target(self) -> float:
        return self.p.alpha * (self.mu_req or 0.0)

    def tick(self, now: float) -> list[Decision]:
        expired = self._end_probations(now)
        if self.mu_req is None:
            self._low_since = self._high_since = None
            decisions = []
        else:
            decisions = self._decide(now)
        if any(d.action == ACTIVATE for d in decisions):
            self._last_activation = now
        decisions += self._liveness(now)
        self._trades.activated(decisions)
        return expired + decisions

    def lost_active(self) -> None:
        """An active worker is gone for good: a shortfall at the next tick is met then."""
        self._replace = True

    def yield_release(self, w: WorkerRecord, now: float) -> Decision:
        """The active worker ``w`` yielded to its owner: standby, with its books kept."""
        c_eff = self.reg.c_eff()
        w.state, w.since, w.pending, w.pending_busy = STANDBY, now, 0, 0.0
        return Decision(
            now,
            RELEASE,
            w.worker_id,
            f"{w.worker_id} yielded to its owner: standby until the machine is quiet",
            c_eff,
            self.target(),
            "yielded",
        )

    def probation_s(self) -> float:
        """How long a probationer has, from its first work request, to deliver a group:
        ``warmup_s + window_s`` plus two generation times of one group (measured across the
        fleet; ``probation_group_s`` before anything is measured)."""
        typical = self.reg.typical_mu()
        group_s = self.p.group_size / typical if typical else self.p.probation_group_s
        return self.p.warmup_s + self.p.window_s + 2 * group_s

    def _liveness(self, now: float) -> list[Decision]:
        """The learner has waited a whole window and nobody was activated in it: activate the
        best standby worker, whatever the estimates say (module docstring, "Liveness")."""
        since = self.waiting_since
        if since is None or now - max(since, self._last_activation) < self.p.window_s:
            return []
        typical = self.reg.typical_mu()
        standby = [w for w in self.reg.workers.values() if w.state == STANDBY and not w.yielded]
        if not standby:
            return []
        w = min(
            standby, key=lambda w: (w.measured and w.effective_mu <= 0, self.reg.rank(w, typical))
        )
        w.set_active(now)
        self._last_activation = now
        self._low_since = self._high_since = None
        return [
            Decision(
                now,
                ACTIVATE,
                w.worker_id,
                f"liveness: the learner has waited {now - since:.0f} s for data and "
                f"nobody was activated for a window ({self.p.window_s:g} s); "
                f"{w.worker_id} (${w.price:.3g}/h) is the best standby worker",
                self.reg.c_eff(),
                self.target(),
                "liveness",
            )
        ]

    def _end_probations(self, now: float) -> list[Decision]:
        """Active workers that delivered nothing in ``warmup_s + window_s`` go back to standby:
        no credit, and their probation slot (if they held one) goes to the next candidate."""
        limit = self.probation_s()
        out = []
        for w in sorted(self.reg.workers.values(), key=lambda w: w.worker_id):
            if w.state != ACTIVE or w.measured:
                continue
            if w.ready_at is None and now - w.activated_at >= self.p.probation_ready_s:
                why = f"never asked for work in {now - w.activated_at:.0f} s (probation_ready_s)"
            elif w.ready_at is not None and now - w.ready_at >= limit:
                why = (
                    f"delivered nothing in {now - w.ready_at:.0f} s after asking for work "
                    f"(warmup_s + window_s + 2 group times = {limit:.3g} s)"
                )
            else:
                continue
            w.state, w.mu_hat, w.ready_at = STANDBY, 0.0, None
            w.failed_probations += 1
            out.append(
                Decision(
                    now,
                    RELEASE,
                    w.worker_id,
                    f"probation over: {w.worker_id} {why}; no credit",
                    self.reg.c_eff(),
                    self.target(),
                    "probation_over",
                )
            )
        return out

    def _decide(self, now: float) -> list[Decision]:
        assert self.mu_req is not None
        p = self.p
        target = p.alpha * self.mu_req
        c_eff = self.reg.c_eff()
        low = c_eff < target
        high = c_eff > (p.alpha + p.delta) * self.mu_req
        self._low_since = _held_since(self._low_since, low, now)
        self._high_since = _held_since(self._high_since, high, now)
        acted: list[Decision] = []
        replace, self._replace = self._replace and low, False
        low_for = now - self._low_since if self._low_since is not None else 0.0
        high_for = now - self._high_since if self._high_since is not None else 0.0
        if low and (replace or low_for >= p.window_s):
            acted = self._activate(now, c_eff, target, low_for, lost=low_for < p.window_s)
        elif high and high_for >= p.window_s:
            acted = self._release(now, c_eff, target, high_for)
        if acted:
            # After acting, a condition must hold for a whole window again. Swaps below do not
            # restart these timers: they keep capacity, and a shortfall must still be met.
            self._low_since = self._high_since = None
            return acted
        traded = self._trades.tick(now, c_eff, target, trial=not high)
        if any(d.cause == "trial" for d in traded):  # an activation: fresh windows after it
            self._low_since = self._high_since = None
        return traded

    def _activate(
        self, now: float, c_eff: float, target: float, held: float, lost: bool = False
    ) -> list[Decision]:
        """Standby workers in order of unit cost until the projected C_eff reaches target.

        A measured worker's unit cost is its price over its measured throughput, and it adds
        that throughput. An unmeasured one is ranked by its price over the fleet's typical
        measured throughput (an estimate for the order only, never credit) and goes on
        probation: it adds the typical throughput to the projection, so the loop does not
        activate more while it warms up, but nothing to C_eff until it delivers. Without this
        the loop would only ever reuse workers it measured before, however pricey, and never
        find the cheap ones that joined since. Workers that failed probation come last.
        """
        typical = self.reg.typical_mu()
        why = f"C_eff {c_eff:.4g}/s < alpha*mu_req = {self.p.alpha:g} x {self.mu_req:.4g} = " + (
            f"{target:.4g}/s since an active worker left (its capacity is gone for certain: "
            f"replaced at once, not after the {self.p.window_s:g} s window)"
            if lost
            else f"{target:.4g}/s for {held:.0f} s (window {self.p.window_s:g} s)"
        )
        decisions, projected = [], c_eff + (typical or 0.0) * self.reg.on_probation()
        free = self._probation_limit(target - projected) - self.reg.on_probation()
        ranked = self.reg.standby_by_estimate(typical)
        ranked.sort(key=lambda w: self._trades.just_swapped_out(w.worker_id, now))  # stable
        for w in ranked:
            if projected >= target:
                break
            if w.measured:
                decisions.append(
                    Decision(
                        now,
                        ACTIVATE,
                        w.worker_id,
                        f"{why}; {describe(w)}, cheapest standby per "
                        f"trajectory; C_eff -> {projected + w.effective_mu:.4g}/s",
                        projected,
                        target,
                        "shortfall",
                    )
                )
                projected += w.effective_mu
            elif free > 0:
                free -= 1
                decisions.append(
                    Decision(
                        now,
                        ACTIVATE,
                        w.worker_id,
                        f"{why}; {w.worker_id} (${w.price:.3g}/h, unmeasured) on "
                        f"probation: no credit until it delivers",
                        projected,
                        target,
                        "probation",
                    )
                )
                projected += typical or 0.0
            else:
                continue
            w.set_active(now)
        if projected < target:
            decisions.append(
                Decision(
                    now,
                    SHORT,
                    None,
                    f"{why}; no standby worker left, still short by "
                    f"{target - projected:.4g}/s: add workers or lower mu_req",
                    projected,
                    target,
                    "short",
                )
            )
        return decisions

    def _probation_limit(self, shortfall: float) -> int:
        typical = self.reg.typical_mu()
        if typical is None or self.p.probation_slots == 0:
            return self.p.probation_slots
        return max(self.p.probation_slots, math.ceil(shortfall / typical))

    def _release(self, now: float, c_eff: float, target: float, held: float) -> list[Decision]:
        """The active worker with the worst unit cost whose removal keeps C_eff >= target (one
        per window), among measured workers: a probation is not cut short (cut short, a trial
        measured nobody and the same worker was tried again and again); it ends when the worker
        delivers, and its measured cost competes here from then on."""
        spare = [
            w
            for w in self.reg.workers.values()
            if w.state == ACTIVE and w.measured and c_eff - w.effective_mu >= target
        ]
        if not spare:
            return []  # over-provisioned, but every single release would undershoot
        w = max(spare, key=lambda w: (w.unit_cost, w.price, w.worker_id))
        p, mu_req = self.p, self.mu_req or 0.0
        bound = (p.alpha + p.delta) * mu_req
        reason = (
            f"C_eff {c_eff:.4g}/s > (alpha+delta)*mu_req = ({p.alpha:g}+{p.delta:g}) "
            f"x {mu_req:.4g} = {bound:.4g}/s for {held:.0f} s (window "
            f"{p.window_s:g} s); {describe(w)} has the worst unit cost of those "
            f"whose removal keeps "
            f"C_eff = {c_eff - w.effective_mu:.4g}/s >= {target:.4g}/s"
        )
        w.state = STANDBY
        return [Decision(now, RELEASE, w.worker_id, reason, c_eff, target, "surplus")]


def _held_since(since: float | None, holds: bool, now: float) -> float | None:
    """Start of the current run of ticks where the condition held (None: it does not)."""
    if not holds:
        return None
    return now if since is None else since
