"""Closed-loop provisioning (docs/design.md §4, "Closed loop"): keep just enough cheap capacity active.

The controller lives in the learner's control plane. It is told what the learner actually
receives from each worker (``observe``), whether each worker's heartbeat is alive
(``heartbeat``) and the capacity requirement ``mu_req`` (``set_requirement``, from
``echo_rl.provisioning.capacity``). Each ``tick`` it folds the measurements in and may return
decisions, which it has already applied to its own view of who is active; the caller carries
them out (hand work to / stop handing work to the worker) and logs them.

* ``mu_hat_i``: EWMA of *measured* throughput, time-aware (``1 - exp(-dt/tau_s)`` weight per
  interval, so irregular ticks weigh evidence by the time it covers). A worker's claim is only
  the prior the first measurements pull away from; a silent active worker decays to 0.
* ``a_i``: EWMA of heartbeat samples (1 up, 0 missed). The control plane reports misses with
  ``heartbeat(id, up=False)``. For a flaky worker a_i and mu_hat_i both fall, which counts its
  downtime twice: conservative, the loop errs towards more capacity.
* ``C_eff = sum(a_i * mu_hat_i)`` over active workers; target ``alpha * mu_req``.
* Hysteresis: act only after a condition held at every tick for ``window_s`` seconds, and
  release only above ``(alpha + delta) * mu_req``, so a worker just activated or released
  does not bounce. After any action both timers restart: the next action needs a fresh
  window of evidence that includes the effect of this one.
* A worker activated less than ``warmup_s`` ago keeps its prior estimate: installing the
  snapshot is not slowness.
* **No credit before delivery** (docs/security.md, "Measured, not declared"). The learner
  registers joiners with ``mu_prior=0``: price is a bid, capacity is measured. Such a worker
  is *unmeasured* until a fold finds trajectories it delivered. Activation goes to measured
  standby workers first (by unit cost); only when they cannot close the gap are unmeasured
  ones put on *probation*: at most ``probation_slots`` unmeasured workers active at once,
  cheapest first among those that failed probation least often. A probationer that has
  delivered nothing ``warmup_s + window_s`` after activation goes back to standby (a failed
  probation, logged as a release), so a joiner that delivers nothing never gains credit and
  holds a slot for a bounded time. The probation lasts ``warmup_s + window_s`` plus two
  group generation times (the fleet's measured time per group, ``probation_group_s`` until
  anything is measured): a SmolLM2 group on a CPU takes tens of seconds, and a window fit for
  the toy task would fail every honest probationer on a real model.
* **Staleness is not free** (``learner.staleness``): the learner passes each batch's
  ``credit``, its admitted trajectories discounted by how stale they were, so mu_hat and the
  unit cost measure useful throughput: a worker that delivers at the staleness edge is
  swapped and released before an equal fresh one.
* **Liveness** (docs/provisioning.md, "Liveness"): whatever the estimates say (no mu_req yet,
  every probation failed, every rate decayed to 0), while the learner waits for data
  (``waiting``) and a standby worker exists, one is activated per ``window_s``. The shortfall
  rule needs a mu_req, and mu_req needs learner steps: without this the two can wait for each
  other forever (issue 39: a restarted learner with both workers released).
* **Restart** (``state``/``restore``): the measured throughput, failed probations and active
  set, by identity, go into the run folder and come back on ``--resume``: a returning key is
  not a stranger, and a worker that was active is active again when it re-joins.

* **Swaps and trials** (``echo_rl.provisioning.trades``): while the level is met, a measured standby
  worker at least ``SWAP_GAIN`` cheaper per trajectory takes the dearest active one's place,
  and a never-tried standby worker that could be cheaper goes on probation, one per window.

The books (``echo_rl.provisioning.registry``) and the rules (``echo_rl.provisioning.scaling``,
``echo_rl.provisioning.trades``) are separate objects; ``Controller`` holds the lock and the clock and composes them.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace

from echo_rl.core.ewma import ewma
from echo_rl.provisioning.decisions import (
    ACTIVATE,
    RELEASE,
    SHORT,
    SWAP_GAIN,
    SWAP_SHARE,
    Decision,
    Policy,
)
from echo_rl.provisioning.registry import (
    ACTIVE,
    STANDBY,
    Registry,
    Remembered,
    RememberedDoc,
    UnknownWorker,
    WorkerStatus,
    fold,
)
from echo_rl.provisioning.scaling import Scaler

# what callers import from here (the books' and the rules' names, re-exported)
__all__ = [
    "ACTIVATE",
    "ACTIVE",
    "NEED_MAX",
    "RELEASE",
    "SHORT",
    "STANDBY",
    "SWAP_GAIN",
    "SWAP_SHARE",
    "Controller",
    "Decision",
    "Policy",
    "Remembered",
    "UnknownWorker",
    "WorkerStatus",
]

NEED_MAX = 1000.0  # the wire's bound on HeartbeatAck.need


class Controller:
    """Hysteretic activate/release loop over a registry of priced workers. Thread-safe."""

    def __init__(
        self,
        policy: Policy = Policy(),
        clock: Callable[[], float] = time.monotonic,
        *,
        tau_s: float = 60.0,
        avail_beta: float = 0.2,
        history: int = 1000,
        memory: int = 100_000,
    ) -> None:
        """``policy``: the scaling knobs; its ``group_size`` is the trajectories per group (a
        group's generation time is group_size / mu_hat), its ``probation_group_s`` the expected
        seconds to generate one group before any worker has been measured (0: none expected
        beyond the window). ``tau_s`` and ``avail_beta``: the throughput's and the
        availability's EWMA; ``history``: decisions kept; ``memory``: identities remembered."""
        p = policy
        _check_params(p.alpha, p.delta, p.window_s, tau_s, avail_beta, p.warmup_s)
        if p.probation_slots < 0:
            raise ValueError(f"probation_slots must be >= 0, got {p.probation_slots}")
        self.policy = replace(
            p, group_size=max(1, p.group_size), probation_group_s=max(0.0, p.probation_group_s)
        )
        self.tau_s, self.avail_beta = tau_s, avail_beta
        self._clock = clock
        self._reg = Registry(memory)
        self._scaler = Scaler(self._reg, self.policy)
        self._lock = threading.Lock()
        self.history: deque[Decision] = deque(maxlen=history)

    # -- registry -------------------------------------------------------------------------

    def add_worker(
        self,
        worker_id: str,
        price: float,
        state: str = STANDBY,
        mu_prior: float = 0.0,
        identity: str | None = None,
    ) -> None:
        """Register a worker. ``mu_prior``: a *trusted* (benchmarked) throughput, the EWMA's
        starting point until measurements replace it; 0 (what the learner passes for a joiner
        it has not measured) gives no credit, and the worker is activated only on probation.
        ``identity``: what the worker proved to be (its public key); a worker measured under
        that identity before it left starts from that measurement."""
        if state not in (ACTIVE, STANDBY):
            raise ValueError(f"state must be {ACTIVE!r} or {STANDBY!r}, got {state!r}")
        if not (price >= 0 and math.isfinite(price)):
            raise ValueError(f"price of {worker_id!r} must be a finite $/h >= 0, got {price}")
        if not (mu_prior >= 0 and math.isfinite(mu_prior)):
            raise ValueError(f"mu_prior of {worker_id!r} must be finite and >= 0, got {mu_prior}")
        with self._lock:
            now = self._clock()
            w, was_active = self._reg.add(worker_id, price, mu_prior, identity, now)
            # Active before the learner restarted: active again (its leases may be in flight).
            if state == ACTIVE or was_active:
                w.set_active(now)

    def remove_worker(self, worker_id: str, gone_for_good: bool = False) -> None:
        """Forget a worker that left or timed out. ``gone_for_good``: it said goodbye, or was
        banned or quarantined: an active one's capacity is then gone for certain, and the
        shortfall it leaves is met at the next tick, not after a window (a small fleet's only
        other volunteer waited 5 minutes after a ban, issue 55). A silent worker timed out may
        be a blip: its shortfall waits the window like any measured one (the simulator's churn
        is of this kind)."""
        with self._lock:
            w = self._reg.workers.get(worker_id)
            if gone_for_good and w is not None and w.state == ACTIVE and not w.yielded:
                self._scaler.lost_active()
            self._reg.remove(worker_id)

    def state(self) -> dict[str, RememberedDoc]:
        """Every identity's books as plain data (for the run folder): the workers registered
        now (with whether they are active) and those remembered after they left."""
        with self._lock:
            return self._reg.state()

    def restore(self, state: dict[str, object]) -> int:
        """Books from ``state()`` of an earlier instance (``--resume``). Malformed entries are
        skipped; returns how many were restored."""
        with self._lock:
            return self._reg.restore(state)

    # -- measurements -----------------------------------------------------------------------

    def observe(
        self,
        worker_id: str,
        delivered: int,
        busy_s: float | None = None,
        credit: float | None = None,
    ) -> None:
        """``delivered`` trajectories from this worker were admitted by the learner (refused
        ones earn no credit). Ignored for standby workers, which may still be finishing leases
        after a release.

        ``credit``: what they count for, at most ``delivered`` (None: all of it). The learner
        discounts stale trajectories (``learner.staleness``): throughput, and with it the
        unit cost that activation, swaps and releases compare, is in credited trajectories.

        ``busy_s``: the seconds the worker spent producing them. With it, throughput is
        delivered / busy time, i.e. capacity; without it, delivered / wall time, which
        under-states capacity whenever the learner hands out less work than the fleet can do
        (its outstanding-work cap), and makes the loop over-provision. In busy mode an
        interval without deliveries is no evidence of slowness (silence shows up in
        availability instead)."""
        if delivered < 0:
            raise ValueError(f"delivered must be >= 0, got {delivered} from {worker_id!r}")
        if busy_s is not None and not (busy_s >= 0 and math.isfinite(busy_s)):
            raise ValueError(f"busy_s must be finite and >= 0, got {busy_s} from {worker_id!r}")
        if credit is not None and not (0 <= credit <= delivered and math.isfinite(credit)):
            raise ValueError(
                f"credit must be in [0, delivered = {delivered}], got {credit} from {worker_id!r}"
            )
        with self._lock:
            w = self._reg.get(worker_id)
            if w.state == ACTIVE:
                w.pending += int(delivered) if credit is None else credit
                if busy_s is not None:
                    w.pending_busy += busy_s
                    w.busy_mode = True

    def ready(self, worker_id: str) -> None:
        """The active worker asked for work: its model is loaded and its snapshot installed.
        A probation's delivery clock starts here, not at activation (loading a real model
        takes minutes)."""
        with self._lock:
            w = self._reg.workers.get(worker_id)
            if w is not None and w.state == ACTIVE and w.ready_at is None:
                w.ready_at = self._clock()

    def heartbeat(self, worker_id: str, up: bool = True) -> None:
        """One heartbeat sample: ``up=True`` when it arrived, ``False`` when it was missed."""
        with self._lock:
            w = self._reg.get(worker_id)
            # averaged from the prior 1.0 (up), not replaced by the first sample: one missed
            # heartbeat must not halve a new worker's capacity
            w.availability = ewma(w.availability, float(up), self.avail_beta)

    def set_yielded(self, worker_id: str, yielded: bool) -> Decision | None:
        """The worker's owner took the machine (docs/preemption.md), or gave it back. A
        yielded worker is standby, not gone: it keeps its measured throughput and its
        availability is not charged for the yield; it is not activated again while yielded.
        Returns the release, when it was active."""
        with self._lock:
            w = self._reg.workers.get(worker_id)
            if w is None or w.yielded == yielded:
                return None
            w.yielded = yielded
            if not yielded or w.state != ACTIVE:
                return None
            d = self._scaler.yield_release(w, self._clock())
            self.history.append(d)
            return d

    def waiting(self, waiting: bool) -> None:
        """The learner started (True) or stopped (False) waiting for admissible data."""
        with self._lock:
            if not waiting:
                self._scaler.waiting_since = None
            elif self._scaler.waiting_since is None:
                self._scaler.waiting_since = self._clock()

    def set_requirement(self, mu_req: float | None) -> None:
        """Capacity requirement in trajectories/s; None pauses all decisions."""
        if mu_req is not None and not (mu_req >= 0 and math.isfinite(mu_req)):
            raise ValueError(f"mu_req must be a finite number >= 0 (or None), got {mu_req}")
        with self._lock:
            self._scaler.mu_req = None if mu_req is None else float(mu_req)

    # -- the loop ---------------------------------------------------------------------------

    def tick(self) -> list[Decision]:
        """Fold measurements, update the hysteresis timers, act if a window has elapsed."""
        with self._lock:
            now = self._clock()
            fold(self._reg.workers, now, self.policy.warmup_s, self.tau_s)
            decisions = self._scaler.tick(now)
            self.history.extend(decisions)
            return decisions

    def probation_s(self) -> float:
        """How long a probationer has, from its first work request, to deliver a group."""
        return self._scaler.probation_s()

    # -- views --------------------------------------------------------------------------------

    def need(self) -> float:
        """The requirement over the active set's capacity: 1 is enough, above 1 the run
        wants more (``NEED_MAX`` with no capacity at all). What a worker shared with other
        runs weighs this run's turns by (docs/multirun.md)."""
        with self._lock:
            req, have = self._scaler.mu_req, self._reg.c_eff()
        if req is None:
            return 1.0
        return min(NEED_MAX, req / have) if have > 0 else NEED_MAX

    def c_eff(self) -> float:
        """Effective capacity of the active set (trajectories/s), as of the last tick."""
        with self._lock:
            return self._reg.c_eff()

    def cost_per_hour(self) -> float:
        """$/h of the active workers (the learner's own price is the caller's to add)."""
        with self._lock:
            return sum(w.price for w in self._reg.workers.values() if w.state == ACTIVE)

    def measured_any(self) -> bool:
        with self._lock:
            return any(w.measured for w in self._reg.workers.values())

    def workers(self) -> list[WorkerStatus]:
        with self._lock:
            return [w.status() for w in self._reg.workers.values()]

    def on_probation(self, worker_id: str) -> bool:
        """Active and not yet measured (unknown workers count as not on probation)."""
        with self._lock:
            w = self._reg.workers.get(worker_id)
            return w is not None and w.state == ACTIVE and not w.measured

    def active_ids(self) -> list[str]:
        with self._lock:
            return sorted(w.worker_id for w in self._reg.workers.values() if w.state == ACTIVE)


def _check_params(
    alpha: float, delta: float, window_s: float, tau_s: float, avail_beta: float, warmup_s: float
) -> None:
    if not alpha > 0:
        raise ValueError(f"alpha (safety factor) must be > 0, got {alpha}; the default is 1.1")
    if not delta >= 0:
        raise ValueError(f"delta (release margin) must be >= 0, got {delta}")
    if not (window_s >= 0 and warmup_s >= 0):
        raise ValueError(f"window_s and warmup_s must be >= 0 s, got {window_s}, {warmup_s}")
    if not tau_s > 0:
        raise ValueError(f"tau_s (EWMA time constant) must be > 0 s, got {tau_s}")
    if not 0 < avail_beta <= 1:
        raise ValueError(f"avail_beta must be in (0, 1], got {avail_beta}")
