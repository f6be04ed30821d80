"""Which prompt a grant takes: the adapter's order, or by hardware affinity (long tasks to fast
workers; echo_rl/control/affinity.py says what the learner keeps for it, docs/scheduling.md "Affinity").

Here: ``LengthBook``, what a prompt's completions are expected to run to (learned from
admitted completions of the same prompt, or its own token budget), and ``Picker``, which takes
from a window of the next prompts the one whose expected length ranks where the asking
worker's speed ranks. A data-plane rule, as ``echo_rl.data.rules`` is: the learner's work queue
and the simulator (echo_rl/provisioning/sim/tail.py) run the same code.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from collections.abc import Iterator
from dataclasses import dataclass

from echo_rl.core.ewma import ewma
from echo_rl.data.adapter import Prompt

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

    def expect(self, prompt: Prompt, key: bytes | None = None) -> float | None:
        """``key``: the prompt's ``prompt_key``, when the caller keeps it (the Picker does, so
        a grant on the control loop hashes no prompt)."""
        got = self._mean.get(key if key is not None else prompt_key(prompt.prompt_ids))
        if got is not None:
            return got
        return float(prompt.max_new_tokens) if prompt.max_new_tokens else None

    def __len__(self) -> int:
        return len(self._mean)


@dataclass
class _Waiting:
    prompt: Prompt
    key: bytes  # prompt_key, hashed once when the prompt enters the window
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
            prompt = next(self._prompts)
            self._waiting.append(_Waiting(prompt, prompt_key(prompt.prompt_ids)))
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
        known = [self.book.expect(w.prompt, w.key) for w in self._waiting]
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
