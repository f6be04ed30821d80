"""The step loop's eye on its policy (docs/learner.md, "Watching the policy"): the share of
groups whose samples all scored alike, the sampled tokens' entropy, and the held-out scores the
evaluator sends back (echo_rl/learner/heldout.py), with a collapse named in words when they say so.

A policy is collapsing when either

- its held-out score fell: the newest score is below the best one by a paired 95 % interval
  that excludes 0 (the same prompts and seeds each time, echo_rl/core/ci.py) and by at least
  ``HELDOUT_FALL`` of the best score, in the last two evaluations after the best, or in the
  newest alone by ``HELDOUT_STEEP`` of it (a single dip of 12 % came back to the best within
  ten steps in a SmolLM2 run, docs/does-it-learn.md), or
- it stopped exploring: the mean entropy of the last ``WINDOW`` steps is below
  ``ENTROPY_FALL`` of the median of the first ``WINDOW``, while at least ``FLAT_SHARE`` of
  those steps' groups scored alike (no advantage, so no gradient but the KL's).

``learner.collapse = "warn"`` logs it once per new reason (the step rows' ``collapse`` says it
every step while it lasts), ``"stop"`` also ends the run there, ``"off"`` does neither.

DAPO's dynamic sampling (learner.dynamic_sampling) lives here too: ``take_groups`` leaves out
of training the groups that scored alike and takes others in their place.
"""

from __future__ import annotations

import logging
import statistics
from collections import deque
from collections.abc import Sequence
from typing import Literal

from echo_rl.core.ci import MeanCI, paired_ci
from echo_rl.core.steprow import StepRow
from echo_rl.data.buffer import ReplayBuffer
from echo_rl.data.records import Record
from echo_rl.learner.evaluation import HeldoutScore
from echo_rl.learner.heldout import HeldoutEval

log = logging.getLogger("echo.learner")

WINDOW = 5  # steps
HELDOUT_FALL = 0.1  # a fall counts from this share of the best score (a wobble does not)
HELDOUT_STEEP = 0.25  # one fall this deep is enough; a shallower one must be seen twice
ENTROPY_FALL = 0.2  # the entropy of the last WINDOW steps against the first WINDOW's
FLAT_SHARE = 0.75  # groups that scored alike over the last WINDOW steps
DYNAMIC_TAKE = 3  # dynamic sampling takes at most this many times prompts_per_step groups

REMEDIES = (
    "settings that counter it: learner.beta = 0.1 (a KL to the start keeps a gradient on "
    "groups that score alike), learner.epsilon_high = 0.28 (DAPO's clip-higher), "
    "learner.dynamic_sampling = true, a lower learner.lr"
)


def flat(group: Sequence[Record]) -> bool:
    """Whether every sample of a group got the same reward."""
    return len({r.reward for r in group}) <= 1


def take_groups(
    buffer: ReplayBuffer, n: int, timeout: float, dynamic: bool
) -> tuple[list[list[Record]], list[list[Record]]] | None:
    """``n`` whole admissible groups to train, and the groups taken but left out of training
    (dynamic sampling: groups that scored alike, replaced by groups ready in the buffer now,
    at most ``DYNAMIC_TAKE * n`` taken in all; the step does not wait for more). None: not
    ``n`` groups within ``timeout``."""
    first = buffer.take(n, timeout=timeout)
    if first is None or not dynamic:
        return None if first is None else (first, [])
    kept = [g for g in first if not flat(g)]
    left = [g for g in first if flat(g)]
    taken = n
    while len(kept) < n and taken < DYNAMIC_TAKE * n:
        more = buffer.take(1, timeout=0.0)
        if more is None:  # none ready now: the step does not wait, flat groups fill it
            break
        taken += 1
        (left if flat(more[0]) else kept).append(more[0])
    fill = n - len(kept)
    return kept + left[:fill], left[fill:]


