"""Multi-turn (environment) adapters: the adapter drives generation, one call per decision.

A single-turn adapter is asked for ``reward(task, completion)`` after the worker generated the
completion. An environment (a game, a tool loop) needs a generation per decision, with the
environment's reply between decisions. An ``EpisodeAdapter`` therefore plays whole episodes on
the worker, given a ``generate`` callable:

    generate(prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]

(token ids in; generated ids and their behaviour log-probs out, one per prompt, under the
installed snapshot). ``rollout(groups, generate)`` plays ``group.n`` episodes for every group
in lockstep, so each round of decisions across all episodes is one batched ``generate`` call,
and returns one ``EpisodeSample`` per episode: the transcript after the group's prompt
(``completion_ids``), per-token ``logprobs`` (0 on environment tokens), a per-token
``loss_mask`` (1 on tokens the policy generated) and the episode's scalar ``reward``.

The record a worker sends for it is the usual one plus ``loss_mask`` (same length as
``completion_ids``); ``materialise`` places the mask under the completion tokens, shifted for
next-token targets, and group-normalised advantages then reach only the policy's tokens.
"""

from __future__ import annotations

import itertools
from abc import abstractmethod
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from echo_rl.core.errors import EchoError
from echo_rl.data.adapter import (
    Adapter,
    AdapterError,
    LearnerBatch,
    materialise_records,  # noqa: F401
    record_mask,  # noqa: F401  (re-exported)
)
from echo_rl.data.advantages import batch_advantages
from echo_rl.data.records import Record
from echo_rl.data.rules import derived_seed

if TYPE_CHECKING:  # annotations only: importing the API does not import torch
    import threading

    from torch import Tensor

    from echo_rl.core import wire
    from echo_rl.data.adapter import Adapter

Generated = tuple[list[int], list[float]]
GenerateFn = Callable[[list[list[int]]], list[Generated]]
# An episode yields the ids the policy must continue, receives what was generated, and finally
# returns its sample.
Episode = Generator[list[int], Generated, "EpisodeSample"]


@dataclass
class EpisodeSample:
    """What an episode returns: its transcript after the group's prompt, and its reward."""

    # every token after the group's prompt_ids, in order: the policy's generated ids exactly as
    # generated (never re-tokenised) and the environment's ids between them; 1 to the adapter's
    # max_completion_tokens of them
    completion_ids: list[int]
    # one per completion token: the behaviour log-prob of each generated token as `generate`
    # returned it, 0.0 on environment tokens (masked, so never used)
    logprobs: list[float]
    # one per completion token: 1 on the policy's tokens (trained), 0 on environment tokens
    loss_mask: list[int]
    # the episode's scalar return (finite, |reward| <= learner.max_abs_reward)
    reward: float
    # the adapter's own stats and logs, free-form. Its numbers (int, float, bool) under short
    # names (``[a-z][a-z0-9_]{0,31}``, at most 16) reach the learner as the record's ``stats``:
    # the step row's ``episode_stats`` shows their means, nothing trains on them. The rest
    # (text, lists, dicts) stays on the worker
    info: dict[str, Any] = field(default_factory=dict)
    # the episode stopped at a limit rather than at its end: set it when the episode ran out of
    # max_completion_tokens (or another budget of the adapter's) and was ended early. ``drive``
    # sets it when a decision hit worker.max_new_tokens without end-of-sequence; the worker
    # when the transcript fills max_completion_tokens. Counted in the step's completions_cut
    cut: bool = False

    def __post_init__(self) -> None:
        n = len(self.completion_ids)
        if len(self.logprobs) != n or len(self.loss_mask) != n:
            raise ValueError(
                f"episode sample: {n} ids, {len(self.logprobs)} log-probs, "
                f"{len(self.loss_mask)} mask entries"
            )


@dataclass(frozen=True)
class EpisodeRecord(Record):
    """A ``Record`` with a per-completion-token loss mask (None: every token trained)."""

    loss_mask: list[int] | None = None  # per completion token, 1 where trained (None: all)


