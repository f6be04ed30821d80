"""The one token bucket: the security limits (handshakes, joins, probes: refuse a peer over its
rate) and the link shaper (``echo_rl/broadcast/shaping.py``: wait for credit) both spend from it.

Tokens accrue at ``rate`` per second up to ``burst``; the bucket starts full. The clock is
injectable so the arithmetic is tested in virtual time, without sleeps."""

from __future__ import annotations

import math
import time
from collections.abc import Callable

Clock = Callable[[], float]


class TokenBucket:
    """``take(n)`` spends n tokens if they are there now and never waits (a peer over its rate
    is refused, not queued); ``reserve(n)`` spends them into debt and says how long the debt
    takes to repay, for a caller that waits its turn. ``rate = math.inf``: unlimited."""

    def __init__(self, rate: float, burst: float, clock: Clock = time.monotonic):
        if not rate > 0:
            raise ValueError(f"rate must be > 0 per second (math.inf: unlimited), got {rate}")
        if not burst > 0:
            raise ValueError(f"burst must be > 0, got {burst}")
        self.rate, self.burst, self.clock = float(rate), float(burst), clock
        self._tokens, self._stamp = self.burst, clock()

    @property
    def unlimited(self) -> bool:
        return math.isinf(self.rate)

    @property
    def tokens(self) -> float:
        """Credit now (negative: tokens already promised to waiting callers)."""
        self._refill()
        return self._tokens

    def _refill(self) -> None:
        now = self.clock()
        self._tokens = min(self.burst, self._tokens + (now - self._stamp) * self.rate)
        self._stamp = now

    def take(self, n: float = 1.0) -> bool:
        if self.unlimited:
            return True
        self._refill()
        if self._tokens < n:
            return False
        self._tokens -= n
        return True

    def reserve(self, n: float) -> float:
        """Spend n tokens now, into debt if need be (later callers queue behind the debt, so
        they are served in call order); returns the seconds until the debt is repaid."""
        if self.unlimited:
            return 0.0
        self._refill()
        self._tokens -= n
        return -self._tokens / self.rate if self._tokens < 0 else 0.0

    def give_back(self, n: float) -> None:
        """Undo a reservation whose tokens were never used (a cancelled send)."""
        if not self.unlimited:
            self._refill()
            self._tokens = min(self.burst, self._tokens + n)
