"""Confidence intervals for mean rewards: one sample's mean, and the paired difference of two.

Pure functions, no dependencies: ``echo-rl eval`` and the benchmarks share them. The interval is
Student's t: mean +- t(0.975, n - 1) * s / sqrt(n), with s the sample (Bessel-corrected)
standard deviation. Rewards of the same prompt under two checkpoints are paired (same prompt,
same sampling seed), so the comparison's interval is that of the per-prompt differences, which
is narrower than the two separate intervals whenever the two rewards are correlated.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypedDict

# t(0.975, df) for df = 1..30; beyond, the normal quantile is within 2 % of it.
_T975 = (
    12.706,
    4.303,
    3.182,
    2.776,
    2.571,
    2.447,
    2.365,
    2.306,
    2.262,
    2.228,
    2.201,
    2.179,
    2.160,
    2.145,
    2.131,
    2.120,
    2.110,
    2.101,
    2.093,
    2.086,
    2.080,
    2.074,
    2.069,
    2.064,
    2.060,
    2.056,
    2.052,
    2.048,
    2.045,
    2.042,
)
Z975 = 1.959964


def t975(df: int) -> float:
    """The 97.5 % quantile of Student's t with ``df`` degrees of freedom (df >= 1)."""
    if df < 1:
        raise ValueError(f"t975: df={df}: an interval needs at least two values")
    if df <= len(_T975):
        return _T975[df - 1]
    if df <= 120:  # interpolate in 1/df between 30 (2.042) and 120 (1.980)
        return 1.980 + (2.042 - 1.980) * (1 / df - 1 / 120) / (1 / 30 - 1 / 120)
    return Z975


class MeanCIJson(TypedDict):
    """A ``MeanCI`` as ``as_dict`` gives it (``echo-rl eval --json``)."""

    mean: float
    lo: float
    hi: float
    n: int
    std: float


@dataclass(frozen=True)
class MeanCI:
    mean: float
    lo: float
    hi: float
    n: int
    std: float

    @property
    def half(self) -> float:
        return (self.hi - self.lo) / 2

    def as_dict(self) -> MeanCIJson:
        """The fields in order, floats rounded to 6 places."""
        return {
            "mean": round(self.mean, 6),
            "lo": round(self.lo, 6),
            "hi": round(self.hi, 6),
            "n": self.n,
            "std": round(self.std, 6),
        }


def mean_ci(xs: Sequence[float]) -> MeanCI:
    """Mean of ``xs`` with its 95 % t interval; one value: an interval of infinite width."""
    n = len(xs)
    if n == 0:
        raise ValueError("mean_ci: no values")
    mean = math.fsum(xs) / n
    if n == 1:
        return MeanCI(mean, -math.inf, math.inf, 1, math.nan)
    std = math.sqrt(math.fsum((x - mean) ** 2 for x in xs) / (n - 1))
    half = t975(n - 1) * std / math.sqrt(n)
    return MeanCI(mean, mean - half, mean + half, n, std)


def paired_ci(a: Sequence[float], b: Sequence[float]) -> MeanCI:
    """Mean of ``b[i] - a[i]`` with its 95 % interval: ``a`` and ``b`` scored the same prompts
    in the same order (a before, b after)."""
    if len(a) != len(b):
        raise ValueError(f"paired_ci: {len(a)} and {len(b)} values; pairs need the same prompts")
    return mean_ci([y - x for x, y in zip(a, b)])
