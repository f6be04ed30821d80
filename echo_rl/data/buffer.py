"""Bounded-staleness replay buffer (docs/learner.md; the rules are ``echo_rl/data/rules.py``,
shared with the simulator).

Thread-safe: the learner server admits records from its thread, the trainer takes groups from
its own. Rules:
  * admissible iff ``version_now - S <= u <= version_now``; a future version is rejected, an
    old one is dropped and counted (``dropped_stale``), both at admission and when the trainer
    asks for a batch (data can go stale while it waits);
  * exactly-once: a (group id, sample index) already admitted, or of a group already complete,
    counts as a duplicate and is acknowledged without being stored again;
  * whole groups only: a group becomes available when all of its ``n`` samples are in; its
    version is the oldest of its samples;
  * bounded: at most ``capacity_groups`` partial plus ready groups. Overflow policy: records of
    a new group are rejected with reason ``buffer_full`` (counted, not acknowledged as stored).
    The learner never hands out more groups than the buffer holds, so only a sender that
    ignores its grants reaches this.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from echo_rl.data import rules
from echo_rl.data.records import Record

ACCEPTED, DUPLICATE, STALE, COMPLETED = "accepted", "duplicate", "stale", "completed"
# The rules that drop an admitted (acknowledged) record, as dropped.jsonl names them.
STALE_RULE, QUARANTINE_RULE = "stale", "quarantined"


class Depth(NamedTuple):
    """What the buffer holds now, in groups (the step row's ``ready_groups``, ``partial_groups``)."""

    ready_groups: int  # whole groups, admissible to a step
    partial_groups: int  # groups with some of their records


@dataclass
class BufferStats:
    admitted: int = 0
    duplicates: int = 0
    dropped_stale: int = 0
    rejected: Counter[str] = field(default_factory=Counter)


class ReplayBuffer:
    def __init__(
        self,
        staleness: int,
        capacity_groups: int,
        group_size: int,
        remember_groups: int = 1_000_000,
        on_drop: Callable[[list[Record], str], None] | None = None,
    ):
        self.staleness = staleness
        self.capacity = capacity_groups
        self.group_size = group_size
        self.version = 0
        self.stats = BufferStats()
        self._cond = threading.Condition()
        self._partial: dict[str, dict[int, Record]] = {}
        # Whole groups, oldest arrival first, each as (group id, its records).
        self._ready: rules.ReadyQueue[tuple[str, list[Record]]] = rules.ReadyQueue()
        # Ids of groups already complete (ready or trained on), for exactly-once admission of
        # late resends; bounded so a long run cannot grow it without limit.
        self._done: OrderedDict[str, None] = OrderedDict()
        self._remember = remember_groups
        # Audit hook: records dropped after admission, with the rule that dropped them
        # (STALE_RULE: evicted past the staleness bound; QUARANTINE_RULE: their worker was
        # quarantined), so every acknowledged record is accounted for (echo_rl.learner.run_audit).
        self.on_drop = on_drop

    # ------------------------------------------------------------------ admission (control)

    def stats_copy(self) -> BufferStats:
        """The counters as of now, for another thread (a checkpoint pickles them while the
        control loop admits)."""
        with self._cond:
            st = self.stats
            return BufferStats(st.admitted, st.duplicates, st.dropped_stale, Counter(st.rejected))

    def is_done(self, group_id: str) -> bool:
        with self._cond:
            return group_id in self._done

    def admit(self, rec: Record) -> str:
        """Returns ACCEPTED, COMPLETED (accepted and its group is now whole), DUPLICATE, STALE,
        or a rejection reason."""
        with self._cond:
            verdict = rules.admission(rec.version, self.version, self.staleness)
            if verdict == rules.FUTURE:
                return self._reject("future_version")
            if verdict == rules.STALE:
                self.stats.dropped_stale += 1
                return STALE
            if rec.group_id in self._done or rec.sample_idx in self._partial.get(rec.group_id, {}):
                self.stats.duplicates += 1
                return DUPLICATE
            if (
                rec.group_id not in self._partial
                and len(self._partial) + len(self._ready) >= self.capacity
            ):
                return self._reject("buffer_full")
            group = self._partial.setdefault(rec.group_id, {})
            group[rec.sample_idx] = rec
            self.stats.admitted += 1
            if len(group) < self.group_size:
                return ACCEPTED
            del self._partial[rec.group_id]
            self._push_ready(rec.group_id, [group[i] for i in range(self.group_size)])
            self._cond.notify_all()
            return COMPLETED

    def _push_ready(self, group_id: str, recs: list[Record]) -> None:
        self._ready.push(min(r.version for r in recs), (group_id, recs))
        self._mark_done(group_id)

    def _reject(self, reason: str) -> str:
        self.stats.rejected[reason] += 1
        return reason

    def _mark_done(self, group_id: str) -> None:
        self._done[group_id] = None
        while len(self._done) > self._remember:
            self._done.popitem(last=False)

    # ------------------------------------------------------------------ consumption (trainer)

    def set_version(self, version: int) -> None:
        with self._cond:
            self.version = version
            self._evict_stale()

    def _evict_stale(self) -> None:
        _, groups = self._ready.evict(self.version, self.staleness)
        dropped = [r for _, recs in groups for r in recs]
        dropped += [
            r
            for g, recs in list(self._partial.items())
            if rules.is_stale(min(r.version for r in recs.values()), self.version, self.staleness)
            for r in self._partial.pop(g).values()
        ]
        self.stats.dropped_stale += len(dropped)
        if dropped and self.on_drop is not None:
            self.on_drop(dropped, STALE_RULE)

    def take(self, k: int, timeout: float) -> list[list[Record]] | None:
        """The ``k`` oldest admissible whole groups, or None if they do not arrive in time."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                self._evict_stale()
                if len(self._ready) >= k:
                    return [recs for _, recs in self._ready.take(k, self.version)[1]]
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)

    def remove_worker(self, worker_id: str) -> list[Record]:
        """Take out every group holding a record of ``worker_id`` (it was quarantined): its
        records go to ``on_drop`` (the audit trail) and are counted as ``dropped_quarantined``."""
        with self._cond:
            groups = self._ready.remove(lambda item: any(r.worker_id == worker_id for r in item[1]))
            dropped = [r for _, recs in groups for r in recs]
            gone = [
                g
                for g, recs in self._partial.items()
                if any(r.worker_id == worker_id for r in recs.values())
            ]
            dropped += [r for g in gone for r in self._partial.pop(g).values()]
            self.stats.rejected["dropped_quarantined"] += len(dropped)
        if dropped and self.on_drop is not None:
            self.on_drop(dropped, QUARANTINE_RULE)
        return dropped

    def restore(self, records: list[Record], done_groups: set[str]) -> None:
        """Refill from the write-ahead log after a restart (see ``echo_rl.data.durable``)."""
        with self._cond:
            for gid in done_groups:
                self._mark_done(gid)
            for rec in records:
                self._partial.setdefault(rec.group_id, {})[rec.sample_idx] = rec
            for gid in [g for g, recs in self._partial.items() if len(recs) == self.group_size]:
                recs = self._partial.pop(gid)
                self._push_ready(gid, [recs[i] for i in range(self.group_size)])
            self._cond.notify_all()

    def contents(self) -> list[Record]:
        """Every record held (ready and partial), for compacting the write-ahead log."""
        with self._cond:
            return [r for _, g in self._ready.items() for r in g] + [
                r for g in self._partial.values() for r in g.values()
            ]

    # ------------------------------------------------------------------ metrics

    def depth(self) -> Depth:
        with self._cond:
            return Depth(len(self._ready), len(self._partial))
