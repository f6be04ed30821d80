"""What the scaling rules decide and with which knobs: the records the controller returns and
logs, shared by ``echo_rl.provisioning.scaling`` (shortfall, surplus, probation, liveness) and
``echo_rl.provisioning.trades`` (swaps and trials)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from echo_rl.provisioning.registry import WorkerRecord

ACTIVATE, RELEASE, SHORT = "activate", "release", "short"
SWAP_GAIN = 0.2  # a swap must cut the unit cost of the swapped worker by at least this share
SWAP_SHARE = 0.05  # at most this share of the active workers is swapped per window


@dataclass(frozen=True)
class Decision:
    time: float
    action: str  # ACTIVATE, RELEASE, or SHORT (no standby left to close the gap)
    worker_id: str | None  # None for SHORT
    reason: str  # human-readable, with the numbers that triggered it
    c_eff: float  # effective capacity when decided, before this decision (trajectories/s)
    target: float  # alpha * mu_req (trajectories/s)
    # Which rule decided (echo_rl.provisioning.words puts it in words for the volunteer): shortfall,
    # probation, liveness, swap, trial, surplus, probation_over, yielded, short.
    cause: str = ""


@dataclass(frozen=True)
class Policy:
    """The scaling knobs (``provisioning.*`` in the learner's config)."""

    alpha: float = 1.1
    delta: float = 0.2
    window_s: float = 60.0
    warmup_s: float = 30.0
    probation_slots: int = 4
    probation_ready_s: float = 600.0
    group_size: int = 1
    probation_group_s: float = 0.0


def describe(w: WorkerRecord) -> str:
    per_1k = w.price / 3600 / w.effective_mu * 1000 if w.effective_mu > 0 else math.inf
    return (
        f"{w.worker_id} (${w.price:.3g}/h, a={w.availability:.2f} x mu_hat={w.mu_hat:.4g}/s "
        f"= {w.effective_mu:.4g}/s, ${per_1k:.3g} per 1k trajectories)"
    )
