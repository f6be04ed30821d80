"""The Data Plane adapter interface.

An adapter is a small class that owns one task:
  * ``prompts(rng)``: an endless iterator of ``Prompt`` (token ids plus the task facts the
    reward needs); runs on the learner, which hands prompts out as groups;
  * ``reward(task, completion_ids, completion_text)``: a float, runs on the worker;
  * ``materialise(groups, adv_eps, scale_rewards)``: records -> learner tensors (ids, loss
    masks, advantages); the default here fits single-turn tasks, multi-turn adapters override it;
  * ``heldout_prompts(rng)`` (optional): prompts of a held-out split that ``prompts()`` never
    yields, for ``echo-rl eval --split heldout``; the default declares none (None).

Adapters are found through the entry-point group ``echo_rl.adapters`` so a researcher can
``pip install`` one; ``[adapter] name = "..."`` in the TOML selects it. The group's old name,
``echo.adapters`` (before the package became ``echo_rl``), still works for installed adapters,
with a deprecation line naming the package to update.
"""

from __future__ import annotations

import random
import warnings
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from importlib.metadata import EntryPoint, entry_points
from typing import TYPE_CHECKING, Any

from echo_rl.core.errors import EchoError
from echo_rl.data.advantages import batch_advantages
from echo_rl.data.records import Record

if TYPE_CHECKING:  # annotations only: importing the API needs neither torch nor transformers
    from torch import Tensor
    from transformers import PreTrainedTokenizerBase
ENTRY_POINT_GROUP = "echo_rl.adapters"
OLD_ENTRY_POINT_GROUP = "echo.adapters"  # read too, with a deprecation line (issue 53)


class AdapterError(EchoError, ValueError):
    """A problem with an adapter or its options, found at start-up: raise it from ``__init__``
    with a message that names the option, the value and the fix; the learner, workers, eval
    and sample print it as one line."""

    default_reason = "adapter"


@dataclass(frozen=True)
class Prompt:
    """One prompt the learner hands out as a group of ``learner.group_size`` samples."""

    # the token ids the policy continues (a plain, non-empty list of ints in the vocabulary);
    # a multi-turn adapter's episodes start every context they yield with them
    prompt_ids: list[int]
    # what reward() or episode() needs (the answer, a seed): travels to workers as msgpack, so
    # str, int, float, bool, None, lists and dicts of them
    task: dict[str, Any] = field(default_factory=dict)
    # The task's own token budget, when it has one below worker.max_new_tokens (a short-answer
    # task beside long-reasoning ones): workers stop its samples there, the learner refuses
    # longer completions, and affinity routing (echo_rl/data/affinity.py) takes it as the task's
    # expected length until it has seen some. None: worker.max_new_tokens.
    max_new_tokens: int | None = None


@dataclass
class LearnerBatch:
    """Right-padded tensors for one learner step; targets are ``input_ids[:, 1:]``."""

    input_ids: Tensor  # LongTensor [B, L]
    attention_mask: Tensor  # LongTensor [B, L]
    loss_mask: Tensor  # FloatTensor [B, L-1], 1 where the target token is trained on
    behaviour_logprobs: Tensor  # FloatTensor [B, L-1], aligned with targets
    advantages: Tensor  # FloatTensor [B]
    rewards: Tensor  # FloatTensor [B]
    versions: Tensor  # LongTensor [B]


