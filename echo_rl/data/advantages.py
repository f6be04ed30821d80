"""Group-relative advantages (GRPO): A_e = (R_e - mean_group R) / (std R + eps).

``scale`` picks the std (TRL's ``scale_rewards``): ``"group"`` the group's own, ``"batch"`` one
std over every reward of the learner step's batch, ``"none"`` no division (Dr. GRPO). The
standard deviation is the sample (Bessel-corrected) one, as TRL computes it, so our advantages
match TRL's on identical rewards.

Per group, computed on rewards divided by the group's largest |R| (an exact rewrite: the scale cancels,
eps becomes eps / scale), so no intermediate can overflow: for any finite rewards every
advantage is finite, |A_e| <= sqrt(n - 1). A non-finite reward (admission rejects them) gives
NaN advantages, never an exception; the trainer refuses to step on them. ``batch`` and
``none`` work on the raw rewards, which admission bounds (``learner.max_abs_reward``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

SCALES = ("group", "batch", "none")


def _std(xs: Sequence[float]) -> float:
    n = len(xs)
    if n < 2:
        return 0.0
    mean = sum(xs) / n
    return math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1))


def group_advantages(rewards: Sequence[float], eps: float = 1e-4) -> list[float]:
    if not rewards:
        return []
    n = len(rewards)
    scale = max(abs(r) for r in rewards)
    if scale == 0:
        return [0.0] * n
    if not math.isfinite(scale):
        return [math.nan] * n
    z = [r / scale for r in rewards]  # |z| <= 1
    mean = sum(z) / n
    var = sum((x - mean) * (x - mean) for x in z) / (n - 1) if n > 1 else 0.0
    std = math.sqrt(var)
    return [(x - mean) / (std + eps / scale) for x in z]


def batch_advantages(
    groups: Sequence[Sequence[float]], eps: float = 1e-4, scale: str = "group"
) -> list[float]:
    """Advantages of every reward of ``groups`` (one list of rewards per group), flattened in
    order: centred on each group's mean, divided per ``scale``."""
    if scale == "group":
        return [a for g in groups for a in group_advantages(g, eps)]
    if scale not in SCALES:
        raise ValueError(f"unknown reward scaling {scale!r}: use one of {SCALES}")
    centred = [r - sum(g) / len(g) for g in groups for r in g]
    if scale == "none":
        return centred
    std = _std([r for g in groups for r in g])
    return [c / (std + eps) for c in centred]