class PolicyWatch:
    def __init__(self, mode: Literal["warn", "stop", "off"], heldout: HeldoutEval | None):
        self.mode, self.heldout = mode, heldout
        self.entropy_start: list[float] = []  # the first WINDOW steps' entropy
        self.entropy: deque[float] = deque(maxlen=WINDOW)  # the last WINDOW steps'
        self.seen = 0  # steps with an entropy
        self.flat: deque[float] = deque(maxlen=WINDOW)
        self.flat_skipped = 0
        self.newest: HeldoutScore | None = None
        self.scores: deque[HeldoutScore] = deque(maxlen=4)  # the newest that came back
        self.said: set[str] = set()  # reasons already logged
        self.stop: str | None = None  # why the run should end here (mode "stop")

    def observe(self, row: StepRow, groups: Sequence[Sequence[Record]], skipped: int) -> None:
        """After a step: its row gains the watch's fields; ``groups``: every group the step
        took (those dynamic sampling left out among them, ``skipped`` of them)."""
        self.flat_skipped += skipped
        row.flat_groups = round(sum(map(flat, groups)) / len(groups), 4) if groups else None
        row.flat_skipped = self.flat_skipped
        if row.flat_groups is not None:
            self.flat.append(row.flat_groups)
        if row.entropy_est is not None:
            self.seen += 1
            self.entropy.append(row.entropy_est)
            if len(self.entropy_start) < WINDOW:
                self.entropy_start.append(row.entropy_est)
        if self.heldout is not None:
            for score in self.heldout.results():
                self.newest = score
                self.scores.append(score)
            if self.newest is not None:
                s = self.newest
                row.heldout_step, row.heldout_mean = s.steps, round(s.mean, 4)
                row.heldout_lo, row.heldout_hi = round(s.lo, 4), round(s.hi, 4)
            if self.heldout.best is not None:
                row.best_step = self.heldout.best.steps
        if self.mode == "off":
            return
        reasons = self.reasons()
        row.collapse = "; ".join(reasons.values()) or None
        if not reasons:
            self.said.clear()  # recovered: a later collapse is said again
        new = set(reasons) - self.said
        if new:
            log.warning(
                "the policy looks to be collapsing at step %s: %s. %s%s",
                row.step,
                row.collapse,
                REMEDIES,
                "; learner.collapse = stop ends the run here"
                if self.mode == "warn"
                else "; learner.collapse = stop: the run ends here",
            )
            self.said |= new
        if reasons and self.mode == "stop":
            self.stop = f"stopped: the policy collapsed at step {row.step} ({row.collapse})"

    @staticmethod
    def _fall(best: HeldoutScore, s: HeldoutScore) -> MeanCI | None:
        """The paired difference ``s - best`` when it is a fall: an interval below 0 and at
        least ``HELDOUT_FALL`` of the best score; else None."""
        if len(s.per_prompt) != len(best.per_prompt) or len(s.per_prompt) < 2:
            return None
        d = paired_ci(best.per_prompt, s.per_prompt)
        return d if d.hi < 0 and -d.mean >= HELDOUT_FALL * abs(best.mean) else None

    def reasons(self) -> dict[str, str]:
        """Kind -> the words that say it; empty while the policy looks healthy."""
        out = {}
        best = None if self.heldout is None else self.heldout.best
        after = [x for x in self.scores if best is not None and x.steps > best.steps]
        falls = [self._fall(best, x) for x in after[-2:]] if best is not None else []
        d = falls[-1] if falls else None
        steep = d is not None and best is not None and -d.mean >= HELDOUT_STEEP * abs(best.mean)
        if d is not None and best is not None and (steep or (len(falls) == 2 and falls[0])):
            s = after[-1]
            out["heldout"] = (
                f"the held-out score fell to {s.mean:.3f} [{s.lo:.3f}, {s.hi:.3f}] "
                f"after {s.steps} steps from {best.mean:.3f} [{best.lo:.3f}, "
                f"{best.hi:.3f}] after {best.steps} (paired difference {d.mean:+.3f} "
                f"[{d.lo:+.3f}, {d.hi:+.3f}]; checkpoints/best.pt keeps that policy)"
            )
        if self.seen >= 2 * WINDOW and len(self.flat) == WINDOW:
            start = statistics.median(self.entropy_start)
            now = statistics.fmean(self.entropy)
            alike = statistics.fmean(self.flat)
            if start > 0 and now < ENTROPY_FALL * start and alike >= FLAT_SHARE:
                out["entropy"] = (
                    f"the sampled tokens' entropy fell to {now:.3f} nats/token from "
                    f"{start:.3f} at the start, and {alike:.0%} of the last {WINDOW} steps' "
                    f"groups scored alike (no advantage, no gradient)"
                )
        return out
