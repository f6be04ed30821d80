"""Test doubles shared by several test files."""

from __future__ import annotations


class FakeClock:
    """A clock the test moves by hand (``clock.t = ...``): no sleeps."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t