class Adapter(ABC):
    """A single-turn task: the learner draws prompts, workers generate one completion per
    sample and score it with ``reward``, the learner trains on every completion token.

    One instance is built from the same run config on the learner and on every worker, with
    ``(options, tokenizer)``; the learner calls ``prompts``, ``heldout_prompts`` (eval) and
    ``materialise``, workers call ``reward``. The learner recomputes, at every step, the
    log-prob of every trained token under the current policy (the step-start log-probs of the
    importance ratio, and the reference model's for the KL term): what a worker reports is the
    behaviour log-prob only."""

    # informational; the entry-point name in ``echo.adapters`` is what [adapter] name selects
    name: str = ""
    # The learner recomputes every delivered reward with ``reward()`` and refuses a group
    # whose worker reported another (docs/security.md). An adapter whose reward the learner
    # cannot recompute (it needs an environment the learner does not replay) sets False.
    recomputes_rewards: bool = True
    # A reward that costs much to compute (a sandboxed program, a judge model): the learner
    # then checks a sample of delivered rewards on a thread of its own instead of recomputing
    # every one at intake (security.expensive_reward_check; docs/scheduling.md).
    expensive_reward: bool = False
    # The only token ids the policy may generate (None: the whole vocabulary). Workers sample
    # from the softmax renormalised over them and the learner computes log-probs the same way
    # (echo_rl/data/answers.py); set it in ``__init__`` from the adapter's options.
    answer_tokens: tuple[int, ...] | None = None

    def __init__(self, options: dict[str, Any], tokenizer: PreTrainedTokenizerBase):
        """``options``: the adapter's preset overridden by ``[adapter.options]`` (a dict; the
        ``generation`` table is taken out before). ``tokenizer``: the run's (a transformers
        fast tokenizer). Keep both (``self.options``, ``self.tokenizer``), check every option
        and refuse unknown ones with ``AdapterError``; set ``answer_tokens`` here."""
        self.options = dict(options)
        self.tokenizer = tokenizer

    @abstractmethod
    def prompts(self, rng: random.Random) -> Iterator[Prompt]:
        """An endless iterator of ``Prompt`` (runs on the learner). Every random choice comes
        from ``rng`` (seeded from the run's ``seed`` and checkpointed), never from global
        state: a resumed run then draws the same prompts. It must never yield a held-out
        prompt. Workers never call it, so they need not hold the data set."""

    @abstractmethod
    def reward(
        self, task: dict[str, Any], completion_ids: list[int], completion_text: str
    ) -> float:
        """The score of one sample (runs on a worker, in a worker thread). ``completion_ids``
        are the sampled ids, end-of-sequence included when the model produced one (none when
        cut at ``worker.max_new_tokens``); ``completion_text`` is
        ``tokenizer.decode(completion_ids, skip_special_tokens=True)``. Deterministic (the
        learner recomputes it when ``recomputes_rewards``), finite (|reward| <=
        ``learner.max_abs_reward``), fast, and not relying on ``signal``."""

    def heldout_prompts(self, rng: random.Random) -> Iterator[Prompt] | None:
        """The held-out split: prompts training never draws, to measure what a run learned
        rather than what it memorised (``echo-rl eval --split heldout``). A finite iterator is a
        fixed set, scored once each in order; an endless one is drawn from, every choice from
        ``rng``. None (this default): the adapter declares no held-out split, and eval says so
        and names ``--split train``."""
        return None

    def materialise(
        self,
        groups: Sequence[Sequence[Record]],
        adv_eps: float = 1e-4,
        scale_rewards: str = "group",
    ) -> LearnerBatch:
        """Records of whole groups -> the tensors of one step (runs on the learner). This
        default fits every single-turn task and, through ``record_mask``, multi-turn records
        too: every completion token is trained unless the record carries a ``loss_mask``;
        advantages are group-normalised rewards (``learner.scale_rewards``, ``learner.adv_eps``).
        Override it only for another grouping of advantages."""
        advs = batch_advantages([[r.reward for r in g] for g in groups], adv_eps, scale_rewards)
        return materialise_records(groups, advs, self.tokenizer.pad_token_id or 0)


def record_mask(r: Record) -> list[int]:
    """Which completion tokens are trained on: all of them, unless the record says otherwise
    (multi-turn episodes mark only the policy's own tokens)."""
    m = getattr(r, "loss_mask", None)
    return [1] * len(r.completion_ids) if m is None else list(m)


