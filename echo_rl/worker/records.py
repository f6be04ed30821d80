"""What a generated sample becomes on the wire: per-token versions, prefixes of cut episodes.

Pure functions of samples and groups (no I/O, no worker state), shared by generation and the
hand-back of cut samples (docs/preemption.md).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, NotRequired, Protocol, TypedDict

from echo_rl.core import wire
from echo_rl.data.episodes import Generated, episode_cut
from echo_rl.data.records import MAX_STATS, episode_stats
from echo_rl.worker.backends import Sample

if TYPE_CHECKING:
    from echo_rl.data.adapter import Adapter

log = logging.getLogger("echo.worker")

# (adapter, info key) pairs already warned about: one warning per key, not one per episode
# (at most WARN_KEYS of them: an adapter that makes up names must not grow this without end)
_warned: set[tuple[str, str]] = set()
WARN_KEYS = 1024


class Completion(Protocol):
    """What a record is made of: a backend's ``Sample`` or an adapter's ``EpisodeSample``."""

    completion_ids: list[int]
    logprobs: list[float]


class VersionFields(TypedDict):
    """A record's ``version`` (its oldest token's) and, when its tokens' differ, ``versions``
    (``[version, count]`` runs)."""

    version: int
    versions: NotRequired[list[list[int]]]


class EpisodeFields(TypedDict):
    """A multi-turn record's shown-only fields (``episode_fields``)."""

    cut: bool
    stats: NotRequired[dict[str, float]]


def runs(s: Completion, version: int) -> list[list[int]]:
    """Per-token versions of a sample as ``[version, count]`` runs: the prefix's (another
    worker's tokens, for a continued sample), then this worker's own tokens."""
    out = [list(r) for r in getattr(s, "prefix_versions", [])]  # episodes have no prefix
    own = len(s.completion_ids) - getattr(s, "prefix_len", 0)
    if own > 0:
        if out and out[-1][0] == version:
            out[-1][1] += own
        else:
            out.append([version, own])
    return out


def versions(s: Completion, version: int) -> VersionFields:
    """The record's ``version`` (its oldest token's: the staleness rule judges that one) and,
    when they differ, the per-token ``versions``."""
    rs = runs(s, version)
    if len(rs) <= 1:
        return {"version": rs[0][0] if rs else version}
    return {"version": min(v for v, _ in rs), "versions": rs}


def prefix(g: wire.Group, i: int) -> wire.Prefix | None:
    return next((p for p in g.prefixes if p.sample_idx == i), None)


def cut_episodes(
    groups: list[wire.Group], decisions: dict[int, list[Generated]]
) -> list[list[tuple[Sample, float]]]:
    """Episodes cut between decisions, as unfinished samples: each one's decisions so far
    (replayed ones first, with the versions they came with), and their lengths."""
    out, k = [], 0
    for g in groups:
        row = []
        for i in range(g.n):
            made = decisions.get(k + i, [])
            old = prefix(g, i)
            s = Sample(
                [t for ids, _ in made for t in ids],
                [x for _, lps in made for x in lps],
                prefix_len=len(old.ids) if old else 0,
                prefix_versions=[list(r) for r in old.versions] if old else [],
                finished=False,
                turns=[len(ids) for ids, _ in made],
            )
            row.append((s, 0.0))
        out.append(row)
        k += g.n
    return out


def episode_versions(loss_mask: list[int], old: wire.Prefix | None, version: int) -> VersionFields:
    """A multi-turn record's versions: the policy's tokens (mask 1) in order are the
    decisions, replayed ones with the prefix's versions, then this worker's; an environment
    token takes the version of the decision before it (the first one's, before any)."""
    if old is None:
        return {"version": version}
    trained = [v for v, c in old.versions for _ in range(c)]
    per_token: list[int | None] = []
    k = 0
    for m in loss_mask:
        if m:
            per_token.append(trained[k] if k < len(trained) else version)
            k += 1
        else:
            per_token.append(None)
    first = next((v for v in per_token if v is not None), version)
    rs: list[list[int]] = []
    last = first
    for v in per_token:
        last = last if v is None else v
        if rs and rs[-1][0] == last:
            rs[-1][1] += 1
        else:
            rs.append([last, 1])
    return (
        {"version": min(v for v, _ in rs), "versions": rs} if len(rs) > 1 else {"version": rs[0][0]}
    )


def own_tokens(samples: list[list[tuple[Sample, float]]]) -> int:
    """Tokens this worker sampled itself (a continued sample's prefix is another's)."""
    return sum(len(s.completion_ids) - getattr(s, "prefix_len", 0) for g in samples for s, _ in g)


def record(
    g: wire.Group, i: int, s: Completion, reward: float, worker_id: str, gen_s: float, version: int
) -> dict[str, object]:
    """The wire record of sample ``i`` of group ``g`` (echo_rl/data/records.py)."""
    mask: list[int] | None = getattr(s, "loss_mask", None)  # an episode's
    return {
        "group_id": g.group_id,
        "sample_idx": i,
        "prompt_ids": g.prompt_ids,
        "completion_ids": s.completion_ids,
        "logprobs": s.logprobs,
        "reward": reward,
        "worker_id": worker_id,
        "gen_s": gen_s,
        **(episode_versions(mask, prefix(g, i), version) if mask else versions(s, version)),
        **({"loss_mask": mask} if mask is not None else {}),
    }


def episode_fields(s: Any, adapter: Adapter) -> EpisodeFields:
    """A multi-turn record's shown-only fields: ``cut`` (``echo_rl.data.episodes.episode_cut``)
    and ``stats``, the numbers of the episode's ``info`` that may travel. A number that may
    not (a name that is no short identifier, NaN or inf, past 1e15, past the 16th) stays here
    with one warning per key naming the adapter: it is the adapter's to fix, and a record the
    learner would refuse would count against this worker."""
    stats, dropped = episode_stats(getattr(s, "info", None))
    name = getattr(adapter, "name", "") or type(adapter).__name__
    new = [k for k in dropped if (name, k) not in _warned]
    if new and len(_warned) < WARN_KEYS:
        _warned.update((name, k) for k in new)
        log.warning(
            "adapter %s: EpisodeSample.info numbers %s stay on the worker: only finite numbers "
            "within +-1e15 under names [a-z][a-z0-9_]{0,31}, at most %d, reach the learner "
            '(docs/adapters.md, "Multi-turn adapters")',
            name,
            new,
            MAX_STATS,
        )
    fields: EpisodeFields = {"cut": episode_cut(s, adapter)}
    if stats:
        fields["stats"] = stats
    return fields
