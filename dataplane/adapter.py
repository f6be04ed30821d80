"""The Data Plane adapter interface.

An adapter is a small class that owns one task:
  * ``prompts(rng)``: an endless iterator of ``Prompt`` (token ids plus the task facts the
    reward needs); runs on the learner, which hands prompts out as groups;
  * ``reward(task, completion_ids, completion_text)``: a float, runs on the worker;
  * ``materialise(groups)``: records -> learner tensors (ids, loss masks, advantages); the
    default here fits single-turn tasks, multi-turn adapters override it.

Adapters are found through the entry-point group ``echo.adapters`` so a researcher can
``pip install`` one; ``[adapter] name = "..."`` in the TOML selects it.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any

from dataplane.advantages import group_advantages
from dataplane.records import Record

ENTRY_POINT_GROUP = "echo.adapters"


class AdapterError(ValueError):
    pass


@dataclass(frozen=True)
class Prompt:
    prompt_ids: list[int]
    task: dict[str, Any] = field(default_factory=dict)


@dataclass
class LearnerBatch:
    """Right-padded tensors for one learner step; targets are ``input_ids[:, 1:]``."""

    input_ids: Any  # LongTensor [B, L]
    attention_mask: Any  # LongTensor [B, L]
    loss_mask: Any  # FloatTensor [B, L-1], 1 where the target token is trained on
    behaviour_logprobs: Any  # FloatTensor [B, L-1], aligned with targets
    advantages: Any  # FloatTensor [B]
    rewards: Any  # FloatTensor [B]
    versions: Any  # LongTensor [B]


class Adapter(ABC):
    name: str = ""

    def __init__(self, options: dict[str, Any], tokenizer: Any):
        self.options = dict(options)
        self.tokenizer = tokenizer

    @abstractmethod
    def prompts(self, rng: random.Random) -> Iterator[Prompt]: ...

    @abstractmethod
    def reward(self, task: dict[str, Any], completion_ids: list[int], completion_text: str) -> float: ...

    def materialise(self, groups: Sequence[Sequence[Record]], adv_eps: float = 1e-4) -> LearnerBatch:
        import torch  # late: the adapter API itself must stay importable without torch

        records = [r for g in groups for r in g]
        advs = [a for g in groups for a in group_advantages([r.reward for r in g], adv_eps)]
        seqs = [r.prompt_ids + r.completion_ids for r in records]
        length = max(len(s) for s in seqs)
        pad = self.tokenizer.pad_token_id or 0
        ids = torch.full((len(seqs), length), pad, dtype=torch.long)
        attn = torch.zeros((len(seqs), length), dtype=torch.long)
        mask = torch.zeros((len(seqs), length - 1))
        blp = torch.zeros((len(seqs), length - 1))
        for i, (r, s) in enumerate(zip(records, seqs)):
            ids[i, : len(s)] = torch.tensor(s)
            attn[i, : len(s)] = 1
            # target position j predicts token j+1: completion tokens sit at
            # len(prompt) .. len(s)-1, so their predicting positions start one earlier.
            start = len(r.prompt_ids) - 1
            mask[i, start : len(s) - 1] = 1.0
            blp[i, start : len(s) - 1] = torch.tensor(r.logprobs)
        return LearnerBatch(
            input_ids=ids, attention_mask=attn, loss_mask=mask, behaviour_logprobs=blp,
            advantages=torch.tensor(advs, dtype=torch.float32),
            rewards=torch.tensor([r.reward for r in records], dtype=torch.float32),
            versions=torch.tensor([r.version for r in records], dtype=torch.long),
        )


_REQUIRED = ("prompts", "reward", "materialise")


def load_adapter(name: str, options: dict[str, Any], tokenizer: Any) -> Adapter:
    """Find ``name`` in the ``echo.adapters`` entry points, check it, instantiate it."""
    eps = {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}
    if name not in eps:
        raise AdapterError(
            f"adapter {name!r} not found in entry-point group {ENTRY_POINT_GROUP!r} "
            f"(installed: {sorted(eps) or 'none'}): set [adapter] name to one of them, or "
            f"pip install the package that provides it")
    cls = eps[name].load()
    if not (isinstance(cls, type) and issubclass(cls, Adapter)):
        raise AdapterError(f"adapter {name!r} ({eps[name].value}) is not a subclass of "
                           f"dataplane.adapter.Adapter: derive from it")
    missing = [m for m in _REQUIRED if getattr(cls, m, None) is None
               or getattr(getattr(cls, m), "__isabstractmethod__", False)]
    if missing:
        raise AdapterError(f"adapter {name!r} does not implement {missing}: add these methods "
                           f"(see docs/adapters.md)")
    return cls(options, tokenizer)
