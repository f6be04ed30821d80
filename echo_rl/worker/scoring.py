"""Generate and score one rollout's groups (echo_rl/worker/generation.py runs it off the loop).

Cut short by a preemption or the owner (``cut``): every group's samples come back unscored,
to be handed back as prefixes (docs/preemption.md); a multi-turn rollout is cut between two
decisions, and its episodes' decisions so far become the prefixes, replayed in the
environment by the worker that continues. Cut in its tail (``worker.tail_cut``): the groups
still running come back unscored, to be carried into the next rollout (echo_rl/worker/tail.py).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from echo_rl.core import wire
from echo_rl.data.episodes import Cut, EpisodeAdapter, backend_generate_fn
from echo_rl.worker.backends import Backend, Sample
from echo_rl.worker.records import Completion, cut_episodes
from echo_rl.worker.session import WorkerError

if TYPE_CHECKING:
    from echo_rl.data.adapter import Adapter

Scored = list[list[tuple[Sample, float]]]  # per group: its samples and their rewards


def generate_and_score(
    backend: Backend,
    adapter: Adapter,
    wv: dict[str, Any],
    cut: threading.Event,
    groups: list[wire.Group],
) -> Scored:
    """Samples and rewards per group, under ``wv`` (the run's ``[worker]`` view)."""
    if isinstance(adapter, EpisodeAdapter):
        # Episodes: one generation per decision, played by the adapter's environment.

        gen = backend_generate_fn(
            backend,
            wv["max_new_tokens"],
            wv["temperature"],
            groups[0].seed,
            stop=cut,
            # the learner's view is a stranger's word: anything but true is off
            turn_cache=wv.get("turn_cache") is True,
        )
        try:
            out: Any = adapter.rollout(groups, gen)
        except Cut as c:
            return cut_episodes(groups, c.decisions)
        check_episode_lengths(adapter, out, wv["max_new_tokens"])
        return [[(s, float(s.reward)) for s in samples] for samples in out]
    tail = tail_share(wv.get("tail_cut"))
    out = backend.generate(
        groups,
        wv["max_new_tokens"],
        wv["temperature"],
        stop=cut,
        **({"tail": tail} if tail else {}),  # test doubles predate it
    )
    if cut.is_set() and any(not s.finished for g in out for s in g):
        return [[(s, 0.0) for s in g] for g in out]  # handed back: the continuer scores
    return [
        [(s, 0.0) for s in samples]  # cut in its tail: scored once continued
        if any(not s.finished for s in samples)
        else _scored(adapter, backend.tokenizer, g, samples)
        for g, samples in zip(groups, out)
    ]


class AdapterFault(WorkerError):
    """The adapter produced what the learner refuses whoever delivers it: its own limit, not
    this worker's lie. The worker stops, saying so, rather than deliver records that would
    count against it (issue 56: over-long episodes had both honest workers banned)."""

    default_reason = "adapter_fault"


def check_episode_lengths(
    adapter: Adapter, out: Iterable[Iterable[Completion]], max_new_tokens: int
) -> None:
    """Every episode within what the learner admits: ``max(worker.max_new_tokens,
    max_completion_tokens)`` tokens (echo_rl/learner/main.py builds its limits the same way)."""
    bound = getattr(adapter, "max_completion_tokens", 0)
    limit = max(int(max_new_tokens), int(bound))
    longest = max((len(s.completion_ids) for samples in out for s in samples), default=0)
    if longest > limit:
        name = getattr(adapter, "name", type(adapter).__name__)
        raise AdapterFault(
            f"adapter {name}: an episode of {longest} tokens is longer than its "
            f"max_completion_tokens = {bound} (the learner refuses records past "
            f"max(worker.max_new_tokens, max_completion_tokens) = {limit} tokens from anyone). "
            f"This is the adapter's limit, not this worker's fault: raise "
            f"{type(adapter).__name__}.max_completion_tokens or shorten its episodes (fewer "
            f"turns); this worker stops rather than deliver records the learner would refuse"
        )


def tail_share(value: object) -> float:
    """The learner's ``worker.tail_cut`` as a share in [0, 1); anything else (a string, a
    bool, NaN, out of range: a learner is a stranger too) is the cut off, not an error that
    would end this run's rollouts."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return 0.0
    return float(value) if 0.0 < value < 1.0 else 0.0


def _scored(
    adapter: Adapter, tok: Any, g: wire.Group, samples: list[Sample]
) -> list[tuple[Sample, float]]:
    return [
        (
            s,
            float(
                adapter.reward(
                    g.task, s.completion_ids, tok.decode(s.completion_ids, skip_special_tokens=True)
                )
            ),
        )
        for s in samples
    ]
