"""Toy task for the quickstart: single-digit addition ``a+b=`` with ``a + b <= max_sum``.

The answer is one digit followed by end-of-sequence. A tiny random-init model learns it on two
CPU cores in minutes, which makes it the smallest task that proves the loop learns.

Reward (in [0, 1]):
  1.0  the right digit, then end-of-sequence (exact);
  0.5 + 0.5 / (1 + k)  the right digit first, end-of-sequence after k > 0 extra tokens;
  0.5  the right digit first, no end-of-sequence;
  0.1  some other digit first (format credit: it answered with a number);
  0.0  otherwise.
Held-out split (``echo-rl eval --split heldout``): option ``heldout = K`` (default 0, none) sets
K of the pairs aside, chosen by a fixed seed: training never draws them, eval scores each once.
With K > 0 the quickstart's model must generalise addition to pairs it never saw, which a 2-layer
random-init model mostly does not: a strict test, not the quickstart's default.

Task budgets, for scheduling experiments (docs/scheduling.md, "Affinity"): with option
``short_tokens = N`` every pair but a ``long_share`` of them (default 0.25, chosen by a fixed
seed) is a short task with a budget of N tokens (``Prompt.max_new_tokens``); the others run to
``worker.max_new_tokens``. Untrained, the model ends a sample with a small chance per token,
so the long tasks' groups run many times longer than the short ones': a mix with a real tail
whose long members are the same prompts every time.

The credit for ending sooner is what makes the run reliable: with a flat 0.5 for "right digit,
anything after", stopping is learned only once a group happens to sample end-of-sequence
right after the digit, and four 500-step quickstarts ended at 0.23, 0.40, 0.47 and 0.75
reward; with it, three ended at 0.57, 0.69 and 0.73.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from echo_rl.data.adapter import Adapter, AdapterError, Prompt

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

HELDOUT_SEED = 20261126  # which pairs ``heldout`` sets aside: fixed, so every run agrees


class ToyAddAdapter(Adapter):
    name = "toy-add"

    def __init__(self, options: dict[str, Any], tokenizer: PreTrainedTokenizerBase):
        super().__init__(options, tokenizer)
        unknown = set(self.options) - {"max_sum", "heldout", "short_tokens", "long_share"}
        if unknown:
            raise AdapterError(
                f"toy-add: unknown option(s) {sorted(unknown)}; it takes max_sum, heldout, "
                f"short_tokens, long_share"
            )
        self.max_sum = int(self.options.get("max_sum", 9))
        if not 0 <= self.max_sum <= 9:
            raise AdapterError(f"toy-add: max_sum={self.max_sum} must be 0..9 (one-digit answers)")
        pairs = [(a, b) for a in range(10) for b in range(10) if a + b <= self.max_sum]
        k = int(self.options.get("heldout", 0))
        if not 0 <= k < len(pairs):
            raise AdapterError(
                f"toy-add: heldout={k} must be 0..{len(pairs) - 1} (pairs set aside "
                f"of the {len(pairs)} with a + b <= {self.max_sum})"
            )
        aside = set(random.Random(HELDOUT_SEED).sample(pairs, k))
        self.heldout = [p for p in pairs if p in aside]
        self.pairs = [p for p in pairs if p not in aside]
        self._digits = {tokenizer.convert_tokens_to_ids(str(d)): d for d in range(10)}
        self.short_tokens, self.long = self._budgets(pairs)

    def _budgets(self, pairs: list[tuple[int, int]]) -> tuple[int | None, set[tuple[int, int]]]:
        short = self.options.get("short_tokens")
        share = self.options.get("long_share", 0.25)
        if short is None:
            return None, set()
        if type(short) is not int or short < 1:
            raise AdapterError(
                f"toy-add: short_tokens={short!r} must be a whole number of tokens >= 1 "
                f"(the short tasks' budget), or left out"
            )
        if isinstance(share, bool) or not isinstance(share, int | float) or not 0 <= share <= 1:
            raise AdapterError(f"toy-add: long_share={share!r} must be a share in [0, 1]")
        k = round(share * len(pairs))
        return short, set(random.Random(HELDOUT_SEED + 1).sample(pairs, k))

    def _prompt(self, a: int, b: int) -> Prompt:
        ids = self.tokenizer.encode(f"{a}+{b}=", add_special_tokens=False)
        short = self.short_tokens is not None and (a, b) not in self.long
        return Prompt(
            prompt_ids=ids,
            task={"answer": a + b},
            max_new_tokens=self.short_tokens if short else None,
        )

    def prompts(self, rng: random.Random) -> Iterator[Prompt]:
        while True:
            yield self._prompt(*rng.choice(self.pairs))

    def heldout_prompts(self, rng: random.Random) -> Iterator[Prompt] | None:
        """Each set-aside pair once (None with heldout = 0)."""
        return (self._prompt(a, b) for a, b in self.heldout) if self.heldout else None

    def reward(
        self, task: dict[str, Any], completion_ids: list[int], completion_text: str
    ) -> float:
        if not completion_ids:
            return 0.0
        first = self._digits.get(completion_ids[0])
        if first is None:
            return 0.0
        if first != task["answer"]:
            return 0.1
        eos = self.tokenizer.eos_token_id
        if eos not in completion_ids[1:]:
            return 0.5
        extra = completion_ids.index(eos, 1) - 1  # tokens between the digit and the end
        return 0.5 + 0.5 / (1 + extra)
