"""Closed-loop provisioning (docs/design.md §4, "Closed loop"): keep just enough cheap capacity active.

The controller lives in the learner's control plane. It is told what the learner actually
receives from each worker (``observe``), whether each worker's heartbeat is alive
(``heartbeat``) and the capacity requirement ``mu_req`` (``set_requirement``, from
``provisioning.capacity``). Each ``tick`` it folds the measurements in and may return
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
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import asdict, dataclass

ACTIVE, STANDBY = "active", "standby"
ACTIVATE, RELEASE, SHORT = "activate", "release", "short"
SWAP_GAIN = 0.2  # a swap must cut the unit cost of the swapped worker by at least this share
SWAP_SHARE = 0.05  # at most this share of the active workers is swapped per window


@dataclass(frozen=True)
class Remembered:
    """What the controller keeps of one identity across a departure or a learner restart."""

    mu_hat: float  # measured throughput (0: never measured)
    failed_probations: int
    active: bool = False  # active when the state was taken (restart only; a leaver is not)

    @classmethod
    def parse(cls, obj: object) -> "Remembered":
        """From the run folder's JSON; anything malformed raises ValueError."""
        if not isinstance(obj, dict) or set(obj) != {"mu_hat", "failed_probations", "active"}:
            raise ValueError(f"not a remembered worker: {obj!r:.80}")
        mu, failed, active = obj["mu_hat"], obj["failed_probations"], obj["active"]
        if (not isinstance(mu, (int, float)) or isinstance(mu, bool) or not (mu >= 0 and math.isfinite(mu))
                or type(failed) is not int or failed < 0 or type(active) is not bool):
            raise ValueError(f"bad values in a remembered worker: {obj!r:.80}")
        return cls(float(mu), failed, active)


class UnknownWorker(KeyError):
    """A call named a worker the controller was never told about (or was told it left)."""


@dataclass(frozen=True)
class Decision:
    time: float
    action: str  # ACTIVATE, RELEASE, or SHORT (no standby left to close the gap)
    worker_id: str | None  # None for SHORT
    reason: str  # human-readable, with the numbers that triggered it
    c_eff: float  # effective capacity when decided, before this decision (trajectories/s)
    target: float  # alpha * mu_req (trajectories/s)
    # Which rule decided (provisioning.words puts it in words for the volunteer): shortfall,
    # probation, liveness, swap, surplus, probation_over, yielded, short.
    cause: str = ""


@dataclass(frozen=True)
class WorkerStatus:
    """Read-only view of one worker, for metrics and dashboards."""

    worker_id: str
    state: str
    price: float  # $/h
    mu_hat: float  # trajectories/s
    availability: float
    effective_mu: float  # availability * mu_hat

    @property
    def unit_cost(self) -> float:
        """$/h per trajectory/s; infinite when the worker is expected to deliver nothing."""
        return self.price / self.effective_mu if self.effective_mu > 0 else math.inf


@dataclass
class _Worker:
    worker_id: str
    price: float
    state: str
    mu_hat: float
    availability: float = 1.0
    pending: float = 0.0  # trajectories delivered since the last fold (credited, learner.staleness)
    pending_busy: float = 0.0  # seconds the worker spent producing them, if reported
    busy_mode: bool = False  # deliveries come with busy time: rate = delivered / busy
    since: float = 0.0  # start of the current measurement interval
    activated_at: float = -math.inf
    ready_at: float | None = None  # first work request while active: model loaded, snapshot in
    measured: bool = False  # has delivered trajectories (a fold saw some): capacity is evidence
    failed_probations: int = 0  # times it was active unmeasured and delivered nothing
    yielded: bool = False  # its owner needs the machine: standby, and not a candidate

    @property
    def effective_mu(self) -> float:
        return self.availability * self.mu_hat

    @property
    def unit_cost(self) -> float:
        mu = self.effective_mu
        return self.price / mu if mu > 0 else math.inf


