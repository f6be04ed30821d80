"""Hands prompt groups out to workers as leases, and takes them back when a worker goes.

A group is issued with a lease (worker, deadline). It is fulfilled when the buffer holds all
of its samples. A lease that expires, or whose worker leaves or stops heart-beating, puts the
group back at the head of the queue so the next request gets it: a worker killed mid-group
costs time, never the run. A grant lost on the way (the link dropped the reply) is noticed at
the worker's next request, which lists the groups it holds undelivered: its other open leases
are handed to it again at once.

Bounded: at most ``max_outstanding`` groups are in flight (issued and not yet whole) plus
waiting in the buffer; past that, requests get an empty grant with a retry hint. This keeps the
fleet from generating data that would go stale before the learner can use it.
Grants are bound to the worker they were leased to (``holder``; ``echo_rl.control.intake`` refuses a
delivery from anyone else) and the sampling seed of a group is derived from a learner secret,
so a worker can neither pick its seeds nor predict another group's. Per worker, groups granted,
returned whole, taken back (lease expired or worker gone) and handed back (preempted or
yielded) are counted: a worker that keeps or returns the groups it does not like shows up as
granted far above returned (``echo_rl.control.handbacks`` bounds and judges hand-backs). A handed-back
group may be *held* off the queue while its prefixes are checked (``hand_back(..., hold_until)``):
``release`` or the hold's deadline puts it back at the head of the queue.
Leases are written to the grant journal (``echo_rl.control.grants``) when it is set, so that work in
flight survives a learner restart: ``restore_leases`` brings them back bound to the same key.
Only the control-plane thread touches this object.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import os
import time
from collections import Counter, deque
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass

from echo_rl.control.affinity import Affinity
from echo_rl.control.grants import GrantJournal, Lease
from echo_rl.core import wire
from echo_rl.core.jsontypes import JsonObject
from echo_rl.data import rules
from echo_rl.data.adapter import Prompt
from echo_rl.data.affinity import Picker


@dataclass
class Issued:
    group: wire.Group
    worker_id: str
    deadline: float
    key: str = ""  # the key the holder proved at join ("" : any session of that worker id)
    granted_at: float = 0.0  # when the current holder got it (staleness books, learner.staleness)
    handed_by: tuple[
        str, ...
    ] = ()  # workers that handed it back, in order (echo_rl.control.handbacks)


class WorkQueue:
    def __init__(
        self,
        prompts: Iterator[Prompt],
        *,
        group_size: int,
        max_outstanding: int,
        lease_timeout_s: float,
        prefix: str,
        secret: bytes = b"",
        clock: Callable[[], float] = time.monotonic,
        affinity: Affinity | None = None,
    ):
        # which prompt a grant takes: the adapter's order, or by affinity (echo_rl/control/affinity.py)
        # among its window of prompts
        self.affinity = affinity
        self.picker = (
            Picker(prompts, affinity.window, affinity.book)
            if affinity is not None
            else Picker(prompts)
        )
        self.group_size = group_size
        self.max_outstanding = max_outstanding
        self.lease_timeout_s = lease_timeout_s
        self._clock = clock
        self._ids = itertools.count()
        self._prefix = prefix
        self._secret = secret or os.urandom(32)  # the run folder keeps it (echo_rl.learner.main)
        self.issued: dict[str, Issued] = {}
        self._requeued: deque[str] = deque()
        self.reissued = 0
        self.granted: Counter[str] = Counter()  # worker id -> groups leased to it
        self.returned: Counter[str] = Counter()  # ... delivered whole by it
        self.taken_back: Counter[str] = Counter()  # ... lease expired or released
        self.handed_back: Counter[str] = Counter()  # ... given back by the holder (handback)
        self.held: dict[str, float] = {}  # group id -> until when it waits for a prefix check
        self.journal: GrantJournal | None = None  # echo_rl.control.grants; None: leases die with us
        self.restored: set[str] = set()  # groups whose lease came back from the journal

    def seed_of(self, group_id: str) -> int:
        """The group's sampling seed: HMAC of its id under the learner's secret (63 bits)."""
        return (
            int.from_bytes(
                hmac.new(self._secret, group_id.encode(), hashlib.sha256).digest()[:8], "big"
            )
            >> 1
        )

    def grant(
        self,
        worker_id: str,
        max_groups: int,
        buffered_groups: int,
        holding: Collection[str] = (),
        key: str = "",
        rank: float | None = None,
    ) -> list[wire.Group]:
        """Up to ``max_groups`` groups: first this worker's own leases whose grant was lost
        (open, and not among the groups it ``holding``s undelivered), then re-queued groups,
        then new ones while the outstanding bound allows. ``key``: the holder's proven key,
        kept with each lease (and in the journal). ``rank``: the worker's speed among the
        fleet's (0 slowest, 1 fastest; None unknown), for affinity routing."""
        now = self._clock()
        out = self._lost_grants(worker_id, set(holding), max_groups, now)
        while len(out) < max_groups:
            if self._requeued:
                gid = self._requeued.popleft()
                item = self.issued.get(gid)
                if item is None:
                    continue  # fulfilled meanwhile
                item.worker_id, item.deadline = worker_id, now + self.lease_timeout_s
                item.key, item.granted_at = key, now
                self.reissued += 1
                self.granted[worker_id] += 1
                self._journal(item)
                out.append(item.group)
                continue
            if not rules.room(self.max_outstanding, len(self.issued), buffered_groups):
                break
            n = next(self._ids)
            prompt = self.picker.take(rank)
            gid = f"{self._prefix}-{n}"
            group = wire.Group(
                group_id=gid,
                prompt_ids=prompt.prompt_ids,
                n=self.group_size,
                seed=self.seed_of(gid),
                task=prompt.task,
                max_new_tokens=prompt.max_new_tokens,
            )
            self.issued[gid] = Issued(group, worker_id, now + self.lease_timeout_s, key, now)
            self.granted[worker_id] += 1
            self._journal(self.issued[gid])
            out.append(group)
        return out

    def _journal(self, item: Issued) -> None:
        if self.journal is not None:
            self.journal.write(Lease(item.group, item.worker_id, item.key))
            if self.journal.oversize(len(self.issued)):
                self.journal.compact(
                    [Lease(it.group, it.worker_id, it.key) for it in self.issued.values()]
                )

    def restore_leases(self, leases: list[Lease]) -> None:
        """Leases of the instance before a restart (``echo_rl.control.grants.load``), bound to the
        same worker and key, each with a fresh lease clock: the holder may deliver what it
        generated, or it expires and goes to someone else."""
        now = self._clock()
        for lease in leases:
            gid = lease.group.group_id
            self.issued[gid] = Issued(
                lease.group, lease.worker_id, now + self.lease_timeout_s, lease.key
            )
            self.restored.add(gid)
        self._requeued = deque(g for g in self._requeued if g not in self.restored)

    def forget(self, group_ids: Collection[str]) -> None:
        """Groups finished before a restart (trained, or whole in the restored buffer)."""
        for gid in group_ids:
            self.issued.pop(gid, None)

    def past_instance(self, group_id: str) -> bool:
        """A group id of this run handed out by an earlier instance of the learner."""
        run = self._prefix.rsplit(".", 1)[0]
        return group_id.startswith(run + ".") and not group_id.startswith(self._prefix + "-")

    def holder_key(self, group_id: str) -> str:
        item = self.issued.get(group_id)
        return item.key if item else ""

    def _lost_grants(
        self, worker_id: str, holding: set[str], limit: int, now: float
    ) -> list[wire.Group]:
        lost = [
            it
            for gid, it in self.issued.items()
            if it.worker_id == worker_id and gid not in holding and it.deadline != float("inf")
        ]
        for it in lost[:limit]:
            it.deadline = now + self.lease_timeout_s
            self.reissued += 1
        return [it.group for it in lost[:limit]]

    def lookup(self, group_id: str) -> wire.Group | None:
        item = self.issued.get(group_id)
        return item.group if item else None

    def holder(self, group_id: str) -> str | None:
        """The worker the group is leased to now; None if it is not out."""
        item = self.issued.get(group_id)
        return item.worker_id if item else None

    def fulfilled(self, group_id: str) -> None:
        self.held.pop(group_id, None)
        item = self.issued.pop(group_id, None)
        if item is not None:
            self.returned[item.worker_id] += 1

    def requeue(self, group_id: str) -> None:
        if group_id in self.held:
            return  # waits for its prefix check (``release``, or the hold's deadline)
        if group_id in self.issued and group_id not in self._requeued:
            item = self.issued[group_id]
            if item.deadline != float("inf"):
                self.taken_back[item.worker_id] += 1
            item.deadline = float("inf")
            self._requeued.append(group_id)

    def hand_back(
        self, group_id: str, prefixes: list[wire.Prefix], hold_until: float | None = None
    ) -> None:
        """The holder gave the group back (preempted or yielded, docs/preemption.md): it goes
        to the head of the queue carrying ``prefixes``, so the next worker continues those
        samples instead of generating them again; with ``hold_until`` it is kept off the queue
        until ``release`` (its new prefixes are being checked, ``echo_rl.control.handbacks``) or that
        time. Counted as handed back, not as taken back: a handback is the worker doing the
        right thing, within the bounds ``echo_rl.control.handbacks`` sets."""
        item = self.issued.get(group_id)
        if item is None or item.deadline == float("inf"):
            return  # not out, or already given back
        self.handed_back[item.worker_id] += 1
        item.handed_by = (*item.handed_by, item.worker_id)[-8:]
        # nobody holds it now: a late delivery by the one that gave it back is not_your_group
        item.worker_id, item.key, item.deadline = "", "", float("inf")
        if hold_until is not None:
            self.held[group_id] = hold_until
            return
        self.release(group_id, prefixes)

    def release(self, group_id: str, prefixes: list[wire.Prefix]) -> None:
        """A group handed back goes to the head of the queue carrying ``prefixes``."""
        self.held.pop(group_id, None)
        item = self.issued.get(group_id)
        if item is None:
            return
        item.group = item.group.model_copy(update={"prefixes": prefixes})
        if group_id not in self._requeued:
            item.deadline = float("inf")
            self._requeued.appendleft(group_id)

    def held_past(self, now: float) -> list[str]:
        """Held groups whose prefix check did not come back in time."""
        return [g for g, until in self.held.items() if until <= now]

    def leased_to(self, group_id: str, worker_id: str) -> bool:
        """Out to this worker now (not given back, not waiting in the queue)."""
        item = self.issued.get(group_id)
        return item is not None and item.worker_id == worker_id and item.deadline != float("inf")

    def handed_by(self, group_id: str) -> tuple[str, ...]:
        item = self.issued.get(group_id)
        return item.handed_by if item else ()

    def granted_at(self, group_id: str) -> float | None:
        item = self.issued.get(group_id)
        return item.granted_at if item else None

    def drop_prefixes(self, group_id: str) -> None:
        """The group's continuation went stale: it is generated again from scratch."""
        item = self.issued.get(group_id)
        if item is not None and item.group.prefixes:
            item.group = item.group.model_copy(update={"prefixes": []})

    def prefix(self, group_id: str, sample_idx: int) -> wire.Prefix | None:
        group = self.lookup(group_id)
        if group is None:
            return None
        return next((p for p in group.prefixes if p.sample_idx == sample_idx), None)

    def release_worker(self, worker_id: str, key: str = "") -> int:
        """The worker's leases go back to the queue; with ``key``, only those bound to that
        key (a stranger that claimed a restored holder's id must not free its leases)."""
        gids = [
            g
            for g, it in self.issued.items()
            if it.worker_id == worker_id and (not key or not it.key or it.key == key)
        ]
        for gid in gids:
            self.requeue(gid)
        return len(gids)

    def expire(self) -> int:
        now = self._clock()
        gids = [g for g, it in self.issued.items() if it.deadline < now]
        for gid in gids:
            self.requeue(gid)
        return len(gids)

    def state(self) -> JsonObject:
        """Open leases and the id counter, for checkpoints (leases restart their clocks)."""
        return {
            "issued": [it.group.model_dump() for it in self.issued.values()],
            "reissued": self.reissued,
        }

    def restore(self, state: JsonObject) -> None:
        issued, reissued = state["issued"], state["reissued"]
        assert isinstance(issued, list) and isinstance(reissued, int)  # as ``state`` wrote them
        for g in issued:
            group = wire.Group.model_validate(g)
            self.issued[group.group_id] = Issued(group, "", float("inf"))
            self._requeued.append(group.group_id)  # whoever held it may be gone: hand out again
        self.reissued = reissued

    @property
    def in_flight(self) -> int:
        return len(self.issued)
