"""Hardware-affinity routing: long tasks to fast workers (docs/scheduling.md, "Affinity").

Tasks differ in how long their rollouts run, and volunteers' GPUs differ in how fast they
generate. A step waits for its slowest group, so a long task on a slow worker holds it back;
RollArt routes each task to the hardware that suits it. Echo's form, with
``learner.affinity = true``:

- ``LengthBook``: what the learner expects a prompt's completions to run to, learned from the
  completions it admitted for that same prompt (EWMA per prompt, a bounded LRU of prompts), or
  before any, the task's own token budget (``Prompt.max_new_tokens``).
- ``SpeedBook``: each worker's generated tokens per second of wall time between its admitted
  batches, measured here (a worker reports nothing of it), and its rank among the workers that
  have a measure and delivered in the last ten minutes: 0 the slowest, 1 the fastest.
- ``Picker``: the prompts a grant takes. Without affinity, the adapter's order. With it, a
  window of the next ``window`` prompts; a grant for a worker of rank r takes the prompt whose
  expected length ranks nearest r in the window. A prompt passed over ``2 x window`` times is
  taken next whoever asks: nothing waits more than that many grants, and the grant rules (the
  outstanding bound, fair share, probation) are the work queue's as before. (Twice the window:
  with ``window`` itself, in FIFO order every prompt would reach it, and a first benchmark run
  took most grants by age; with twice, a fast and a slow worker asking alike split the kinds
  with none taken by age, tests/test_affinity.py.)

What a stranger can do to it: completion lengths come from admitted records (every token is
the worker's own sample, whose log-probs audits recompute), so a worker can make a prompt look
short or long only by the completions it delivers; the cost is a prompt routed to the wrong
speed, never a prompt held back (the window's age bound;
``tests/test_affinity.py::test_lying_lengths_cannot_hold_a_prompt_back``). Its speed is the
learner's own clock over tokens admitted.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable

from echo_rl.core.ewma import ewma
from echo_rl.data.affinity import ALPHA, LengthBook, Picker
from echo_rl.data.records import Record

__all__ = ["Affinity", "LengthBook", "Picker", "SpeedBook"]


class SpeedBook:
    """Each worker's generated tokens per wall second between its admitted batches, and its
    rank among the workers that delivered in the last ``fresh_s``. Ranks come from a sorted
    snapshot of the rates rebuilt at most every ``every_s``: a work request costs a binary
    search, not a pass over the fleet (it runs on the control loop, docs/scale.md)."""

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        max_workers: int = 65536,
        fresh_s: float = 600.0,
        every_s: float = 1.0,
    ):
        self._clock = clock
        self.max_workers = max_workers  # ids ever seen are bounded: oldest forgotten first
        self.fresh_s, self.every_s = fresh_s, every_s
        self._rate: dict[str, float] = {}
        self._last: dict[str, float] = {}
        self._sorted: list[float] = []
        self._sorted_at = -float("inf")

    def admitted(self, worker_id: str, tokens: int) -> None:
        now = self._clock()
        last = self._last.pop(worker_id, None)
        self._last[worker_id] = now  # (re)inserted last: the dict's order is recency
        while len(self._last) > self.max_workers:
            self.forget(next(iter(self._last)))
        if last is None or tokens <= 0:
            return  # the first batch starts the clock
        rate = tokens / max(now - last, 1e-3)
        self._rate[worker_id] = ewma(self._rate.get(worker_id), rate, ALPHA)

    def rank(self, worker_id: str) -> float | None:
        """0 (slowest) .. 1 (fastest) among the workers with a measure that delivered in the
        last ``fresh_s``; None without a measure, or alone."""
        mine = self._rate.get(worker_id)
        if mine is None:
            return None
        now = self._clock()
        if now - self._sorted_at >= self.every_s:
            self._sorted = sorted(
                r for w, r in self._rate.items() if now - self._last.get(w, now) <= self.fresh_s
            )
            self._sorted_at = now
        others = len(self._sorted) - 1
        if others < 1:
            return None
        return min(1.0, bisect.bisect_left(self._sorted, mine) / others)

    def forget(self, worker_id: str) -> None:
        self._rate.pop(worker_id, None)
        self._last.pop(worker_id, None)

    def rate(self, worker_id: str) -> float | None:
        return self._rate.get(worker_id)


class Affinity:
    """The two books a learner with ``learner.affinity`` keeps, fed by admitted batches, and
    the window of prompts a grant picks among (``learner.affinity_window``)."""

    def __init__(self, book: LengthBook, speeds: SpeedBook, window: int = 64):
        self.book, self.speeds, self.window = book, speeds, window

    def admitted(self, worker_id: str, records: list[Record]) -> None:
        """An admitted batch (records with ``prompt_ids`` and ``completion_ids``)."""
        self.speeds.admitted(worker_id, sum(len(r.completion_ids) for r in records))
        for r in records:
            self.book.observe(r.prompt_ids, len(r.completion_ids))

    def rank(self, worker_id: str) -> float | None:
        return self.speeds.rank(worker_id)
