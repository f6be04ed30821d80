"""echo_rl.core.retry: the one back-off with jitter (issue 53), and that a crowd that failed
together comes back spread out instead of in step."""

from __future__ import annotations

import random

import pytest

from echo_rl.core.retry import Backoff, at_least

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


def test_waits_double_up_to_the_cap_each_in_the_upper_half_of_its_pause() -> None:
    b = Backoff(0.1, 0.8, rng=random.Random(1))
    waits = [b.next() for _ in range(6)]
    pauses = [0.1, 0.2, 0.4, 0.8, 0.8, 0.8]
    for wait, pause in zip(waits, pauses, strict=True):
        assert pause / 2 <= wait <= pause
    assert b.attempts == 6


def test_reset_starts_again_from_the_base() -> None:
    b = Backoff(0.5, 8.0, rng=random.Random(2))
    for _ in range(5):
        b.next()
    assert b.pause_s() == 8.0
    b.reset()
    assert b.pause_s() == 0.5 and 0.25 <= b.next() <= 0.5


def test_a_crowd_that_failed_together_comes_back_spread_out() -> None:
    """1,000 workers refused at the same instant: with a fixed pause they would all retry at
    once; drawn waits spread them over half the pause, no two buckets of 1 % holding more
    than a few percent of the crowd."""
    rng = random.Random(3)
    waits = [Backoff(2.0, 30.0, rng=rng).next() for _ in range(1000)]
    assert min(waits) >= 1.0 and max(waits) <= 2.0
    buckets = [0] * 50  # 20 ms each over [1, 2] s
    for w in waits:
        buckets[min(49, int((w - 1.0) / 0.02))] += 1
    assert max(buckets) <= 45  # uniform would put 20 in each; in step would put 1000 in one


def test_a_wait_someone_asked_for_is_kept_and_spread_behind() -> None:
    rng = random.Random(4)
    got = [at_least(0.2, rng) for _ in range(500)]
    assert all(0.2 <= g <= 0.3 for g in got) and max(got) - min(got) > 0.08
    assert at_least(0.0, rng) == 0.0


@pytest.mark.parametrize("base, cap", [(0.0, 1.0), (2.0, 1.0), (-1.0, 1.0)])
def test_a_bad_backoff_is_refused_naming_the_values(base: float, cap: float) -> None:
    with pytest.raises(ValueError, match="base_s <= cap_s"):
        Backoff(base, cap)


def test_the_pause_does_not_overflow_after_many_attempts() -> None:
    b = Backoff(0.01, 1.0, rng=random.Random(5))
    for _ in range(5000):
        assert b.next() <= 1.0
