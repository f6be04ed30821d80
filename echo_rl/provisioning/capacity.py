"""Capacity model (docs/design.md §3 and §4): how much rollout throughput keeps the learner busy, and
how often to publish snapshots without breaking the staleness budget.

Notation as in docs/design.md §4: ``N`` rollouts consumed per learner step, ``T_train`` seconds per step,
``T_bcast`` learner-visible broadcast time, ``mu`` aggregate rollout throughput (trajectories/s),
``kappa`` learner steps between snapshots, ``S`` the staleness budget.

* overlap (no learner bubbles): ``T_bcast + kappa*N/mu <= kappa*T_train``
* capacity requirement:        ``mu_req = kappa*N / (kappa*T_train - T_bcast)``
* worst-case staleness:        ``s_max <= kappa - 1 + ceil((T_bcast + N/mu) / T_train)``
* staleness under overlap:     ``s_max <= kappa + ceil((1 - 1/kappa) * T_bcast / T_train)``

Times are measured, so every comparison allows a relative slack of ``RTOL`` for float rounding:
``overlaps(..., mu_req(...))`` is True, and a ceiling of 2.0000000000000004 is 2, not 3.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from echo_rl.core.errors import EchoError
from echo_rl.core.ewma import ewma

RTOL = 1e-9


class Infeasible(EchoError, ValueError):
    """No throughput can satisfy the overlap condition with these timings."""

    default_reason = "infeasible"


@dataclass(frozen=True)
class CapacityInputs:
    """The measured quantities the capacity model needs; validated on construction."""

    n: int  # rollouts consumed per learner step (prompts x group size)
    t_train: float  # seconds per learner step
    t_bcast: float  # seconds from publication until a fraction q of active workers installed

    def __post_init__(self) -> None:
        _check_timings(self.n, self.t_train, self.t_bcast)

    def mu_req(self, kappa: int) -> float:
        return mu_req(self.n, kappa, self.t_train, self.t_bcast)

    def overlaps(self, kappa: int, mu_total: float) -> bool:
        return overlaps(self.n, kappa, self.t_train, self.t_bcast, mu_total)

    def choose_kappa(self, staleness: int, mu_total: float) -> KappaChoice:
        return choose_kappa(staleness, self.n, self.t_train, self.t_bcast, mu_total)


def _check_timings(n: int, t_train: float, t_bcast: float) -> None:
    if n <= 0:
        raise ValueError(
            f"N (rollouts per learner step) must be > 0, got {n}; it is "
            f"prompts_per_step x group_size"
        )
    _check_times(t_train, t_bcast)


def _check_times(t_train: float, t_bcast: float) -> None:
    if not (t_train > 0 and math.isfinite(t_train)):
        raise ValueError(
            f"T_train must be a positive number of seconds, got {t_train}; "
            f"measure at least one learner step first"
        )
    if not (t_bcast >= 0 and math.isfinite(t_bcast)):
        raise ValueError(f"T_bcast must be >= 0 seconds, got {t_bcast}")


def _check_kappa(kappa: int) -> None:
    if int(kappa) != kappa or kappa < 1:
        raise ValueError(
            f"kappa (learner steps between snapshots) must be an integer >= 1, got {kappa}"
        )


def _ceil(x: float) -> int:
    """Ceiling that ignores float noise: measured times are never exact to 1e-9."""
    return math.ceil(x - RTOL * max(1.0, abs(x)))


T_TRAIN_WEIGHT = 0.2  # weight of the newest step in the learner's T_train average


def t_train_average(previous: float | None, t_train: float) -> float:
    """The T_train behind mu_req: an exponential average over steps, as the learner keeps it
    (echo_rl/learner/provision.py) and the simulator replays it, so one slow step does not swing the fleet."""
    return ewma(previous, t_train, T_TRAIN_WEIGHT)


def mu_req(n: int, kappa: int, t_train: float, t_bcast: float) -> float:
    """Least aggregate throughput (trajectories/s) that keeps the learner free of bubbles.

    Solving the overlap condition for ``sum(mu)``. Raises ``Infeasible`` when
    ``kappa*T_train <= T_bcast``: the broadcast alone outlasts a publication period, so the
    learner waits whatever the fleet's size.
    """
    _check_timings(n, t_train, t_bcast)
    _check_kappa(kappa)
    window = kappa * t_train - t_bcast  # time the fleet has to produce kappa*N rollouts
    if window <= 0:
        raise Infeasible(
            f"no throughput avoids learner bubbles: kappa*T_train = {kappa} x {t_train:g} s = "
            f"{kappa * t_train:g} s <= T_bcast = {t_bcast:g} s; raise kappa above "
            f"T_bcast/T_train = {t_bcast / t_train:.3g} (needs a staleness budget S >= kappa), "
            f"speed up the broadcast, or lengthen learner steps"
        )
    return kappa * n / window


def overlaps(n: int, kappa: int, t_train: float, t_bcast: float, mu_total: float) -> bool:
    """Overlap condition ``T_bcast + kappa*N/sum(mu) <= kappa*T_train`` (no learner bubbles)."""
    _check_timings(n, t_train, t_bcast)
    _check_kappa(kappa)
    if mu_total <= 0:
        return False  # nothing produced: the learner waits forever
    lhs = t_bcast + kappa * n / mu_total
    rhs = kappa * t_train
    return lhs <= rhs + RTOL * rhs


def staleness_bound_worst(
    n: int, kappa: int, t_train: float, t_bcast: float, mu_total: float
) -> int:
    """``kappa - 1 + ceil((T_bcast + N/mu) / T_train)``: no rollouts from a new snapshot until
    its broadcast completes, then N rollouts at aggregate rate ``mu``."""
    _check_timings(n, t_train, t_bcast)
    _check_kappa(kappa)
    if mu_total <= 0:
        raise ValueError(
            f"mu_total must be > 0 trajectories/s to bound staleness, got "
            f"{mu_total}; with no throughput the learner never gets a batch"
        )
    return kappa - 1 + _ceil((t_bcast + n / mu_total) / t_train)


def staleness_bound_overlap(kappa: int, t_train: float, t_bcast: float) -> int:
    """``kappa + ceil((1 - 1/kappa) * T_bcast / T_train)``; valid only when ``overlaps``."""
    _check_times(t_train, t_bcast)
    _check_kappa(kappa)
    # (1 - 1/kappa) * T_bcast / T_train written as one division: fewer roundings
    return kappa + _ceil((kappa - 1) * t_bcast / (kappa * t_train))


@dataclass(frozen=True)
class KappaChoice:
    kappa: int
    bound: int | None  # staleness bound that holds for this kappa; None: none (mu_total <= 0)
    overlap: bool  # whether the overlap condition holds at mu_total
    fallback: bool  # True: no kappa met both conditions, kappa = max(1, S-1)
    bcast_slower_than_train: bool  # docs/design.md §3 asks for a warning in that case
    warnings: tuple[str, ...] = ()
    reason: str = ""


def choose_kappa(
    staleness: int, n: int, t_train: float, t_bcast: float, mu_total: float
) -> KappaChoice:
    """Publication period for staleness budget ``S`` (docs/design.md §3).

    Rule: the largest ``kappa`` in ``1..S`` that satisfies the overlap condition at
    ``mu_total`` *and* whose overlap bound ``kappa + ceil((1 - 1/kappa) T_bcast/T_train)`` is
    ``<= S``. Larger kappa means fewer broadcasts (less bandwidth, and overlap gets easier, as
    ``T_bcast`` is amortised over more steps) but a looser bound, so the search runs from S
    down. When no kappa qualifies, fall back to ``max(1, S - 1)``, the default that meets the
    budget whenever ``T_bcast <= T_train`` and overlap holds; the reason then says which
    condition failed and ``bound`` is the worst-case bound (None when ``mu_total <= 0``).
    ``bcast_slower_than_train`` (with a warning) flags ``T_bcast > T_train``, where even
    ``S - 1`` may exceed the budget: speed up the broadcast or raise S.
    """
    if int(staleness) != staleness or staleness < 0:
        raise ValueError(f"staleness budget S must be an integer >= 0, got {staleness}")
    _check_timings(n, t_train, t_bcast)
    if staleness == 0:  # synchronous: publish every step, wait for its broadcast and rollouts
        return KappaChoice(
            1,
            0,
            False,
            False,
            t_bcast > t_train,
            (),
            "S = 0 is synchronous: kappa = 1, every step waits for the broadcast "
            "and the rollouts of its own version (no overlap)",
        )
    warnings = _kappa_warnings(t_train, t_bcast)
    for kappa in range(staleness, 0, -1):
        bound = staleness_bound_overlap(kappa, t_train, t_bcast)
        if bound <= staleness and overlaps(n, kappa, t_train, t_bcast, mu_total):
            return KappaChoice(
                kappa,
                bound,
                True,
                False,
                t_bcast > t_train,
                warnings,
                f"largest kappa with overlap at mu={mu_total:g}/s and "
                f"bound {bound} <= S={staleness}",
            )
    return _fallback(staleness, n, t_train, t_bcast, mu_total, warnings)


def _kappa_warnings(t_train: float, t_bcast: float) -> tuple[str, ...]:
    if t_bcast <= t_train:
        return ()
    return (
        f"T_bcast = {t_bcast:g} s exceeds T_train = {t_train:g} s: kappa = S-1 no longer "
        f"guarantees staleness <= S; speed up the broadcast (more chains, smaller snapshots) "
        f"or raise S",
    )


def _fallback(
    staleness: int,
    n: int,
    t_train: float,
    t_bcast: float,
    mu_total: float,
    warnings: tuple[str, ...],
) -> KappaChoice:
    kappa = max(1, staleness - 1)
    overlap = overlaps(n, kappa, t_train, t_bcast, mu_total)
    bound = (
        staleness_bound_overlap(kappa, t_train, t_bcast)
        if overlap
        else staleness_bound_worst(n, kappa, t_train, t_bcast, mu_total)
        if mu_total > 0
        else None
    )
    try:
        need = f"overlap needs mu >= {mu_req(n, kappa, t_train, t_bcast):.4g}/s"
    except Infeasible:
        need = f"overlap impossible at kappa={kappa} (kappa*T_train <= T_bcast)"
    reason = (
        f"no kappa in 1..{staleness} has both overlap at mu={mu_total:g}/s and a "
        f"bound <= S; fallback kappa = max(1, S-1) = {kappa}, {need}"
    )
    return KappaChoice(kappa, bound, overlap, True, t_bcast > t_train, warnings + (reason,), reason)