def drive(
    episodes: Sequence[Episode],
    generate: GenerateFn,
    replay: dict[int, list[Generated]] | None = None,
) -> list[EpisodeSample]:
    """Run episodes in lockstep: every round, all pending decisions go to one ``generate``.
    ``replay[i]``: decisions episode ``i`` already made elsewhere (a continuation after a
    preemption, docs/preemption.md): fed back in order before it asks ``generate``. A
    ``Cut`` raised by ``generate`` leaves with every episode's decisions so far. An episode
    one of whose decisions ``generate.is_cut`` (``backend_generate_fn``'s) calls cut short is
    marked ``cut``."""
    is_cut: Callable[[list[int]], bool] | None = getattr(generate, "is_cut", None)
    results: list[EpisodeSample | None] = [None] * len(episodes)
    queued = {i: list(d) for i, d in (replay or {}).items()}
    made: dict[int, list[Generated]] = {i: [] for i in range(len(episodes))}
    pending: dict[int, list[int]] = {}
    for i, ep in enumerate(episodes):
        try:
            pending[i] = next(ep)
        except StopIteration as stop:
            results[i] = stop.value
    while pending:
        order = sorted(pending)
        ask = [i for i in order if not queued.get(i)]
        try:
            outs = dict(zip(ask, generate([pending[i] for i in ask]) if ask else []))
        except Cut as cut:
            cut.decisions = made
            raise
        if len(outs) != len(ask):
            raise RuntimeError(f"generate returned {len(outs)} results for {len(ask)} prompts")
        pending = {}
        for i in order:
            out = outs[i] if i in outs else queued[i].pop(0)
            made[i].append((list(out[0]), list(out[1])))
            try:
                pending[i] = episodes[i].send((list(out[0]), list(out[1])))
            except StopIteration as stop:
                results[i] = stop.value
                if is_cut is not None and isinstance(stop.value, EpisodeSample):
                    stop.value.cut = stop.value.cut or any(is_cut(ids) for ids, _ in made[i])
    done = [r for r in results if r is not None]
    assert len(done) == len(results)
    return done


class _Sampled(Protocol):
    """One sample as a worker backend's ``generate`` returns it (``echo_rl.worker.backends``'s
    ``Sample``): what ``backend_generate_fn`` reads of it."""

    @property
    def completion_ids(self) -> list[int]: ...

    @property
    def logprobs(self) -> list[float]: ...


class GroupBackend(Protocol):
    """What ``backend_generate_fn`` needs of a worker backend (``echo_rl.worker.backends``):
    ``generate`` over wire groups, samples per group. A backend that keeps a multi-turn
    context cache has ``new_turn_cache`` and ``generate_turn`` too (found by name)."""

    def generate(
        self, groups: list[wire.Group], max_new_tokens: int, temperature: float
    ) -> Sequence[Sequence[_Sampled]]: ...


def replay_of(groups: Sequence[wire.Group]) -> dict[int, list[Generated]]:
    """The decisions to replay, per episode index of ``rollout``, from the groups' prefixes
    (``Prefix.turns`` splits a prefix into its decisions)."""
    out: dict[int, list[Generated]] = {}
    k = 0
    for g in groups:
        for p in getattr(g, "prefixes", None) or []:
            at, turns = 0, []
            for n in p.turns:
                turns.append((list(p.ids[at : at + n]), list(p.logprobs[at : at + n])))
                at += n
            out[k + p.sample_idx] = turns
        k += g.n
    return out


class Cut(EchoError):
    """The worker was preempted between two decisions: the episodes stop here. ``decisions``
    (set by ``drive``): per episode, the decisions made so far, which go back as prefixes
    with their turn lengths and are replayed by the worker that continues the group
    (docs/preemption.md)."""

    default_reason = "preempted"

    # per episode index, the decisions made before the cut
    decisions: dict[int, list[Generated]] = {}


