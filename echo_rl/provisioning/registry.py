"""The controller's books: who is registered, at what price, with what measured throughput,
and what it remembers of identities that left (``echo_rl.provisioning.controller`` composes this with
the scaling rules in ``echo_rl.provisioning.scaling``). No lock and no clock here: the controller holds
its lock around every call and passes ``now``."""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import TypedDict

from echo_rl.core.errors import EchoError
from echo_rl.core.ewma import ewma, time_weight

ACTIVE, STANDBY = "active", "standby"


class RememberedDoc(TypedDict):
    """``Remembered`` as the run folder keeps it (``Controller.state``)."""

    mu_hat: float
    failed_probations: int
    active: bool


@dataclass(frozen=True)
class Remembered:
    """What the controller keeps of one identity across a departure or a learner restart."""

    mu_hat: float  # measured throughput (0: never measured)
    failed_probations: int
    active: bool = False  # active when the state was taken (restart only; a leaver is not)

    @classmethod
    def parse(cls, obj: object) -> Remembered:
        """From the run folder's JSON; anything malformed raises ValueError."""
        if not isinstance(obj, dict) or set(obj) != {"mu_hat", "failed_probations", "active"}:
            raise ValueError(f"not a remembered worker: {obj!r:.80}")
        mu, failed, active = obj["mu_hat"], obj["failed_probations"], obj["active"]
        if (
            not isinstance(mu, (int, float))
            or isinstance(mu, bool)
            or not (mu >= 0 and math.isfinite(mu))
            or type(failed) is not int
            or failed < 0
            or type(active) is not bool
        ):
            raise ValueError(f"bad values in a remembered worker: {obj!r:.80}")
        return cls(float(mu), failed, active)

    def doc(self) -> RememberedDoc:
        return {
            "mu_hat": self.mu_hat,
            "failed_probations": self.failed_probations,
            "active": self.active,
        }


class UnknownWorker(EchoError, KeyError):
    """A call named a worker the controller was never told about (or was told it left)."""

    default_reason = "unknown_worker"


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
class WorkerRecord:
    """One registered worker's books (mutable; only the controller's objects touch it)."""

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

    def set_active(self, now: float) -> None:
        self.state, self.activated_at, self.pending, self.since = ACTIVE, now, 0, now
        self.ready_at = None  # its delivery clock starts at its next work request

    def status(self) -> WorkerStatus:
        return WorkerStatus(
            self.worker_id,
            self.state,
            self.price,
            self.mu_hat,
            self.availability,
            self.effective_mu,
        )


class Registry:
    """The registered workers by id, and the bounded memory of identities that left."""

    def __init__(self, memory: int = 100_000) -> None:
        self.workers: dict[str, WorkerRecord] = {}
        # Measured throughput of workers that left, by identity (the learner passes the
        # worker's public key, never a name it chose): one that comes back is not a stranger
        # again. Bounded, oldest forgotten first.
        self._memory: OrderedDict[str, Remembered] = OrderedDict()
        self._memory_size = memory
        self._identity: dict[str, str] = {}

    def add(
        self, worker_id: str, price: float, mu_prior: float, identity: str | None, now: float
    ) -> tuple[WorkerRecord, bool]:
        """Register a standby worker; returns it and whether it was active before a restart."""
        if worker_id in self.workers:
            raise ValueError(
                f"worker {worker_id!r} is already registered; remove_worker "
                f"first to re-register it with a new price or prior"
            )
        # A trusted prior is credit (a benchmark said so); without one the worker is
        # unmeasured until it delivers.
        w = WorkerRecord(
            worker_id, float(price), STANDBY, float(mu_prior), since=now, measured=mu_prior > 0
        )
        past = None
        if identity is not None:
            self._identity[worker_id] = identity
            past = self._memory.pop(identity, None)
            if past is not None and mu_prior <= 0:
                w.mu_hat, w.failed_probations = past.mu_hat, past.failed_probations
                w.measured = w.mu_hat > 0
        self.workers[worker_id] = w
        return w, past is not None and past.active

    def remove(self, worker_id: str) -> None:
        w = self.get(worker_id)
        del self.workers[worker_id]
        identity = self._identity.pop(worker_id, None)
        if identity is not None and (w.measured or w.failed_probations):
            self._remember(
                identity, Remembered(w.mu_hat if w.measured else 0.0, w.failed_probations)
            )

    def _remember(self, identity: str, past: Remembered) -> None:
        self._memory[identity] = past
        self._memory.move_to_end(identity)
        while len(self._memory) > self._memory_size:
            self._memory.popitem(last=False)

    def state(self) -> dict[str, RememberedDoc]:
        out = {i: r.doc() for i, r in self._memory.items()}
        for wid, identity in self._identity.items():
            w = self.workers[wid]
            out[identity] = Remembered(
                w.mu_hat if w.measured else 0.0, w.failed_probations, w.state == ACTIVE
            ).doc()
        return out

    def restore(self, state: dict[str, object]) -> int:
        n = 0
        for identity, obj in state.items():
            try:
                past = Remembered.parse(obj)
            except ValueError:
                continue
            if isinstance(identity, str) and identity:
                self._remember(identity, past)
                n += 1
        return n

    def get(self, worker_id: str) -> WorkerRecord:
        try:
            return self.workers[worker_id]
        except KeyError:
            raise UnknownWorker(
                f"unknown worker {worker_id!r}: call add_worker first (or it was removed)"
            ) from None

    # -- aggregates the scaling rules read ----------------------------------------------------

    def c_eff(self) -> float:
        return sum(w.effective_mu for w in self.workers.values() if w.state == ACTIVE)

    def typical_mu(self) -> float | None:
        measured = sorted(w.mu_hat for w in self.workers.values() if w.measured and w.mu_hat > 0)
        return measured[len(measured) // 2] if measured else None

    def on_probation(self) -> int:
        return sum(1 for w in self.workers.values() if w.state == ACTIVE and not w.measured)

    @staticmethod
    def rank(w: WorkerRecord, typical: float | None) -> tuple[float | int, float | str, str]:
        """Activation order: measured workers by unit cost, then unmeasured ones by failed
        probations and their price over the fleet's typical rate."""
        if w.measured:
            return (0, w.unit_cost, w.worker_id)
        est = w.price / typical if typical else w.price
        return (w.failed_probations, est, w.worker_id)

    def standby_by_estimate(self, typical: float | None) -> list[WorkerRecord]:
        return sorted(
            (
                w
                for w in self.workers.values()
                if w.state == STANDBY and not w.yielded and (w.effective_mu > 0 or not w.measured)
            ),
            key=lambda w: self.rank(w, typical),
        )


def fold(workers: dict[str, WorkerRecord], now: float, warmup_s: float, tau_s: float) -> None:
    """Fold each active worker's deliveries since the last tick into its ``mu_hat`` (the
    time-aware EWMA of the controller's docstring)."""
    for w in workers.values():
        if w.state != ACTIVE:
            continue
        dt = now - w.since
        if now - w.activated_at < warmup_s:
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
                w.mu_hat = ewma(
                    None if first else w.mu_hat,
                    w.pending / w.pending_busy,
                    time_weight(w.pending_busy, tau_s),
                )
            w.pending, w.pending_busy, w.since = 0, 0.0, now
        elif dt > 0:
            w.mu_hat = ewma(w.mu_hat, w.pending / dt, time_weight(dt, tau_s))
            w.pending, w.since = 0, now
