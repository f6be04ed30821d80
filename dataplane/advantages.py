"""Group-normalised advantages (GRPO): A_e = (R_e - mean_group R) / (std_group R + eps).

The standard deviation is the sample (Bessel-corrected) one, as TRL computes it, so our
advantages match TRL's on identical rewards.

Computed on rewards divided by the group's largest |R| (an exact rewrite: the scale cancels,
eps becomes eps / scale), so no intermediate can overflow: for any finite rewards every
advantage is finite, |A_e| <= sqrt(n - 1). A non-finite reward (admission rejects them) gives
NaN advantages, never an exception; the trainer refuses to step on them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def group_advantages(rewards: Sequence[float], eps: float = 1e-4) -> list[float]:
    n = len(rewards)
    if n == 0:
        return []
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
