"""The step loop's eye on its policy (echo_rl/learner/watch.py, docs/learner.md "Watching the policy"):
a held-out score that falls below its best by a paired interval, an entropy that collapsed
while groups score alike, the stop that learner.collapse = "stop" asks for, and DAPO's dynamic
sampling taking groups whose samples differ in place of those that scored alike."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import pytest

from echo_rl.core.ci import mean_ci
from echo_rl.core.steprow import StepRow
from echo_rl.data.buffer import ReplayBuffer
from echo_rl.data.records import Record
from echo_rl.learner.evaluation import HeldoutScore
from echo_rl.learner.watch import PolicyWatch, flat, take_groups

pytestmark = pytest.mark.timeout(60)


def score(steps: int, per_prompt: list[float]) -> HeldoutScore:
    ci = mean_ci(per_prompt)
    return HeldoutScore(steps, ci.mean, ci.lo, ci.hi, len(per_prompt), 4, tuple(per_prompt))


@dataclass
class FakeHeldout:
    """What PolicyWatch reads of echo_rl/learner/heldout.py: scores as they come back, the best."""

    pending: list[HeldoutScore] = field(default_factory=list)
    best: HeldoutScore | None = None

    def results(self) -> list[HeldoutScore]:
        out, self.pending = self.pending, []
        for s in out:
            if self.best is None or s.mean > self.best.mean:
                self.best = s
        return out


def rec(group: str, i: int, reward: float) -> Record:
    return Record(
        group_id=group,
        sample_idx=i,
        prompt_ids=[1, 2],
        completion_ids=[3],
        logprobs=[-0.5],
        reward=reward,
        version=0,
        worker_id="w1",
    )


def group(name: str, rewards: list[float]) -> list[Record]:
    return [rec(name, i, r) for i, r in enumerate(rewards)]


def step(watch: PolicyWatch, i: int, entropy: float, groups: list[list[Record]]) -> StepRow:
    row = StepRow(step=i, entropy_est=entropy)
    watch.observe(row, groups, 0)
    return row


VARIED = [group("a", [0.0, 1.0]), group("b", [1.0, 0.0])]
ALIKE = [group("c", [1.0, 1.0]), group("d", [0.1, 0.1])]


def test_a_held_out_fall_below_the_best_is_named_and_the_best_kept(caplog):
    held = FakeHeldout()
    watch = PolicyWatch("warn", held)
    rng = [0.1 * (i % 5) for i in range(30)]
    held.pending.append(score(0, [0.3 + 0.1 * x for x in rng]))
    assert step(watch, 0, 1.0, VARIED).collapse is None
    held.pending.append(score(10, [0.7 + 0.1 * x for x in rng]))  # it learned
    row = step(watch, 10, 0.8, VARIED)
    assert row.collapse is None and row.best_step == 10 and row.heldout_step == 10
    held.pending.append(score(20, [0.65 + 0.1 * x for x in rng]))
    # every prompt lower by 0.05: a sure fall, but by 7 % of the best: a wobble
    assert step(watch, 20, 0.8, VARIED).collapse is None
    held2 = FakeHeldout()
    watch2 = PolicyWatch("warn", held2)
    noisy = [0.7 + (0.2 if i % 2 else -0.2) for i in range(30)]
    held2.pending.append(score(10, [0.7] * 30))
    step(watch2, 10, 0.8, VARIED)
    held2.pending.append(score(20, noisy))  # same mean, noise both ways: no fall
    assert step(watch2, 20, 0.8, VARIED).collapse is None
    with caplog.at_level(logging.WARNING, logger="echo.learner"):
        held.pending.append(score(30, [0.1 + 0.1 * x for x in rng]))  # collapsed
        row = step(watch, 30, 0.3, ALIKE)
    assert row.collapse is not None and "held-out score fell to 0.120" in row.collapse
    assert "after 10" in row.collapse and "best.pt" in row.collapse
    assert row.best_step == 10  # the policy before the fall is the one kept
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "learner.beta = 0.1" in said[0] and "dynamic_sampling" in said[0]
    with caplog.at_level(logging.WARNING, logger="echo.learner"):
        step(watch, 31, 0.3, ALIKE)  # still so: in the row, not logged again
    assert len(caplog.records) == 1 and watch.stop is None


def test_entropy_fallen_while_groups_score_alike_is_a_collapse_and_stop_ends_the_run():
    watch = PolicyWatch("stop", None)
    for i in range(5):
        assert step(watch, i, 1.0, VARIED).collapse is None
    for i in range(5, 10):
        row = step(watch, i, 0.05, VARIED)  # confident, but groups still differ: learning
    assert row.collapse is None and watch.stop is None
    for i in range(10, 15):
        row = step(watch, i, 0.05, ALIKE)
    assert row.flat_groups == 1.0
    assert row.collapse is not None and "entropy fell to 0.050" in row.collapse
    assert watch.stop is not None and "stopped: the policy collapsed at step 14" in watch.stop


def test_off_fills_the_rows_and_says_nothing():
    held = FakeHeldout([score(0, [0.9] * 10)])
    watch = PolicyWatch("off", held)
    step(watch, 0, 1.0, ALIKE)
    held.pending.append(score(5, [0.1] * 10))
    row = step(watch, 5, 0.0, ALIKE)
    assert row.collapse is None and watch.stop is None
    assert (row.heldout_step, row.heldout_mean, row.best_step) == (5, 0.1, 0)


def buffer_with(groups: list[list[Record]]) -> ReplayBuffer:
    buf = ReplayBuffer(staleness=2, capacity_groups=32, group_size=2)
    for g in groups:
        for r in g:
            buf.admit(r)
    return buf


def test_dynamic_sampling_trains_groups_that_differ_and_leaves_out_those_alike():
    alike = [group(f"s{i}", [0.5, 0.5]) for i in range(3)]
    varied = [group(f"v{i}", [0.0, 1.0]) for i in range(3)]
    buf = buffer_with([alike[0], varied[0], alike[1], varied[1], alike[2], varied[2]])
    taken = take_groups(buf, 2, timeout=1.0, dynamic=True)
    assert taken is not None
    trained, left = taken
    assert [g[0].group_id for g in trained] == ["v0", "v1"]
    assert [g[0].group_id for g in left] == ["s0", "s1"]
    assert not any(flat(g) for g in trained)
    # none ready that differ: the step does not wait, alike groups fill it
    trained, left = take_groups(buf, 2, timeout=1.0, dynamic=True) or ([], [])
    assert [g[0].group_id for g in trained] == ["v2", "s2"] and left == []


def test_without_dynamic_sampling_groups_train_as_they_come():
    buf = buffer_with([group("s0", [0.5, 0.5]), group("v0", [0.0, 1.0])])
    assert take_groups(buf, 2, timeout=1.0, dynamic=False) is not None
    assert take_groups(buf, 1, timeout=0.0, dynamic=False) is None  # empty: None, as take


def test_dynamic_sampling_takes_at_most_three_times_the_step():
    buf = buffer_with([group(f"s{i}", [0.5, 0.5]) for i in range(8)] + [group("v", [0, 1])])
    trained, left = take_groups(buf, 2, timeout=1.0, dynamic=True) or ([], [])
    assert len(trained) + len(left) == 6  # 3 x 2, though a varied group waits behind
    assert [g[0].group_id for g in trained] == ["s0", "s1"]


def test_a_shallow_fall_must_be_seen_twice_a_steep_one_once():
    """A dip of 12 % that the next evaluation undoes (SmolLM2 mul1, new defaults: 0.850 at
    step 10, 0.745 at 23, 0.925 at 30) is no collapse; the same fall twice in a row is."""
    held = FakeHeldout()
    watch = PolicyWatch("warn", held)
    base = [0.5 + 0.05 * (i % 7) for i in range(30)]
    held.pending.append(score(10, [x + 0.3 for x in base]))
    step(watch, 10, 1.0, VARIED)
    held.pending.append(score(20, [x + 0.2 for x in base]))  # -0.10: 12 % of 0.8, once
    assert step(watch, 20, 1.0, VARIED).collapse is None
    held.pending.append(score(30, [x + 0.35 for x in base]))  # back above: a new best
    assert step(watch, 30, 1.0, VARIED).collapse is None and held.best.steps == 30
    held.pending.append(score(40, [x + 0.25 for x in base]))  # -0.10 once more
    assert step(watch, 40, 1.0, VARIED).collapse is None
    held.pending.append(score(50, [x + 0.24 for x in base]))  # and again: a fall
    row = step(watch, 50, 1.0, VARIED)
    assert row.collapse is not None and "after 30" in row.collapse


def test_a_policy_that_recovers_and_falls_again_is_warned_again(caplog):
    held = FakeHeldout()
    watch = PolicyWatch("warn", held)
    base = [0.5 + 0.05 * (i % 7) for i in range(30)]
    with caplog.at_level(logging.WARNING, logger="echo.learner"):
        for steps, lift in ((10, 0.3), (20, -0.2), (30, 0.4), (40, -0.3)):
            held.pending.append(score(steps, [x + lift for x in base]))
            step(watch, steps, 1.0, VARIED)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2  # the fall at 20 (steep), the recovery at 30, the fall at 40
    assert "at step 20" in said[0] and "at step 40" in said[1]