class Controller:
    """Hysteretic activate/release loop over a registry of priced workers. Thread-safe."""

    def __init__(self, alpha: float = 1.1, delta: float = 0.2, window_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic, *, tau_s: float = 60.0,
                 avail_beta: float = 0.2, warmup_s: float = 30.0, history: int = 1000,
                 probation_slots: int = 4, probation_ready_s: float = 600.0,
                 memory: int = 100_000, group_size: int = 1,
                 probation_group_s: float = 0.0) -> None:
        """``group_size``: trajectories per group (a group's generation time is group_size /
        mu_hat); ``probation_group_s``: the expected seconds to generate one group before any
        worker has been measured (0: none expected beyond the window)."""
        _check_params(alpha, delta, window_s, tau_s, avail_beta, warmup_s)
        if probation_slots < 0:
            raise ValueError(f"probation_slots must be >= 0, got {probation_slots}")
        self.probation_slots = probation_slots
        self.probation_ready_s = probation_ready_s
        self.group_size, self.probation_group_s = max(1, group_size), max(0.0, probation_group_s)
        self.alpha, self.delta, self.window_s = alpha, delta, window_s
        self.tau_s, self.avail_beta, self.warmup_s = tau_s, avail_beta, warmup_s
        self._clock = clock
        self._workers: dict[str, _Worker] = {}
        self._mu_req: float | None = None
        self._low_since: float | None = None  # C_eff < target since (None: not now)
        self._high_since: float | None = None  # C_eff > (alpha + delta) mu_req since
        self._swap_window: float | None = None  # start of the current swap budget's window
        self._swapped = 0  # swaps made in it
        self._lock = threading.Lock()
        self.history: deque[Decision] = deque(maxlen=history)
        # Measured throughput of workers that left, by identity (the learner passes the
        # worker's public key, never a name it chose): one that comes back is not a stranger
        # again. Bounded, oldest forgotten first.
        self._memory: OrderedDict[str, Remembered] = OrderedDict()
        self._memory_size = memory
        self._identity: dict[str, str] = {}
        self._waiting_since: float | None = None  # the learner waits for data since (liveness)
        self._last_activation = -math.inf

    # -- registry -------------------------------------------------------------------------

    def add_worker(self, worker_id: str, price: float, state: str = STANDBY,
                   mu_prior: float = 0.0, identity: str | None = None) -> None:
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
            if worker_id in self._workers:
                raise ValueError(f"worker {worker_id!r} is already registered; remove_worker "
                                 f"first to re-register it with a new price or prior")
            now = self._clock()
            # A trusted prior is credit (a benchmark said so); without one the worker is
            # unmeasured until it delivers.
            w = _Worker(worker_id, float(price), STANDBY, float(mu_prior), since=now,
                        measured=mu_prior > 0)
            past = None
            if identity is not None:
                self._identity[worker_id] = identity
                past = self._memory.pop(identity, None)
                if past is not None and mu_prior <= 0:
                    w.mu_hat, w.failed_probations = past.mu_hat, past.failed_probations
                    w.measured = w.mu_hat > 0
            self._workers[worker_id] = w
            # Active before the learner restarted: active again (its leases may be in flight).
            if state == ACTIVE or (past is not None and past.active):
                self._set_active(w, now)

    def remove_worker(self, worker_id: str) -> None:
        """Forget a worker that left or timed out."""
        with self._lock:
            w = self._get(worker_id)
            del self._workers[worker_id]
            identity = self._identity.pop(worker_id, None)
            if identity is not None and (w.measured or w.failed_probations):
                self._remember(identity, Remembered(w.mu_hat if w.measured else 0.0,
                                                    w.failed_probations))

    def _remember(self, identity: str, past: Remembered) -> None:
        self._memory[identity] = past
        self._memory.move_to_end(identity)
        while len(self._memory) > self._memory_size:
            self._memory.popitem(last=False)

    def state(self) -> dict[str, dict]:
        """Every identity's books as plain data (for the run folder): the workers registered
        now (with whether they are active) and those remembered after they left."""
        with self._lock:
            out = {i: asdict(r) for i, r in self._memory.items()}
            for wid, identity in self._identity.items():
                w = self._workers[wid]
                out[identity] = asdict(Remembered(w.mu_hat if w.measured else 0.0,
                                                  w.failed_probations, w.state == ACTIVE))
            return out

    def restore(self, state: dict[str, object]) -> int:
        """Books from ``state()`` of an earlier instance (``--resume``). Malformed entries are
        skipped; returns how many were restored."""
        n = 0
        with self._lock:
            for identity, obj in state.items():
                try:
                    past = Remembered.parse(obj)
                except ValueError:
                    continue
                if isinstance(identity, str) and identity:
                    self._remember(identity, past)
                    n += 1
        return n

    # -- measurements -----------------------------------------------------------------------

    def observe(self, worker_id: str, delivered: int, busy_s: float | None = None,
                credit: float | None = None) -> None:
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
            raise ValueError(f"credit must be in [0, delivered = {delivered}], got {credit} "
                             f"from {worker_id!r}")
        with self._lock:
            w = self._get(worker_id)
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
            w = self._workers.get(worker_id)
            if w is not None and w.state == ACTIVE and w.ready_at is None:
                w.ready_at = self._clock()

    def heartbeat(self, worker_id: str, up: bool = True) -> None:
        """One heartbeat sample: ``up=True`` when it arrived, ``False`` when it was missed."""
        with self._lock:
            w = self._get(worker_id)
            w.availability += self.avail_beta * (float(up) - w.availability)

    def set_yielded(self, worker_id: str, yielded: bool) -> Decision | None:
        """The worker's owner took the machine (docs/preemption.md), or gave it back. A
        yielded worker is standby, not gone: it keeps its measured throughput and its
        availability is not charged for the yield; it is not activated again while yielded.
        Returns the release, when it was active."""
        with self._lock:
            w = self._workers.get(worker_id)
            if w is None or w.yielded == yielded:
                return None
            w.yielded = yielded
            if not yielded or w.state != ACTIVE:
                return None
            now = self._clock()
            c_eff = self._c_eff()
            w.state, w.since, w.pending, w.pending_busy = STANDBY, now, 0, 0.0
            d = Decision(now, RELEASE, worker_id, f"{worker_id} yielded to its owner: standby "
                         f"until the machine is quiet", c_eff, self.alpha * (self._mu_req or 0.0),
                         "yielded")
            self.history.append(d)
            return d

    def waiting(self, waiting: bool) -> None:
        """The learner started (True) or stopped (False) waiting for admissible data."""
        with self._lock:
            if not waiting:
                self._waiting_since = None
            elif self._waiting_since is None:
                self._waiting_since = self._clock()

    def set_requirement(self, mu_req: float | None) -> None:
        """Capacity requirement in trajectories/s; None pauses all decisions."""
        if mu_req is not None and not (mu_req >= 0 and math.isfinite(mu_req)):
            raise ValueError(f"mu_req must be a finite number >= 0 (or None), got {mu_req}")
        with self._lock:
            self._mu_req = None if mu_req is None else float(mu_req)

    # -- the loop ---------------------------------------------------------------------------

    def tick(self) -> list[Decision]:
        """Fold measurements, update the hysteresis timers, act if a window has elapsed."""
        with self._lock:
            now = self._clock()
            self._fold(now)
            expired = self._end_probations(now)
            if self._mu_req is None:
                self._low_since = self._high_since = None
                decisions = []
            else:
                decisions = self._decide(now)
            if any(d.action == ACTIVATE for d in decisions):
                self._last_activation = now
            decisions += self._liveness(now)
            self.history.extend(expired + decisions)
            return expired + decisions

    def _liveness(self, now: float) -> list[Decision]:
        """The learner has waited a whole window and nobody was activated in it: activate the
        best standby worker, whatever the estimates say (module docstring, "Liveness")."""
        since = self._waiting_since
        if since is None or now - max(since, self._last_activation) < self.window_s:
            return []
        typical = self._typical_mu()
        standby = [w for w in self._workers.values() if w.state == STANDBY and not w.yielded]
        if not standby:
            return []
        w = min(standby, key=lambda w: (w.measured and w.effective_mu <= 0, self._rank(w, typical)))
        self._set_active(w, now)
        self._last_activation = now
        self._low_since = self._high_since = None
        return [Decision(now, ACTIVATE, w.worker_id,
                         f"liveness: the learner has waited {now - since:.0f} s for data and "
                         f"nobody was activated for a window ({self.window_s:g} s); "
                         f"{w.worker_id} (${w.price:.3g}/h) is the best standby worker",
                         self._c_eff(), self.alpha * (self._mu_req or 0.0), "liveness")]

    def _end_probations(self, now: float) -> list[Decision]:
        """Active workers that delivered nothing in ``warmup_s + window_s`` go back to standby:
        no credit, and their probation slot (if they held one) goes to the next candidate."""
        limit = self.probation_s()
        out = []
        for w in sorted(self._workers.values(), key=lambda w: w.worker_id):
            if w.state != ACTIVE or w.measured:
                continue
            if w.ready_at is None and now - w.activated_at >= self.probation_ready_s:
                why = f"never asked for work in {now - w.activated_at:.0f} s (probation_ready_s)"
            elif w.ready_at is not None and now - w.ready_at >= limit:
                why = (f"delivered nothing in {now - w.ready_at:.0f} s after asking for work "
                       f"(warmup_s + window_s + 2 group times = {limit:.3g} s)")
            else:
                continue
            w.state, w.mu_hat, w.ready_at = STANDBY, 0.0, None
            w.failed_probations += 1
            out.append(Decision(now, RELEASE, w.worker_id, f"probation over: {w.worker_id} {why}; "
                                f"no credit", self._c_eff(), self.alpha * (self._mu_req or 0.0),
                                "probation_over"))
        return out

    def _fold(self, now: float) -> None:
        for w in self._workers.values():
            if w.state != ACTIVE:
                continue
            dt = now - w.since
            if now - w.activated_at < self.warmup_s:
                w.pending, w.pending_busy, w.since = 0, 0.0, now  # measure after warm-up
                continue
            first = w.pending > 0 and not w.measured and w.mu_hat <= 0
            if w.pending > 0:
                w.measured = True  # delivered something: its mu_hat is now evidence
            if w.busy_mode:
                if w.pending_busy > 0:
                    # The first measurement of a worker without a prior is its rate: an EWMA
                    # from 0 would report a fraction of it for minutes, and the loop would
                    # activate more workers against a shortfall that is not there.
                    weight = 1.0 if first else 1.0 - math.exp(-w.pending_busy / self.tau_s)
                    w.mu_hat += weight * (w.pending / w.pending_busy - w.mu_hat)
                w.pending, w.pending_busy, w.since = 0, 0.0, now
            elif dt > 0:
                weight = 1.0 - math.exp(-dt / self.tau_s)
                w.mu_hat += weight * (w.pending / dt - w.mu_hat)
                w.pending, w.since = 0, now

    def _decide(self, now: float) -> list[Decision]:
        assert self._mu_req is not None
        target = self.alpha * self._mu_req
        c_eff = self._c_eff()
        low = c_eff < target
        high = c_eff > (self.alpha + self.delta) * self._mu_req
        self._low_since = _held_since(self._low_since, low, now)
        self._high_since = _held_since(self._high_since, high, now)
        acted: list[Decision] = []
        if low and now - self._low_since >= self.window_s:
            acted = self._activate(now, c_eff, target, now - self._low_since)
        elif high and now - self._high_since >= self.window_s:
            acted = self._release(now, c_eff, target, now - self._high_since)
        if acted:
            # After acting, a condition must hold for a whole window again. Swaps below do not
            # restart these timers: they keep capacity, and a shortfall must still be met.
            self._low_since = self._high_since = None
            return acted
        # Swaps are checked at every tick whatever the level (when short, a swap may not lower
        # C_eff), within a budget of SWAP_SHARE of the active set per window.
        if self._swap_window is None or now - self._swap_window >= self.window_s:
            self._swap_window, self._swapped = now, 0
        return self._swap(now, c_eff, min(target, c_eff))

    def _swap(self, now: float, c_eff: float, target: float) -> list[Decision]:
        """Trade active workers with the worst unit costs for measured standby
        workers with the best, pair by pair while each pair is at least ``SWAP_GAIN`` cheaper
        per trajectory and C_eff stays at ``target`` (the caller passes min(target, C_eff):
        when short, a swap may not lower capacity); at most ``SWAP_SHARE`` of the active set
        per window, checked at every tick. Churn otherwise leaves whatever replaced the leavers active for good, while
        cheaper measured workers wait in standby."""
        standby = sorted((w for w in self._workers.values()
                          if w.state == STANDBY and not w.yielded and w.measured
                          and w.effective_mu > 0),
                         key=lambda w: (w.unit_cost, w.worker_id))
        active = sorted((w for w in self._workers.values() if w.state == ACTIVE and w.measured),
                        key=lambda w: (-w.unit_cost, w.worker_id))
        limit = max(1, int(SWAP_SHARE * len(active))) - self._swapped
        out: list[Decision] = []
        for best, worst in zip(standby, active[:max(0, limit)]):
            # (a $0 volunteer's unit cost is 0: nothing is cheaper, and the ratio below would
            # divide by it; found by tests/test_liveness.py)
            if worst.unit_cost <= 0 or best.unit_cost > (1 - SWAP_GAIN) * worst.unit_cost:
                break
            after = c_eff - worst.effective_mu + best.effective_mu
            if after < target:
                continue
            why = (f"unit-cost check (every {self.window_s:g} s); swap: {_describe(best)} per "
                   f"trajectory is {1 - best.unit_cost / worst.unit_cost:.0%} cheaper than "
                   f"{_describe(worst)}")
            self._set_active(best, now)
            worst.state = STANDBY
            out += [Decision(now, ACTIVATE, best.worker_id, why, after, target, "swap"),
                    Decision(now, RELEASE, worst.worker_id, why, after, target, "swap")]
            c_eff = after
            self._swapped += 1
        return out

    def _activate(self, now: float, c_eff: float, target: float, held: float) -> list[Decision]:
        """Standby workers in order of unit cost until the projected C_eff reaches target.

        A measured worker's unit cost is its price over its measured throughput, and it adds
        that throughput. An unmeasured one is ranked by its price over the fleet's typical
        measured throughput (an estimate for the order only, never credit) and goes on
        probation: it adds the typical throughput to the projection, so the loop does not
        activate more while it warms up, but nothing to C_eff until it delivers. Without this
        the loop would only ever reuse workers it measured before, however pricey, and never
        find the cheap ones that joined since. Workers that failed probation come last.
        """
        typical = self._typical_mu()
        why = (f"C_eff {c_eff:.4g}/s < alpha*mu_req = {self.alpha:g} x {self._mu_req:.4g} = "
               f"{target:.4g}/s for {held:.0f} s (window {self.window_s:g} s)")
        decisions, projected = [], c_eff + self._pending_mu(typical)
        free = self._probation_limit(target - projected) - self._on_probation()
        for w in self._standby_by_estimate(typical):
            if projected >= target:
                break
            if w.measured:
                decisions.append(Decision(now, ACTIVATE, w.worker_id,
                                          f"{why}; {_describe(w)}, cheapest standby per "
                                          f"trajectory; C_eff -> {projected + w.effective_mu:.4g}/s",
                                          projected, target, "shortfall"))
                projected += w.effective_mu
            elif free > 0:
                free -= 1
                decisions.append(Decision(now, ACTIVATE, w.worker_id,
                                          f"{why}; {w.worker_id} (${w.price:.3g}/h, unmeasured) on "
                                          f"probation: no credit until it delivers", projected,
                                          target, "probation"))
                projected += typical or 0.0
            else:
                continue
            self._set_active(w, now)
        if projected < target:
            decisions.append(Decision(now, SHORT, None,
                                      f"{why}; no standby worker left, still short by "
                                      f"{target - projected:.4g}/s: add workers or lower mu_req",
                                      projected, target, "short"))
        return decisions

    def probation_s(self) -> float:
        """How long a probationer has, from its first work request, to deliver a group:
        ``warmup_s + window_s`` plus two generation times of one group (measured across the
        fleet; ``probation_group_s`` before anything is measured)."""
        typical = self._typical_mu()
        group_s = self.group_size / typical if typical else self.probation_group_s
        return self.warmup_s + self.window_s + 2 * group_s

    def _typical_mu(self) -> float | None:
        measured = sorted(w.mu_hat for w in self._workers.values() if w.measured and w.mu_hat > 0)
        return measured[len(measured) // 2] if measured else None

    def _on_probation(self) -> int:
        return sum(1 for w in self._workers.values() if w.state == ACTIVE and not w.measured)

    def _pending_mu(self, typical: float | None) -> float:
        """What the active workers still on probation are expected to add once measured."""
        return (typical or 0.0) * self._on_probation()

    @staticmethod
    def _rank(w: _Worker, typical: float | None) -> tuple:
        """Activation order: measured workers by unit cost, then unmeasured ones by failed
        probations and their price over the fleet's typical rate."""
        if w.measured:
            return (0, w.unit_cost, w.worker_id)
        est = w.price / typical if typical else w.price
        return (w.failed_probations, est, w.worker_id)

    def _standby_by_estimate(self, typical: float | None) -> list[_Worker]:
        return sorted((w for w in self._workers.values() if w.state == STANDBY and not w.yielded
                       and (w.effective_mu > 0 or not w.measured)),
                      key=lambda w: self._rank(w, typical))

    def _probation_limit(self, shortfall: float) -> int:
        typical = self._typical_mu()
        if typical is None or self.probation_slots == 0:
            return self.probation_slots
        return max(self.probation_slots, math.ceil(shortfall / typical))

    def _release(self, now: float, c_eff: float, target: float, held: float) -> list[Decision]:
        """The active worker with the worst unit cost whose removal keeps C_eff >= target (one
        per window)."""
        spare = [w for w in self._workers.values()
                 if w.state == ACTIVE and c_eff - w.effective_mu >= target]
        if not spare:
            return []  # over-provisioned, but every single release would undershoot
        w = max(spare, key=lambda w: (w.unit_cost, w.price, w.worker_id))
        bound = (self.alpha + self.delta) * self._mu_req
        reason = (f"C_eff {c_eff:.4g}/s > (alpha+delta)*mu_req = ({self.alpha:g}+{self.delta:g}) "
                  f"x {self._mu_req:.4g} = {bound:.4g}/s for {held:.0f} s (window "
                  f"{self.window_s:g} s); {_describe(w)} has the worst unit cost of those "
                  f"whose removal keeps "
                  f"C_eff = {c_eff - w.effective_mu:.4g}/s >= {target:.4g}/s")
        w.state = STANDBY
        return [Decision(now, RELEASE, w.worker_id, reason, c_eff, target, "surplus")]

    # -- views --------------------------------------------------------------------------------

    def c_eff(self) -> float:
        """Effective capacity of the active set (trajectories/s), as of the last tick."""
        with self._lock:
            return self._c_eff()

    def cost_per_hour(self) -> float:
        """$/h of the active workers (the learner's own price is the caller's to add)."""
        with self._lock:
            return sum(w.price for w in self._workers.values() if w.state == ACTIVE)

    def unmeasured_active(self) -> int:
        """Active workers that have delivered nothing yet (bootstrap or probation)."""
        with self._lock:
            return sum(1 for w in self._workers.values() if w.state == ACTIVE and not w.measured)

    def measured_any(self) -> bool:
        with self._lock:
            return any(w.measured for w in self._workers.values())

    def workers(self) -> list[WorkerStatus]:
        with self._lock:
            return [WorkerStatus(w.worker_id, w.state, w.price, w.mu_hat, w.availability,
                                 w.effective_mu) for w in self._workers.values()]

    def on_probation(self, worker_id: str) -> bool:
        """Active and not yet measured (unknown workers count as not on probation)."""
        with self._lock:
            w = self._workers.get(worker_id)
            return w is not None and w.state == ACTIVE and not w.measured

    def active_ids(self) -> list[str]:
        with self._lock:
            return sorted(w.worker_id for w in self._workers.values() if w.state == ACTIVE)

    # -- helpers ------------------------------------------------------------------------------

    def _c_eff(self) -> float:
        return sum(w.effective_mu for w in self._workers.values() if w.state == ACTIVE)

    def _set_active(self, w: _Worker, now: float) -> None:
        w.state, w.activated_at, w.pending, w.since = ACTIVE, now, 0, now
        w.ready_at = None  # its delivery clock starts at its next work request

    def _get(self, worker_id: str) -> _Worker:
        try:
            return self._workers[worker_id]
        except KeyError:
            raise UnknownWorker(f"unknown worker {worker_id!r}: call add_worker first (or it "
                                f"was removed)") from None


def _held_since(since: float | None, holds: bool, now: float) -> float | None:
    """Start of the current run of ticks where the condition held (None: it does not)."""
    if not holds:
        return None
    return now if since is None else since


def _describe(w: _Worker) -> str:
    per_1k = w.price / 3600 / w.effective_mu * 1000 if w.effective_mu > 0 else math.inf
    return (f"{w.worker_id} (${w.price:.3g}/h, a={w.availability:.2f} x mu_hat={w.mu_hat:.4g}/s "
            f"= {w.effective_mu:.4g}/s, ${per_1k:.3g} per 1k trajectories)")


def _check_params(alpha: float, delta: float, window_s: float, tau_s: float, avail_beta: float,
                  warmup_s: float) -> None:
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
