"""The learner's control loop as a load model (docs/scale.md): what N workers cost it a
second, from the per-message costs ``benchmarks/load_control.py`` measures with the learner's
own counters (echo_rl.control.cpu), and the fleet size at which one core saturates.

Per worker: a heartbeat every period, a work request every poll interval while it has no work
(standby workers all the time), and its share of the fleet-wide passes (housekeeping, the
per-worker stats tables). Admission (work requests that carry work, trajectory batches) follows
the learner's appetite, not the fleet's size: a fixed term.

Two policies: ``fixed``, as before issue 38 (every worker beats each ``worker.heartbeat_s`` and
polls every 0.5 s), and ``scaled`` (the learner stretches both to fleet size over
``transport.heartbeats_per_s``; SessionTable.period, Deliveries.poll_after).
"""

from __future__ import annotations

from dataclasses import dataclass

CORE_US = 1e6  # one core: CPU microseconds a second
STANDBY_POLL_S = 0.5  # learner Deliveries: a standby worker's retry after an empty grant


@dataclass(frozen=True)
class ControlCosts:
    """Measured costs, CPU microseconds (loop + its share of I/O and loop overhead)."""

    heartbeat_us: float
    poll_us: float  # a work request answered without work
    sweep_us_per_worker_s: float  # housekeeping and stats passes, per worker per second
    admission_us_per_s: float = 0.0  # trajectory batches and granted work requests


def load_us(n: int, c: ControlCosts, heartbeat_s: float, budget: float, scaled: bool) -> float:
    """CPU microseconds a second the control loop spends on a fleet of ``n``."""
    if scaled and budget > 0:
        period, poll = max(heartbeat_s, n / budget), max(STANDBY_POLL_S, n / budget)
    else:
        period, poll = heartbeat_s, STANDBY_POLL_S
    return (
        n * (c.heartbeat_us / period + c.poll_us / poll + c.sweep_us_per_worker_s)
        + c.admission_us_per_s
    )


def saturation(c: ControlCosts, heartbeat_s: float, budget: float, scaled: bool) -> int:
    """The largest fleet whose load fits one core (0 when admission alone fills it)."""
    lo, hi = 0, 1 << 24
    while lo < hi:
        mid = (lo + hi + 1) // 2
        fits = load_us(mid, c, heartbeat_s, budget, scaled) <= CORE_US
        lo, hi = (mid, hi) if fits else (lo, mid - 1)
    return lo


def curve(
    c: ControlCosts, heartbeat_s: float, budget: float, sizes: list[int]
) -> list[dict[str, float]]:
    """Core share used at each fleet size, both policies (the plot's rows)."""
    return [
        {
            "workers": n,
            "fixed": load_us(n, c, heartbeat_s, budget, False) / CORE_US,
            "scaled": load_us(n, c, heartbeat_s, budget, True) / CORE_US,
        }
        for n in sizes
    ]
