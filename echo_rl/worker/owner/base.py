"""The owner signal's base: sample "is the owner's work there now?", remember when it was
last seen, and say how long the machine has been quiet."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod


class OwnerSignal(ABC):
    period_s = 0.2  # sampled this often: a yield starts within one period plus one token

    def __init__(self, quiet_s: float = 30.0):
        if not quiet_s >= 0:
            raise ValueError(f"owner quiet time must be >= 0 s, got {quiet_s}")
        self.quiet_s = quiet_s
        self.last_busy = -float("inf")
        self.last_seen = ""  # what was seen, for the log line

    @abstractmethod
    def sample(self) -> bool:
        """True while the owner's work is present."""

    def busy(self) -> bool:
        b = self.sample()
        if b:
            self.last_busy = time.monotonic()
        return b

    def quiet_for(self) -> float:
        return time.monotonic() - self.last_busy

    def describe(self) -> str:
        return self.last_seen or type(self).__name__