def backend_generate_fn(
    backend: GroupBackend,
    max_new_tokens: int,
    temperature: float,
    seed: int,
    stop: threading.Event | None = None,
    turn_cache: bool = False,
) -> GenerateFn:
    """A ``generate`` over a worker ``Backend`` (its ``generate`` takes wire groups): each
    prompt becomes a one-sample group; the seed advances every call so decisions differ.
    ``stop`` (an event) set: the next call raises ``Cut`` instead of generating.
    ``turn_cache`` (``worker.turn_cache``) and a backend that keeps one (``new_turn_cache``
    and ``generate_turn``: the transformers backend's): each call reads only what is new to
    each episode since the previous one, with the same samples and log-probs."""
    return _BackendGenerate(backend, max_new_tokens, temperature, seed, stop, turn_cache)


class _BackendGenerate:
    """``backend_generate_fn``'s ``generate``: called with a round's prompts; it carries its
    token budget (``max_new_tokens``, which adapters read) and ``is_cut`` (``drive`` marks an
    episode cut when one of its decisions was)."""

    def __init__(
        self,
        backend: GroupBackend,
        max_new_tokens: int,
        temperature: float,
        seed: int,
        stop: threading.Event | None,
        turn_cache: bool,
    ) -> None:
        self.backend, self.max_new_tokens, self.temperature = backend, max_new_tokens, temperature
        self.seed, self.stop = seed, stop
        self.calls = itertools.count()
        new_turn_cache = getattr(backend, "new_turn_cache", None) if turn_cache else None
        self.turns = new_turn_cache() if new_turn_cache is not None else None
        # (ids, log-probs per prompt; whether cut): the backend's one call per round of decisions
        self.generate_turn: Callable[..., tuple[list[Generated], bool]] | None = (
            getattr(backend, "generate_turn", None) if self.turns is not None else None
        )
        self.is_cut = decision_cut(backend, max_new_tokens)
        from echo_rl.core.wire import Group  # the wire's pydantic models load with the worker

        self.group = Group

    def __call__(self, prompts: list[list[int]]) -> list[Generated]:
        if self.stop is not None and self.stop.is_set():
            raise Cut()
        k = next(self.calls)
        if self.generate_turn is not None:
            call_seed = derived_seed(self.seed, k)
            out = self.generate_turn(
                prompts, self.max_new_tokens, self.temperature, call_seed, self.turns
            )
            return out[0]
        groups = [
            self.group(group_id=f"ep{k}.{i}", prompt_ids=p, n=1, seed=derived_seed(self.seed, k))
            for i, p in enumerate(prompts)
        ]
        samples = self.backend.generate(groups, self.max_new_tokens, self.temperature)
        return [(s[0].completion_ids, s[0].logprobs) for s in samples]


def decision_cut(backend: GroupBackend, max_new_tokens: int) -> Callable[[list[int]], bool]:
    """Whether a decision was cut short: it stopped at ``max_new_tokens`` without
    end-of-sequence, though it could have ended (the tokenizer has one and the adapter's answer
    set, if any, holds it: an answer set without it makes every decision one token long by
    design, echo_rl/data/answers.py)."""
    eos = getattr(getattr(backend, "tokenizer", None), "eos_token_id", None)
    answers = getattr(backend, "answer_tokens", None)
    if eos is None or (answers is not None and eos not in answers):
        return lambda ids: False
    return lambda ids: bool(ids) and len(ids) >= max_new_tokens and ids[-1] != eos


def episode_cut(sample: EpisodeSample, adapter: Adapter) -> bool:
    """An episode stopped at a limit (the step row's completions_cut): marked ``cut`` (by the
    adapter, or by ``drive`` for a decision cut short), or its transcript fills the adapter's
    ``max_completion_tokens``."""
    bound = int(getattr(adapter, "max_completion_tokens", 0) or 0)
    return bool(getattr(sample, "cut", False)) or 0 < bound <= len(sample.completion_ids)


