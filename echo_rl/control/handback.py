"""Checks on a handback: the prefixes a preempted or yielding worker gives back
(docs/preemption.md).

A prefix is kept only if it could have been a real start of the sample: the group is leased to
the sender and handed back in the same message, the sample index is in the group, tokens are
in the vocabulary and at most ``worker.max_new_tokens`` of them, log-probs are finite and at
most 0, versions are runs of snapshots the learner has published and the
oldest is still admissible (a stale prefix would only make a stale record), a multi-turn prefix
comes with its decisions' lengths (``turns``, replayed by the next worker), a sample that
was already continued once keeps its earlier prefix as its start, and the sender's own tokens
(those after an earlier prefix) all name one version, the snapshot its rollout used. Anything else is refused
with a counted reason and the sample is generated again from scratch: a refused prefix costs
tokens, never correctness. The tokens of a kept prefix are the sender's; the worker that
continues the sample must deliver them unchanged (``echo_rl.control.intake``), and an audit of the
continued group checks only the continuing worker's own tokens (``echo_rl.control.auditor``); the
sender's own tokens are recomputed before anyone continues them (``echo_rl.control.handbacks``).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

from echo_rl.core import wire
from echo_rl.data import rules
from echo_rl.data.records import LOGPROB_TOLERANCE, MAX_VERSION_RUNS


@dataclass(frozen=True)
class PrefixLimits:
    vocab_size: int
    max_new_tokens: int
    min_logprob: float
    staleness: int
    multi_turn: bool = False  # prefixes must carry their decisions' lengths (``turns``)


def expand(runs: list[list[int]] | list[tuple[int, int]]) -> list[int]:
    """``[[3, 2], [5, 1]]`` -> ``[3, 3, 5]``."""
    return [v for v, c in runs for _ in range(c)]


def _problem(p: wire.Prefix, group: wire.Group, version: int, lim: PrefixLimits) -> str:
    n = len(p.ids)
    if p.sample_idx >= group.n:
        return "bad_sample_idx"
    if len(p.logprobs) != n or n > lim.max_new_tokens:
        return "bad_length"
    if any(not 0 <= t < lim.vocab_size for t in p.ids):
        return "out_of_vocab"
    if any(
        not (math.isfinite(x) and lim.min_logprob <= x <= LOGPROB_TOLERANCE) for x in p.logprobs
    ):
        return "bad_logprob"
    vs = [v for v, _ in p.versions]
    if (
        len(p.versions) > MAX_VERSION_RUNS
        or any(c < 1 for _, c in p.versions)
        or sum(c for _, c in p.versions) != n
        or any(b == a for a, b in zip(vs, vs[1:]))
    ):
        return "bad_versions"
    if p.turns and (any(t < 1 for t in p.turns) or sum(p.turns) != n):
        return "bad_turns"
    if lim.multi_turn != bool(p.turns):  # episodes replay decisions; a stretch of tokens not
        return "bad_turns"
    if max(vs) > version:
        return "future_version"
    if rules.admission(min(vs), version, lim.staleness) != rules.OK:
        return "stale"
    old = next((q for q in group.prefixes if q.sample_idx == p.sample_idx), None)
    if len(set(expand(p.versions)[len(old.ids) if old else 0 :])) > 1:
        return "bad_versions"  # the sender's own tokens came from one snapshot (its rollout's)
    if old is not None and (
        p.ids[: len(old.ids)] != old.ids
        or p.turns[: len(old.turns)] != old.turns
        or p.logprobs[: len(old.logprobs)] != old.logprobs
        or expand(p.versions)[: len(old.ids)] != expand(old.versions)
    ):
        return "prefix_mismatch"
    return ""


def check_prefixes(
    group: wire.Group,
    prefixes: list[wire.Prefix],
    version: int,
    lim: PrefixLimits,
    refused: Counter[str],
) -> list[wire.Prefix]:
    """The prefixes to keep for ``group`` (at most one per sample; earlier ones carried over
    where no new one came); refusals are counted in ``refused``."""
    kept: dict[int, wire.Prefix] = {p.sample_idx: p for p in group.prefixes}
    seen: set[int] = set()
    for p in prefixes:
        why = "duplicate_sample" if p.sample_idx in seen else _problem(p, group, version, lim)
        if why:
            refused[why] += 1
            continue
        seen.add(p.sample_idx)
        kept[p.sample_idx] = p
    return [kept[i] for i in sorted(kept)]
