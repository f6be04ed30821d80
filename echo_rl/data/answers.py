"""Constrained answers: an adapter may declare the only tokens its policy can generate.

``Adapter.answer_tokens`` (a tuple of token ids, or None for the whole vocabulary) restricts
every generated token to that set. The distribution is the model's softmax renormalised over
the set: logits of every other token get -inf before sampling and before every log-prob.

Why: a random-init tiny model puts most of its mass on tokens that are no action at all (84 %
for the poker letters, docs/adapters.md "Poker that learns"). Invalid answers all play the
same way, so the first thing training learns is the one safe letter, and the policy never
samples the others again. Restricted, the untrained policy is close to uniform over the legal
letters and every group compares them.

Both ends compute the same distribution, so importance ratios compare like with like:
  * workers sample from it and report its log-probs (``echo_rl/worker/backends/transformers.py``);
  * the learner computes every log-prob under it (trainer, reference model, auditor);
  * evaluation and ``echo-rl sample`` generate from it (``echo_rl/adapters/hf.py``).
The set comes from the adapter, which the learner and each worker build from the same run
config: no worker says which tokens are allowed. Admission refuses a record whose trained
token lies outside the set (``bad_answer_token``, ``echo_rl/data/records.py``).

Every generated token must come from the set, the end of sequence included: a set without it
needs ``worker.max_new_tokens = 1`` (one token per answer, the adapter closes the turn).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from echo_rl.data.adapter import AdapterError

if TYPE_CHECKING:  # annotations only: importing this module does not import torch
    import torch
    from torch import Tensor
    from transformers import LogitsProcessor


class AnswerTokensError(AdapterError):
    """The adapter's answer restriction does not fit the run: a start-up error, printed as one
    line with its fix like every other ``AdapterError``."""

    default_reason = "answer_tokens"


def check_answer_tokens(
    tokens: Sequence[int] | None, vocab_size: int, max_new_tokens: int, eos_token_id: int | None
) -> tuple[int, ...] | None:
    """The validated set (sorted, unique), or None when the adapter does not restrict."""
    if tokens is None:
        return None
    out = tuple(sorted({int(t) for t in tokens}))
    if not out:
        raise AnswerTokensError(
            "the adapter's answer_tokens is empty: no answer could be "
            "generated; leave it unset to allow the whole vocabulary"
        )
    bad = [t for t in out if not 0 <= t < vocab_size]
    if bad:
        raise AnswerTokensError(
            f"answer_tokens {bad[:8]} lie outside the vocabulary "
            f"(0..{vocab_size - 1}): the adapter built them for another "
            f"tokenizer"
        )
    if max_new_tokens > 1 and eos_token_id not in out:
        raise AnswerTokensError(
            f"the adapter restricts answers to {len(out)} tokens without end-of-sequence, so "
            f"every answer would run to worker.max_new_tokens = {max_new_tokens}: set "
            f"worker.max_new_tokens = 1, or let the adapter allow the end-of-sequence token"
        )
    return out


def answer_bias(
    tokens: Sequence[int], width: int, device: torch.device | str | None = None
) -> Tensor:
    """[width] float32: 0 on the allowed tokens, -inf elsewhere (added to logits)."""
    import torch

    bias = torch.full((width,), float("-inf"), device=device)
    bias[torch.tensor(list(tokens), device=device)] = 0.0
    return bias


def answer_processor(tokens: Sequence[int] | None) -> list[LogitsProcessor]:
    """Logits processors for Hugging Face ``generate`` (an empty list when unrestricted).
    ``output_scores`` then holds the restricted scores, so their log-softmax is the
    log-prob of the distribution sampled from."""
    if tokens is None:
        return []
    allowed: Sequence[int] = tokens  # the class below does not see the narrowing above
    from transformers import LogitsProcessor

    class OnlyAnswerTokens(LogitsProcessor):
        def __init__(self) -> None:
            self.bias: Tensor | None = None

        def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
            if self.bias is None or self.bias.shape[-1] != scores.shape[-1]:
                self.bias = answer_bias(allowed, scores.shape[-1], scores.device).to(scores.dtype)
            return scores + self.bias

    return [OnlyAnswerTokens()]
