"""Group-normalised advantages (GRPO): A_e = (R_e - mean_group R) / (std_group R + eps).

The standard deviation is the sample (Bessel-corrected) one, as TRL computes it, so our
advantages match TRL's on identical rewards.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def group_advantages(rewards: Sequence[float], eps: float = 1e-4) -> list[float]:
    n = len(rewards)
    if n == 0:
        return []
    mean = sum(rewards) / n
    var = sum((r - mean) ** 2 for r in rewards) / (n - 1) if n > 1 else 0.0
    std = math.sqrt(var)
    return [(r - mean) / (std + eps) for r in rewards]
