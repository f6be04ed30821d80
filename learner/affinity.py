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
  have a measure: 0 the slowest, 1 the fastest.
- ``Picker``: the prompts a grant takes. Without affinity, the adapter's order. With it, a
  window of the next ``window`` prompts; a grant for a worker of rank r takes the prompt whose
  expected length ranks nearest r in the window. A prompt passed over ``2 x window`` times is
  taken next whoever asks: nothing waits more than that many grants, and the grant rules (the
  outstanding bound, fair share, probation) are the work queue's as before. (Twice the window:
  with ``window`` itself, in FIFO order every prompt would reach it, and in a test of a fast
  and a slow worker asking alike, 62 % of the grants were taken by age and a quarter of the
  long tasks still went to the slow worker; with twice, none by age and none.)

What a stranger can do to it: completion lengths come from admitted records (every token is
the worker's own sample, whose log-probs audits recompute), so a worker can make a prompt look
short or long only by the completions it delivers; the cost is a prompt routed to the wrong
speed, never a prompt held back (the window's age bound;
``tests/test_affinity.py::test_lying_lengths_cannot_hold_a_prompt_back``). Its speed is the
learner's own clock over tokens admitted.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from dataplane.adapter import Prompt
from echo.ewma import ewma

ALPHA = 0.3  # EWMA weight of a new observation (length per prompt, a worker's tokens/s)


def prompt_key(prompt_ids: list[int]) -> bytes:
    return hashlib.blake2b(repr(prompt_ids).encode(), digest_size=12).digest()


class LengthBook:
    """Expected completion tokens per prompt: an EWMA of admitted completions' lengths, for
    at most ``max_prompts`` prompts (least recently seen forgotten first)."""

    def __init__(self, max_prompts: int = 65536):
        self.max_prompts = max_prompts
        self._mean: OrderedDict[bytes, float] = OrderedDict()

    def observe(self, prompt_ids: list[int], tokens: int) -> None:
        k = prompt_key(prompt_ids)
        self._mean[k] = ewma(self._mean.get(k), float(tokens), ALPHA)
        self._mean.move_to_end(k)
        while len(self._mean) > self.max_prompts:
            self._mean.popitem(last=False)

    def expect(self, prompt: Prompt) -> float | None:
        got = self._mean.get(prompt_key(prompt.prompt_ids))
        if got is not None:
            return got
        return float(prompt.max_new_tokens) if prompt.max_new_tokens else None

    def __len__(self) -> int:
        return len(self._mean)


class SpeedBook:
    """Each worker's generated tokens per wall second between its admitted batches."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, max_workers: int = 65536):
        self._clock = clock
        self.max_workers = max_workers  # ids ever seen are bounded: oldest forgotten first
        self._rate: dict[str, float] = {}
        self._last: dict[str, float] = {}

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

    def rank(self, worker_id: str, among: set[str]) -> float | None:
        """0 (slowest) .. 1 (fastest) among ``among`` that have a measure; None without one
        or alone."""
        mine = self._rate.get(worker_id)
        rates = [r for w, r in self._rate.items() if w in among and w != worker_id]
        if mine is None or not rates:
            return None
        return sum(r < mine for r in rates) / len(rates)

    def forget(self, worker_id: str) -> None:
        self._rate.pop(worker_id, None)
        self._last.pop(worker_id, None)

    def rate(self, worker_id: str) -> float | None:
        return self._rate.get(worker_id)


class Affinity:
    """The two books a learner with ``learner.affinity`` keeps, fed by admitted batches."""

    def __init__(self, book: LengthBook, speeds: SpeedBook):
        self.book, self.speeds = book, speeds

    def admitted(self, worker_id: str, records: list[Any]) -> None:
        """An admitted batch (records with ``prompt_ids`` and ``completion_ids``)."""
        self.speeds.admitted(worker_id, sum(len(r.completion_ids) for r in records))
        for r in records:
            self.book.observe(r.prompt_ids, len(r.completion_ids))

    def rank(self, worker_id: str, among: set[str]) -> float | None:
        return self.speeds.rank(worker_id, among)


@dataclass
class _Waiting:
    prompt: Prompt
    passed: int = 0  # grants that took another prompt while this one waited


class Picker:
    """The next prompt for a grant: the adapter's order (``book`` None), or by affinity."""

    def __init__(self, prompts: Iterator[Prompt], window: int = 64, book: LengthBook | None = None):
        self._prompts = prompts
        self.window = max(1, window)
        self.book = book
        self._waiting: deque[_Waiting] = deque()
        self.max_wait = 2 * self.window  # grants a prompt may be passed over
        self.routed = 0  # prompts taken out of the adapter's order
        self.aged = 0  # prompts taken because they waited ``max_wait`` grants

    def take(self, rank: float | None) -> Prompt:
        if self.book is None:
            return self._waiting.popleft().prompt if self._waiting else next(self._prompts)
        while len(self._waiting) < self.window:
            self._waiting.append(_Waiting(next(self._prompts)))
        i = self._choose(rank)
        item = self._waiting[i]
        del self._waiting[i]
        for other in self._waiting:
            other.passed += 1
        self.routed += i > 0
        return item.prompt

    def _choose(self, rank: float | None) -> int:
        if self._waiting[0].passed >= self.max_wait:
            self.aged += 1
            return 0  # waited long enough: whoever asks takes it
        if rank is None:
            return 0  # a worker not measured yet (or alone) takes the oldest
        assert self.book is not None
        known = [self.book.expect(w.prompt) for w in self._waiting]
        values = sorted(x for x in known if x is not None)
        if not values:
            return 0
        median = values[len(values) // 2]
        lengths = [median if x is None else x for x in known]
        # the rank picks a place in the window's order of expected length; of the prompts
        # expected that long, the one waiting longest
        order = sorted(range(len(lengths)), key=lambda k: (lengths[k], k))
        want = lengths[order[round(rank * (len(order) - 1))]]
        return next(k for k, x in enumerate(lengths) if x == want)

    def depth(self) -> int:
        return len(self._waiting)
