"""Did a run lose anything a worker saw acknowledged, or train anything twice?

Reads what the learner leaves in its run directory (``consumed.jsonl``, ``dropped.jsonl``,
``buffer.log``, the last checkpoint) and the workers' ``--ledger`` files (one line per
acknowledged batch, with the (group, sample) keys the learner stored). Every acknowledged
sample must be trained on, still buffered, or dropped by a named rule (``dropped.jsonl``:
``stale``, evicted past the staleness bound; ``quarantined``, its worker's deliveries were
taken out). Used by the integration tests, ``benchmarks/wide_area.py`` and
``benchmarks/load_control.py``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict, TypeVar

from echo_rl.data.durable import live_after, read_log
from echo_rl.learner.checkpoint import load_checkpoint
from echo_rl.learner.trails import ConsumedLine, DroppedLine

Key = tuple[str, int]  # (group id, sample index)
_Line = TypeVar("_Line")


class LedgerLine(TypedDict):
    """What this audit reads of a worker's ``--ledger`` line (echo_rl/worker/delivery.py
    writes it): the (group id, sample index) keys of an acknowledged batch the learner stored."""

    stored: list[list[str | int]]


@dataclass
class RunAudit:
    acked: set[Key]
    trained: set[Key]
    buffered: set[Key]
    dropped_by: dict[str, set[Key]]  # rule -> the keys it dropped after admission
    groups_trained_twice: int

    @property
    def dropped(self) -> set[Key]:
        return set().union(*self.dropped_by.values())

    @property
    def lost(self) -> set[Key]:
        return self.acked - self.trained - self.buffered - self.dropped

    def accounting(self) -> dict[str, int]:
        """Each acknowledged key in exactly one place, first match wins: trained, dropped by
        each rule (the write-ahead log still holds a dropped record until the next checkpoint
        compacts it), buffered, else ``unaccounted``. The counts add up to ``acked``."""
        left = set(self.acked)
        out = {"acked": len(left)}
        for name, keys in [
            ("trained", self.trained),
            *((f"dropped_{rule}", keys) for rule, keys in sorted(self.dropped_by.items())),
            ("buffered", self.buffered),
        ]:
            out[name] = len(left & keys)
            left -= keys
        out["unaccounted"] = len(left)
        return out


def _lines(path: Path, line: type[_Line]) -> list[_Line]:
    """``path``'s JSON lines as ``line`` declares them (none when there is no file)."""
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _key(pair: list[str | int]) -> Key:
    group, idx = pair
    return str(group), int(idx)


def audit_run(run_dir: Path, ledgers: Iterable[Path], group_size: int) -> RunAudit:
    consumed = _lines(run_dir / "consumed.jsonl", ConsumedLine)
    groups = [g for row in consumed for g in row["groups"]]
    ckpt = load_checkpoint(run_dir)
    live, _ = live_after(*read_log(run_dir / "buffer.log"), ckpt["step"] if ckpt else -1)
    return RunAudit(
        acked={_key(k) for p in ledgers for row in _lines(p, LedgerLine) for k in row["stored"]},
        trained={(g, i) for g in groups for i in range(group_size)},
        buffered={(r.group_id, r.sample_idx) for r in live},
        dropped_by=_dropped_by(_lines(run_dir / "dropped.jsonl", DroppedLine)),
        groups_trained_twice=len(groups) - len(set(groups)),
    )


def _dropped_by(rows: list[DroppedLine]) -> dict[str, set[Key]]:
    out: dict[str, set[Key]] = {}
    for row in rows:  # a line without a rule is from before rules were named: stale evictions
        out.setdefault(row.get("rule", "stale"), set()).update(_key(k) for k in row["pairs"])
    return out
