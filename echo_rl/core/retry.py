"""The one way Echo waits before trying again: exponential back-off with jitter.

A fleet fails together (a learner restarts, a parent relay is busy, a rate limit answers every
worker at once); if each retried after the same fixed pause they would come back in step and
fail together again. ``Backoff`` doubles the pause from ``base_s`` up to ``cap_s`` and draws
each wait uniformly from the upper half of it ("equal jitter": at least half the pause, so no
one hammers; spread over the other half, so a crowd thins out). ``reset()`` after a success.
``at_least`` spreads a wait someone else set (a learner's "ask again in 0.2 s" to every idle
worker) the same way, never below it.

Used by the worker's join and deliveries, a relay's "not yet" chunk requests and the worker's
polls after an empty grant (tests/test_retry.py)."""

from __future__ import annotations

import random

# One generator for the process unless a caller passes its own (tests pass a seeded one).
_RNG = random.Random()


class Backoff:
    def __init__(self, base_s: float, cap_s: float, *, rng: random.Random | None = None) -> None:
        if not 0 < base_s <= cap_s:
            raise ValueError(f"Backoff: need 0 < base_s <= cap_s, got {base_s} and {cap_s}")
        self.base_s, self.cap_s = base_s, cap_s
        self.rng = rng or _RNG
        self.attempts = 0  # waits drawn since the last reset

    def pause_s(self) -> float:
        """The ceiling of the next wait: ``base_s * 2**attempts``, at most ``cap_s``."""
        return min(self.cap_s, self.base_s * 2.0 ** min(self.attempts, 60))

    def next(self) -> float:
        """The next wait in seconds, in ``[pause/2, pause]``; the pause doubles after it."""
        pause = self.pause_s()
        self.attempts += 1
        return pause / 2 + self.rng.uniform(0.0, pause / 2)

    def reset(self) -> None:
        self.attempts = 0


def at_least(delay_s: float, rng: random.Random | None = None) -> float:
    """``delay_s`` spread over ``[delay_s, 1.5 * delay_s]``: a wait someone else asked for,
    kept, with the crowd that got the same answer spread out behind it."""
    if delay_s <= 0:
        return 0.0
    return delay_s + (rng or _RNG).uniform(0.0, delay_s / 2)