def materialise_records(
    groups: Sequence[Sequence[Record]], advantages: Sequence[float], pad: int
) -> LearnerBatch:
    """Records -> right-padded learner tensors, the loss mask aligned with next-token targets."""
    import torch  # late: the adapter API itself must stay importable without torch

    records = [r for g in groups for r in g]
    seqs = [r.prompt_ids + r.completion_ids for r in records]
    length = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), length), pad, dtype=torch.long)
    attn = torch.zeros((len(seqs), length), dtype=torch.long)
    mask = torch.zeros((len(seqs), length - 1))
    blp = torch.zeros((len(seqs), length - 1))
    for i, (r, s) in enumerate(zip(records, seqs)):
        ids[i, : len(s)] = torch.tensor(s)
        attn[i, : len(s)] = 1
        # target position j predicts token j+1: completion tokens sit at len(prompt) ..
        # len(s)-1, so their predicting positions start one earlier.
        start = len(r.prompt_ids) - 1
        m = record_mask(r)
        if len(m) != len(r.completion_ids):
            raise ValueError(
                f"record {r.group_id}/{r.sample_idx}: loss_mask has {len(m)} entries "
                f"for {len(r.completion_ids)} completion tokens"
            )
        mask[i, start : len(s) - 1] = torch.tensor(m, dtype=torch.float32)
        # where, not a product: an untrained token's log-prob never enters (-inf * 0 is NaN)
        blp[i, start : len(s) - 1] = torch.where(torch.tensor(m) > 0, torch.tensor(r.logprobs), 0.0)
    return LearnerBatch(
        input_ids=ids,
        attention_mask=attn,
        loss_mask=mask,
        behaviour_logprobs=blp,
        advantages=torch.tensor(list(advantages), dtype=torch.float32),
        rewards=torch.tensor([r.reward for r in records], dtype=torch.float32),
        versions=torch.tensor([r.version for r in records], dtype=torch.long),
    )


_REQUIRED = ("prompts", "reward", "materialise")
_HOW = {
    "prompts": "prompts(self, rng) -> Iterator[Prompt]: endless prompts (token ids + task dict)",
    "reward": "reward(self, task, completion_ids, completion_text) -> float: scores one sample",
    "materialise": "materialise(self, groups, adv_eps, scale_rewards) -> LearnerBatch (the default "
    "fits single-turn)",
    "episode": "episode(self, task, seed, sample_idx): a generator yielding prompt ids and "
    "returning an EpisodeSample (multi-turn; see echo_rl/data/episodes.py)",
}


def _entry_points() -> dict[str, EntryPoint]:
    """The adapters by name: the current group, then the old one for what the current lacks."""
    eps = {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}
    for ep in entry_points(group=OLD_ENTRY_POINT_GROUP):
        if ep.name not in eps:
            dist = ep.dist.name if ep.dist is not None else "its package"
            warnings.warn(
                f"adapter {ep.name!r} ({dist}) is registered in the entry-point group "
                f"{OLD_ENTRY_POINT_GROUP!r}, Echo's old name: register it in "
                f'[project.entry-points."{ENTRY_POINT_GROUP}"] instead; the old group will '
                "stop being read in a later release",
                FutureWarning,  # shown by default: the operator reads it
                stacklevel=3,
            )
            eps[ep.name] = ep
    return eps


def load_adapter(
    name: str,
    options: dict[str, Any],
    tokenizer: PreTrainedTokenizerBase,
    *,
    check_prompts: bool = True,
) -> Adapter:
    """Find ``name`` in the ``echo_rl.adapters`` entry points (or the old ``echo.adapters``
    group), check it, instantiate it.

    ``check_prompts`` draws one prompt (from a private RNG, so the run's prompt stream is
    untouched) and checks its shape: a bad adapter fails here, at start-up, with a message
    saying what to fix. Workers pass ``False``: they never call ``prompts()`` and need not
    hold the adapter's data set.
    """
    eps = _entry_points()
    if name not in eps:
        raise AdapterError(
            f"adapter {name!r} not found in entry-point group {ENTRY_POINT_GROUP!r} "
            f"(installed: {sorted(eps) or 'none'}): set [adapter] name to one of them, or "
            f"pip install the package that provides it"
        )
    try:
        cls = eps[name].load()
    except Exception as exc:
        raise AdapterError(
            f"adapter {name!r}: cannot import {eps[name].value} "
            f"({type(exc).__name__}: {exc}); fix the entry point in the providing "
            f'package\'s [project.entry-points."{ENTRY_POINT_GROUP}"]'
        ) from exc
    if not (isinstance(cls, type) and issubclass(cls, Adapter)):
        raise AdapterError(
            f"adapter {name!r} ({eps[name].value}) is not a subclass of "
            f"echo_rl.data.adapter.Adapter: derive from it"
        )
    missing = [
        m
        for m in _REQUIRED
        if getattr(cls, m, None) is None or getattr(getattr(cls, m), "__isabstractmethod__", False)
    ]
    missing += sorted(set(getattr(cls, "__abstractmethods__", ())) - set(missing))
    if missing:
        raise AdapterError(
            f"adapter {name!r} does not implement {missing}: add "
            + "; ".join(_HOW.get(m, f"{m}(...)") for m in missing)
            + " (see docs/adapters.md)"
        )
    try:
        adapter = cls(options, tokenizer)
    except AdapterError:
        raise
    except TypeError as exc:
        raise AdapterError(
            f"adapter {name!r}: cannot construct {cls.__name__}(options, tokenizer) "
            f"({exc}); its __init__ must take (options: dict, tokenizer)"
        ) from exc
    except Exception as exc:  # a start-up error all the same: one line, not a traceback
        raise AdapterError(
            f"adapter {name!r}: {cls.__name__}(options, tokenizer) failed "
            f"({type(exc).__name__}: {exc}); check the adapter's options "
            f"([adapter.options], [adapter.presets.{name}]) against what it "
            f"takes"
        ) from exc
    if check_prompts:
        check_adapter(adapter, tokenizer, name)
    return adapter