class EpisodeAdapter(Adapter):
    """Base class for multi-turn adapters: implement ``prompts`` and ``episode`` (not
    ``reward``). Workers call ``rollout``; the inherited ``materialise`` already trains only
    the tokens an episode's ``loss_mask`` marks, so a multi-turn adapter need not override it.
    Every generation of an episode is one decision of at most ``worker.max_new_tokens`` tokens;
    the whole transcript is bounded by ``max_completion_tokens``."""

    # marks the adapter as multi-turn for workers, the learner, eval and sample
    multi_turn: bool = True
    # False here (True in Adapter): an episode's reward needs its environment replayed, which
    # the learner does not do yet; rewards are bounded and groups audited instead
    recomputes_rewards: bool = False
    # bound on an episode's completion_ids (the transcript after the prompt, every decision and
    # environment token); the learner admits records and prefixes up to
    # max(worker.max_new_tokens, max_completion_tokens) tokens. worker.max_new_tokens bounds
    # each decision (one generate call)
    max_completion_tokens: int = 4096
    # "group": advantages within each group; "batch": across the whole batch
    group_by: str = "group"

    @abstractmethod
    def episode(self, task: dict[str, Any], seed: int, sample_idx: int) -> Episode:
        """One episode: a generator that yields the whole context the policy continues (the
        group's ``prompt_ids`` followed by the transcript so far, not only the new environment
        tokens), receives ``(generated_ids, logprobs)`` for that decision, and returns an
        ``EpisodeSample`` whose ``completion_ids`` are exactly the context after the prompt
        (each decision's ids as received, in place). ``seed`` is the group's (the same for
        every sample of a group); ``sample_idx`` tells its samples apart (0 .. n-1). Given
        ``(task, seed, sample_idx)`` and the decisions received, the episode is deterministic:
        draw randomness from ``random.Random`` seeded with them, never global state, since a
        preempted episode is replayed from its decisions by another worker."""

    def rollout(
        self, groups: Sequence[wire.Group], generate: GenerateFn
    ) -> list[list[EpisodeSample]]:
        """``group.n`` episodes for every group (the worker's ``wire.Group``s: their ``task``,
        ``n``, ``seed`` and ``prefixes`` are read), decisions batched across all of them."""
        eps = [self.episode(g.task, g.seed, i) for g in groups for i in range(g.n)]
        flat = drive(eps, generate, replay_of(groups))
        out, k = [], 0
        for g in groups:
            out.append(flat[k : k + g.n])
            k += g.n
        return out

    def reward(
        self, task: dict[str, Any], completion_ids: list[int], completion_text: str
    ) -> float:
        """Not used: an episode returns its reward in ``EpisodeSample.reward``; raises."""
        raise AdapterError(
            f"{type(self).__name__} is a multi-turn adapter: workers must call "
            f"rollout(groups, generate), not reward() (see echo_rl/data/episodes.py)"
        )

    def advantages(
        self, groups: Sequence[Sequence[Record]], adv_eps: float, scale_rewards: str = "group"
    ) -> list[float]:
        """One advantage per record: rewards normalised within each group, or across the
        batch when ``group_by == "batch"``."""
        rewards = [[r.reward for r in g] for g in groups]
        if self.group_by == "batch":  # the whole batch is one group
            rewards = [[x for g in rewards for x in g]]
        return batch_advantages(rewards, adv_eps, scale_rewards)

    def materialise(
        self,
        groups: Sequence[Sequence[Record]],
        adv_eps: float = 1e-4,
        scale_rewards: str = "group",
    ) -> LearnerBatch:
        """``Adapter.materialise`` with ``advantages``: the records' ``loss_mask`` puts the
        sequence advantage on the policy's tokens only (environment tokens get none)."""
        return materialise_masked(
            groups,
            self.advantages(groups, adv_eps, scale_rewards),
            self.tokenizer.pad_token_id or 0,
        )


# One implementation for single- and multi-turn records (the mask decides what is trained).
materialise_masked = materialise_records


def token_advantages(batch: LearnerBatch) -> Tensor:
    """Appendix D eq. 22: the sequence advantage broadcast to the trained (assistant) tokens,
    zero elsewhere; shape [B, L-1]. (The loss does this itself; this is for inspection.)"""
    return batch.advantages.unsqueeze(-1) * batch.loss_mask
