"""The data plane's rules, once: admission, eviction, take and grant sizes.

The learner (``echo_rl/data/buffer.py``, ``echo_rl/control/work.py``, ``echo_rl/control/deliveries.py``) and the
simulator (``echo_rl/provisioning/sim/``) both call these, so a simulated run applies exactly the rules
of a real one (docs/simulator.md, "One set of rules"). Nothing here does I/O, takes a lock or
reads a clock; the install quantile, the fourth shared rule, is
``echo_rl.broadcast.coordinator.quantile_rank``.

* **Admission.** A trajectory of version ``u`` is admissible at learner version ``v`` iff
  ``v - S <= u <= v``. A future version is rejected; an older one is dropped as stale.
* **Eviction.** Whatever falls below ``v - S`` while it waits is dropped when the version moves
  and again when the trainer asks for a batch.
* **Take.** The trainer takes the oldest whole groups first (arrival order); a batch's staleness
  is the version of its oldest group.
* **Grants.** At most ``max_outstanding`` groups are out (granted, not yet whole) plus waiting in
  the buffer. One grant carries at most the worker's ask, its fair share of that bound
  (``ceil(max_outstanding / active workers)``), and what room is left; one group while the
  worker is on probation (the provisioner has not measured it yet).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

OK, FUTURE, STALE = "ok", "future_version", "stale"


def derived_seed(seed: int, k: int) -> int:
    """The ``k``-th seed drawn from ``seed``: a group's among a run's (``echo-rl eval``'s
    groups, the test kit's), a call's among an episode's decisions. Stays below 2**62 (a
    wire integer)."""
    return (seed * 1_000_003 + k) % (1 << 62)


T = TypeVar("T")


def admission(u: int, version: int, staleness: int) -> str:
    if u > version:
        return FUTURE
    if u < version - staleness:
        return STALE
    return OK


def is_stale(u: int, version: int, staleness: int) -> bool:
    return u < version - staleness


def room(max_outstanding: int, in_flight: int, buffered: int) -> int:
    """Groups that may still be granted: the outstanding bound less what is out and waiting."""
    return max(0, max_outstanding - in_flight - buffered)


def fair_share(max_outstanding: int, active_workers: int) -> int:
    return max(1, math.ceil(max_outstanding / max(1, active_workers)))


def grant_size(
    ask: int,
    max_outstanding: int,
    in_flight: int,
    buffered: int,
    active_workers: int,
    probation: bool = False,
) -> int:
    """How many new groups one request gets. A worker on probation (not yet measured) gets one
    group at a time: its first delivery then comes after one group's generation, within the
    probation window even on a slow GPU, and a joiner that never delivers holds one group."""
    return min(
        ask,
        1 if probation else fair_share(max_outstanding, active_workers),
        room(max_outstanding, in_flight, buffered),
    )


@dataclass(slots=True)
class _Entry(Generic[T]):
    """One run of ``count`` groups of one version; ``item`` is the group itself (learner) or
    None (simulator counts). Mutable: merging and partial takes change ``count`` in place."""

    version: int
    count: int
    item: T | None


class ReadyQueue(Generic[T]):
    """Whole groups waiting for the trainer, in arrival order, each tagged with its version.

    The learner pushes one entry per group with the group as the item; the simulator pushes
    counts without items, and consecutive entries of one version merge (a fleet of 10,000
    workers then costs one entry per version, not per group).
    """

    def __init__(self) -> None:
        self._q: deque[_Entry[T]] = deque()
        self.count = 0

    def __len__(self) -> int:
        return self.count

    def push(self, version: int, item: T | None = None, count: int = 1) -> None:
        if item is None and self._q and self._q[-1].version == version and self._q[-1].item is None:
            self._q[-1].count += count
        else:
            self._q.append(_Entry(version, count, item))
        self.count += count

    def oldest_version(self) -> int | None:
        return min((e.version for e in self._q), default=None)

    def evict(self, version: int, staleness: int) -> tuple[int, list[T]]:
        """Drop every entry below ``version - staleness``: (groups dropped, their items)."""
        if not self._q or all(not is_stale(e.version, version, staleness) for e in self._q):
            return 0, []
        keep: deque[_Entry[T]] = deque()
        dropped, items = 0, []
        for e in self._q:
            if is_stale(e.version, version, staleness):
                dropped += e.count
                if e.item is not None:
                    items.append(e.item)
            else:
                keep.append(e)
        self._q = keep
        self.count -= dropped
        return dropped, items

    def take(self, k: int, version: int) -> tuple[int, list[T]]:
        """The ``k`` oldest groups (the caller checked ``len(self) >= k``): (the version of the
        oldest taken, or ``version`` if none, and their items)."""
        oldest, items = version, []
        while k:
            e = self._q[0]
            oldest = min(oldest, e.version)
            n = min(k, e.count)
            if n == e.count:
                self._q.popleft()
                if e.item is not None:
                    items.append(e.item)
            else:
                if e.item is not None:
                    raise ValueError("an entry with an item is one group: it cannot be split")
                e.count -= n
            self.count -= n
            k -= n
        return oldest, items

    def remove(self, pred: Callable[[T], bool]) -> list[T]:
        """Take out the items ``pred`` selects (a quarantined worker's groups)."""
        gone = [e for e in self._q if e.item is not None and pred(e.item)]
        if gone:
            self._q = deque(e for e in self._q if not (e.item is not None and pred(e.item)))
            self.count -= sum(e.count for e in gone)
        return [e.item for e in gone if e.item is not None]

    def items(self) -> Iterator[T]:
        return (e.item for e in self._q if e.item is not None)
