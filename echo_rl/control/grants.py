"""The grant journal: work leases survive a learner crash (docs/learner.md, "Restart").

A worker that generated a group under a lease and delivers it after the learner restarted
must not be refused for the restart alone: that throws away the volunteer's work, and its
probation with it (issue 39). So every lease the ``WorkQueue`` hands out is appended to
``grants.jsonl`` in the run folder, one JSON line per grant: the group (id, prompt, size,
seed, task; prefixes are left out, a restored group is generated from its start), the worker
id it was leased to and the key that worker proved at join. ``--resume`` reads it back
(``load``): every lease still open comes back bound to the same key, with a fresh lease
clock, so the holder's resend is admitted when it is within the staleness bound. A lease the
journal did not keep is refused with ``learner_restarted``, which the worker shows in words.

Durability: lines are written and flushed (in the OS's hands) but not fsynced: a killed
learner process loses none of them, a machine crash may lose the last few, whose deliveries
are then refused as ``learner_restarted``. Nothing acknowledged depends on this file (the
buffer's write-ahead log keeps that promise); it only saves work in flight. Bounded: when the
file holds more than ``COMPACT_FACTOR`` times the open leases (and at least ``MIN_LINES``), it
is rewritten with the open leases only (atomic rename).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import ValidationError

from echo_rl.core import wire

if TYPE_CHECKING:
    from echo_rl.control.work import Issued

log = logging.getLogger("echo.grants")

COMPACT_FACTOR = 4
MIN_LINES = 256


@dataclass(frozen=True)
class Lease:
    """One journal line: a group, the worker it is leased to and that worker's key."""

    group: wire.Group
    worker_id: str
    key: str

    def line(self) -> str:
        g = self.group.model_dump(exclude={"prefixes"})
        return json.dumps({"group": g, "worker_id": self.worker_id, "key": self.key}) + "\n"

    @classmethod
    def parse(cls, line: str) -> Lease:
        """One line; ValueError (with the reason) for anything else."""
        try:
            obj = json.loads(line)
            if not isinstance(obj, dict) or set(obj) != {"group", "worker_id", "key"}:
                raise ValueError("expected the keys group, worker_id, key")
            if not isinstance(obj["worker_id"], str) or not isinstance(obj["key"], str):
                raise ValueError("worker_id and key are strings")
            return cls(wire.Group.model_validate(obj["group"]), obj["worker_id"], obj["key"])
        except (json.JSONDecodeError, ValidationError) as err:
            raise ValueError(str(err)[:200]) from None


class GrantJournal:
    def __init__(self, path: Path):
        self.path = path
        self._file = path.open("a")
        self.lines = 0
        self.failed = 0  # writes that failed (the lease holds; only its restart durability is lost)

    def write(self, lease: Lease) -> None:
        try:
            self._file.write(lease.line())
            self._file.flush()
            self.lines += 1
        except OSError as exc:
            self.failed += 1
            if self.failed == 1 or self.failed % 1000 == 0:
                log.error(
                    "grant journal %s: write failed (%s): leases granted now will not "
                    "survive a learner restart (%d failed so far)",
                    self.path,
                    exc,
                    self.failed,
                )

    def oversize(self, open_count: int) -> bool:
        return self.lines > max(MIN_LINES, COMPACT_FACTOR * open_count)

    def compact(self, open_leases: list[Lease]) -> None:
        """Rewrite the journal with ``open_leases`` only (atomic rename)."""
        tmp = self.path.with_suffix(".tmp")
        try:
            tmp.write_text("".join(lease.line() for lease in open_leases))
            self._file.close()
            os.replace(tmp, self.path)
        except OSError as exc:
            log.error("grant journal %s: compaction failed (%s); appending on", self.path, exc)
        finally:
            if self._file.closed:
                self._file = self.path.open("a")
        self.lines = len(open_leases)

    def close(self) -> None:
        self._file.close()


def load(path: Path) -> tuple[dict[str, Lease], int]:
    """The leases of an earlier instance, by group id (the last line of each group wins: a
    lease moved to another worker), and how many lines could not be read (a torn last line
    after a crash, or damage): those are skipped, never fatal."""
    leases: dict[str, Lease] = {}
    bad = 0
    if not path.exists():
        return leases, bad
    for line in path.read_text(errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            lease = Lease.parse(line)
        except ValueError:
            bad += 1
            continue
        leases[lease.group.group_id] = lease
    return leases, bad


def open_leases(leases: dict[str, Lease], done: set[str]) -> list[Lease]:
    """The restored leases whose group is not finished (trained, or whole in the buffer)."""
    return [lease for gid, lease in leases.items() if gid not in done]


def open_journal(run_dir: Path, issued: Iterable[Issued]) -> GrantJournal:
    """The run's grant journal (``grants.jsonl``), compacted to the leases open now (``issued``:
    the work queue's, restored ones included)."""
    journal = GrantJournal(run_dir / "grants.jsonl")
    journal.compact([Lease(it.group, it.worker_id, it.key) for it in issued])
    return journal
