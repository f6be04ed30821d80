"""Strikes and quarantine: what happens to a worker whose reports fail a check.

Every check the learner makes of a delivery (a reward it recomputed, a group that came back
whole, an audit of log-probs and sampling) is written to ``<run>/security/audits.jsonl``, one
line each, ok or not. A failed check is a strike against the worker; at
``security.strikes`` strikes it is quarantined: a line in ``<run>/security/quarantine.jsonl``,
its key banned (its next message is refused and it stops), its unconsumed records taken out
of the buffer, its leases handed out again. A resumed learner reads the quarantine file and
sets aside what those workers had buffered.

False alarms: a check with a false-alarm probability of at most ``a`` per honest audit, and
``k`` strikes needed, quarantines an honest worker audited ``m`` times with probability at most
``C(m, k) a^k`` (union bound). Reward recomputation and whole groups are deterministic (an
honest worker never fails them); the audit's bounds are in ``echo_rl.control.auditor``.

Reputation decides, its caller acts: ``record`` and ``quarantine`` return the ``Quarantine``
they sentenced (None otherwise), and the caller bans the key, empties the buffer of it and hands
its leases out again (``echo_rl.control.deliveries``). Only the control-plane thread calls this
object.
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import msgpack

from echo_rl.core.jsontypes import JsonObject
from echo_rl.core.metrics import finite_or_null
from echo_rl.data.durable import SetAside
from echo_rl.data.records import Record

log = logging.getLogger("echo.reputation")


@dataclass(frozen=True)
class Verdict:
    worker_id: str
    key: str
    group_id: str
    version: int
    check: str  # "reward", "whole_group", "logprob", "sampling"
    ok: bool
    stats: dict[str, Any]


@dataclass(frozen=True)
class Quarantine:
    """A worker just quarantined: what its caller must now do to it (ban, empty, reassign)."""

    worker_id: str
    key: str
    reason: str


class Reputation:
    def __init__(self, folder: Path, strikes: int, step: Callable[[], int]):
        self.folder = folder
        self.needed = strikes
        self.step = step  # the learner's current step, for the files
        self.strikes: Counter[str] = Counter()
        self.audits: Counter[str] = Counter()  # worker id -> checks made
        self.failures: Counter[str] = Counter()  # worker id -> checks failed
        self.by_check: Counter[str] = Counter()  # "<check>:<ok|fail>"
        self.quarantined: dict[str, str] = quarantined_workers(folder)  # worker id -> reason
        self._files: dict[str, TextIO] = {}

    def record(self, v: Verdict) -> Quarantine | None:
        """The verdict written and counted; the quarantine it brought, if any (the caller's
        to carry out)."""
        self.audits[v.worker_id] += 1
        self.by_check[f"{v.check}:{'ok' if v.ok else 'fail'}"] += 1
        self._append(
            "audits.jsonl",
            {
                "worker_id": v.worker_id,
                "group_id": v.group_id,
                "version": v.version,
                "check": v.check,
                "ok": v.ok,
                "stats": v.stats,
            },
        )
        if v.ok or v.worker_id in self.quarantined:
            return None
        self.failures[v.worker_id] += 1
        # A failed check of a group the step-start screen left out (echo_rl/control/screen.py) is two
        # findings against the same claim: quarantined at once. An honest group is screened
        # about once in 48,000 and its check then fails with probability <= audit_alpha.
        self.strikes[v.worker_id] += self.needed if v.check.startswith("screened_") else 1
        log.warning(
            "strike %d/%d for worker %s: %s check failed on group %s %s",
            self.strikes[v.worker_id],
            self.needed,
            v.worker_id,
            v.check,
            v.group_id,
            v.stats,
        )
        if self.strikes[v.worker_id] >= self.needed:
            return self.quarantine(
                v.worker_id,
                v.key,
                f"{self.strikes[v.worker_id]} failed checks, the last: {v.check}",
            )
        return None

    def forgive(self, worker_id: str, n: int) -> bool:
        """Take back ``n`` strikes that turned out to be the run's own fault
        (echo_rl/control/faults.py); False for a worker already quarantined (its ban stands: the
        operator lifts it) or with none to take back."""
        if worker_id in self.quarantined or self.strikes[worker_id] <= 0:
            return False
        self.strikes[worker_id] = max(0, self.strikes[worker_id] - n)
        return True

    def quarantine(self, worker_id: str, key: str, reason: str) -> Quarantine | None:
        """Written down and returned for the caller to carry out; None for a worker already
        quarantined."""
        if worker_id in self.quarantined:
            return None
        self.quarantined[worker_id] = reason
        self._append(
            "quarantine.jsonl",
            {
                "worker_id": worker_id,
                "key": key,
                "reason": reason,
                "strikes": self.strikes[worker_id],
                "time": time.time(),
            },
        )
        log.error("worker %s QUARANTINED: %s", worker_id, reason)
        return Quarantine(worker_id, key, reason)

    def _append(self, name: str, entry: JsonObject) -> None:
        """One line, flushed; the files stay open (a check per delivered group is written)."""
        f = self._files.get(name)
        if f is None:
            self.folder.mkdir(parents=True, exist_ok=True)
            f = self._files[name] = (self.folder / name).open("a")
        row, _ = finite_or_null({"step": self.step(), **entry})  # a NaN statistic: null
        f.write(json.dumps(row, allow_nan=False) + "\n")
        f.flush()

    def per_worker(self) -> dict[str, dict[str, int]]:
        """For /metrics and the dashboard."""
        ids = set(self.audits) | set(self.quarantined)
        return {
            w: {
                "audits": self.audits[w],
                "failures": self.failures[w],
                "quarantined": int(w in self.quarantined),
            }
            for w in sorted(ids)
        }


def quarantined_workers(folder: Path) -> dict[str, str]:
    """Worker id -> reason, from a run's quarantine file (empty when there is none)."""
    path = folder / "quarantine.jsonl"
    if not path.exists():
        return {}
    out = {}
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
            out[str(row["worker_id"])] = str(row.get("reason", ""))
        except (ValueError, KeyError, TypeError):
            continue  # a torn last line after a crash
    return out


def without_quarantined(live: list[Record], folder: Path) -> tuple[list[Record], list[SetAside]]:
    """On resume: the buffered records of quarantined workers are set aside, never replayed."""
    banned = quarantined_workers(folder)
    aside = [
        SetAside(
            "quarantined",
            f"worker {r.worker_id} was quarantined: {banned[r.worker_id]}",
            msgpack.packb(vars(r), use_bin_type=True),
        )
        for r in live
        if r.worker_id in banned
    ]
    return [r for r in live if r.worker_id not in banned], aside
