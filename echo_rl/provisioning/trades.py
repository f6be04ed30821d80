"""Rules that change who works, not how much: swaps and trials (``echo_rl.provisioning.scaling`` calls
them at every tick once the level rules have nothing to do).

* **Swap**: an active worker with one of the worst measured unit costs is traded for a measured
  standby worker at least ``SWAP_GAIN`` cheaper per trajectory, capacity kept; at most
  ``SWAP_SHARE`` of the active set per window. Churn otherwise leaves whatever replaced the
  leavers active for good, while cheaper measured workers wait in standby. A worker the loop
  activated is not swapped out within a window of it, and one a swap released is the shortfall
  rule's last choice for a window (``tests/test_public_example.py``: no volunteer flipped twice
  within minutes unless it fails).
* **Trial**: swaps need a measurement, and a worker is measured only when it works. A fleet
  that has enough capacity activates nobody, so a member that joined after it filled waited in
  standby unmeasured for the whole run, however cheap (issue 55: a small public fleet's only
  relay-capable volunteer earned nothing). When the level is met (not above the release bound)
  and nobody is on probation, at most one never-tried standby worker per window whose price
  over the fleet's typical rate is at most the worst active unit cost, and below every measured
  standby worker's, goes on probation (``cause = "trial"``; the level timers restart, as after
  any activation): it delivers and is measured, and after a window the surplus and swap rules
  keep whichever workers are cheaper. One that delivers nothing goes back by the probation rule and
  is not tried again.
"""

from __future__ import annotations

from echo_rl.provisioning.decisions import (
    ACTIVATE,
    RELEASE,
    SWAP_GAIN,
    SWAP_SHARE,
    Decision,
    Policy,
    describe,
)
from echo_rl.provisioning.registry import ACTIVE, STANDBY, Registry


class Trades:
    """Swaps and trials on the books of ``reg``, each within its budget per window."""

    def __init__(self, reg: Registry, policy: Policy) -> None:
        self.reg, self.p = reg, policy
        self._swap_window: float | None = None  # start of the current swap budget's window
        self._swapped = 0  # swaps made in it
        self._last_trial: float | None = None
        # workers the controller activated within the last window -> when (``activated``)
        self._recent: dict[str, float] = {}
        self._swapped_out: dict[str, float] = {}  # released by a swap within the last window

    def activated(self, decisions: list[Decision]) -> None:
        """The tick's activations: none of these workers is swapped out within a window of it
        (a volunteer is not flipped twice in a window unless it fails; a trial lasts a
        window)."""
        for d in decisions:
            if d.action == ACTIVATE and d.worker_id is not None:
                self._recent[d.worker_id] = d.time

    def just_swapped_out(self, worker_id: str, now: float) -> bool:
        """Released by a swap within a window: the shortfall rule takes it last (short, a swap
        released it and that rule activated it again a second later)."""
        t = self._swapped_out.get(worker_id)
        return t is not None and now - t < self.p.window_s

    def tick(self, now: float, c_eff: float, target: float, trial: bool) -> list[Decision]:
        """``target``: alpha * mu_req. Swaps are checked at every tick whatever the level (when
        short, a swap may not lower C_eff: at 10,000 workers under churn most swaps happen
        short); a trial only when nothing was swapped, the level is met and ``trial`` (the
        caller's: not above the release bound, where the surplus rule acts instead)."""
        if self._swap_window is None or now - self._swap_window >= self.p.window_s:
            self._swap_window, self._swapped = now, 0
        out = self._swap(now, c_eff, min(target, c_eff))
        if not out and trial and c_eff >= target:
            out = self._trial(now, c_eff, target)
        return out

    def _swap(self, now: float, c_eff: float, target: float) -> list[Decision]:
        """Pair by pair while each pair is at least ``SWAP_GAIN`` cheaper per trajectory and
        C_eff stays at ``target`` (the caller passes min(target, C_eff)); a worker the loop
        activated within the last window is not swapped out (``activated``)."""
        workers = self.reg.workers.values()
        standby = sorted(
            (
                w
                for w in workers
                if w.state == STANDBY and not w.yielded and w.measured and w.effective_mu > 0
            ),
            key=lambda w: (w.unit_cost, w.worker_id),
        )
        self._recent = {k: t for k, t in self._recent.items() if now - t < self.p.window_s}
        self._swapped_out = {
            k: t for k, t in self._swapped_out.items() if now - t < self.p.window_s
        }
        active = sorted(  # one activated within a window stays a window (``activated``)
            (
                w
                for w in workers
                if w.state == ACTIVE and w.measured and w.worker_id not in self._recent
            ),
            key=lambda w: (-w.unit_cost, w.worker_id),
        )
        limit = max(1, int(SWAP_SHARE * len(active))) - self._swapped
        out: list[Decision] = []
        for best, worst in zip(standby, active[: max(0, limit)]):
            # (a $0 volunteer's unit cost is 0: nothing is cheaper, and the ratio below would
            # divide by it; found by tests/test_liveness.py)
            if worst.unit_cost <= 0 or best.unit_cost > (1 - SWAP_GAIN) * worst.unit_cost:
                break
            after = c_eff - worst.effective_mu + best.effective_mu
            if after < target:
                continue
            why = (
                f"unit-cost check (every {self.p.window_s:g} s); swap: {describe(best)} per "
                f"trajectory is {1 - best.unit_cost / worst.unit_cost:.0%} cheaper than "
                f"{describe(worst)}"
            )
            best.set_active(now)
            worst.state = STANDBY
            self._swapped_out[worst.worker_id] = now
            out += [
                Decision(now, ACTIVATE, best.worker_id, why, after, target, "swap"),
                Decision(now, RELEASE, worst.worker_id, why, after, target, "swap"),
            ]
            c_eff = after
            self._swapped += 1
        return out

    def _trial(self, now: float, c_eff: float, target: float) -> list[Decision]:
        """The cheapest never-tried standby worker on probation, when at the fleet's typical
        rate it could beat the worst active unit cost and every measured standby worker's
        (module docstring, "Trial")."""
        if self._last_trial is not None and now - self._last_trial < self.p.window_s:
            return []
        typical = self.reg.typical_mu()
        if not typical or self.reg.on_probation():
            return []
        costs = [w.unit_cost for w in self.reg.workers.values() if w.state == ACTIVE and w.measured]
        untried = [
            w
            for w in self.reg.workers.values()
            if w.state == STANDBY and not w.yielded and not w.measured and not w.failed_probations
        ]
        if not costs or not untried:
            return []
        w = min(untried, key=lambda w: (w.price, w.worker_id))
        worst = max(costs)
        known = [  # a measured standby worker would be swapped in first: beat it too
            v.unit_cost
            for v in self.reg.workers.values()
            if v.state == STANDBY and not v.yielded and v.measured and v.effective_mu > 0
        ]
        if w.price / typical > min([worst, *known]):
            return []
        self._last_trial = now
        w.set_active(now)
        return [
            Decision(
                now,
                ACTIVATE,
                w.worker_id,
                f"trial (at most one per {self.p.window_s:g} s window): {w.worker_id} "
                f"(${w.price:.3g}/h, unmeasured) at the fleet's typical {typical:.4g}/s would "
                f"cost ${w.price / typical / 3.6:.3g} per 1k trajectories, no more than the "
                f"dearest active worker's ${worst / 3.6:.3g}; on probation: no credit until "
                f"it delivers",
                c_eff,
                target,
                "trial",
            )
        ]