def check_adapter(adapter: Adapter, tokenizer: PreTrainedTokenizerBase, name: str = "") -> None:
    """Draw one prompt and check what the learner and the wire need from it."""
    import msgpack

    name = name or type(adapter).__name__
    try:
        it = adapter.prompts(random.Random(0))
        prompt = next(iter(it))
    except AdapterError:
        raise
    except StopIteration:
        raise AdapterError(
            f"adapter {name!r}: prompts() yielded nothing; it must be an endless "
            f"iterator of Prompt (cycle or sample the data set)"
        ) from None
    except Exception as exc:
        raise AdapterError(
            f"adapter {name!r}: prompts(rng) failed ({type(exc).__name__}: {exc})"
        ) from exc
    if not isinstance(prompt, Prompt):
        raise AdapterError(
            f"adapter {name!r}: prompts() yielded a {type(prompt).__name__}, "
            f"expected echo_rl.data.adapter.Prompt(prompt_ids=[int, ...], task={{...}})"
        )
    ids = prompt.prompt_ids
    if not isinstance(ids, list) or not ids or any(type(t) is not int for t in ids):
        raise AdapterError(
            f"adapter {name!r}: Prompt.prompt_ids must be a non-empty list of int "
            f"token ids (got {type(ids).__name__} {str(ids)[:60]}); encode the text "
            f"with the tokenizer and pass a plain list"
        )
    vocab = len(tokenizer) if tokenizer is not None else None
    if vocab is not None and not all(0 <= t < vocab for t in ids):
        raise AdapterError(
            f"adapter {name!r}: Prompt.prompt_ids holds ids outside the "
            f"tokenizer's vocabulary [0, {vocab})"
        )
    unk = getattr(tokenizer, "unk_token_id", None)
    if unk is not None and unk in ids:
        # The tokenizer met characters it cannot spell and put <unk> in their place: the
        # model would train on prompts it cannot read. Say so now, not after a run.
        raise AdapterError(
            f"adapter {name!r}: a prompt holds {ids.count(unk)} unknown token(s) (<unk>): the "
            f"tokenizer cannot spell some of its characters ({tokenizer.decode(ids)[:80]!r}). "
            f'With the tiny model set model.tiny_vocab = "text" (letters, space, '
            f"punctuation), or use a real model (model.name = a Hugging Face folder)"
        )
    if not isinstance(prompt.task, dict):
        raise AdapterError(
            f"adapter {name!r}: Prompt.task must be a dict (got {type(prompt.task).__name__})"
        )
    try:
        msgpack.packb(prompt.task, use_bin_type=True, strict_types=False)
    except Exception as exc:
        raise AdapterError(
            f"adapter {name!r}: Prompt.task must travel to workers as msgpack "
            f"(str, int, float, bool, None, lists and dicts of them): {exc}"
        ) from None
