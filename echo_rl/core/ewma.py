"""The one exponentially weighted moving average (EWMA) of the runtime.

One convention everywhere: the first sample replaces the prior (an average started from 0
reports a fraction of the truth for many samples), and each later sample moves the average by
``weight`` of the gap: ``avg + weight * (sample - avg)``. The weight is either fixed or, for
samples that arrive at uneven intervals, ``time_weight(dt, tau_s)``: a sample covering ``dt``
seconds counts as much as ``dt`` seconds of a steady stream would, whatever the sampling rate.

``ewma`` is the formula for state kept as plain floats (records, per-worker dicts); ``Ewma`` is
the same average as an object, for a component that owns its timings.
"""

from __future__ import annotations

import math


def ewma(average: float | None, sample: float, weight: float) -> float:
    """The average after ``sample``; ``average`` None: no sample yet, the sample is it."""
    if not 0.0 <= weight <= 1.0:
        raise ValueError(f"an EWMA weight is in [0, 1], got {weight}")
    return sample if average is None else average + weight * (sample - average)


def time_weight(dt_s: float, tau_s: float) -> float:
    """The weight of a sample covering ``dt_s`` seconds under time constant ``tau_s``."""
    if not tau_s > 0:
        raise ValueError(f"tau_s (EWMA time constant) must be > 0 s, got {tau_s}")
    return 1.0 - math.exp(-max(dt_s, 0.0) / tau_s)


class Ewma:
    """A fixed-weight EWMA. ``value`` is None until the first sample, unless a ``prior`` is
    given: then the first sample is averaged with the prior like any other."""

    def __init__(self, weight: float, prior: float | None = None):
        ewma(None, 0.0, weight)  # validates the weight
        self.weight = weight
        self.value = prior

    def update(self, sample: float) -> float:
        self.value = ewma(self.value, sample, self.weight)
        return self.value

    def get(self, default: float = 0.0) -> float:
        """The average, or ``default`` before the first sample."""
        return default if self.value is None else self.value
