"""Did a run lose anything a worker saw acknowledged, or train anything twice?

Reads what the learner leaves in its run directory (``consumed.jsonl``, ``dropped.jsonl``,
``buffer.log``, the last checkpoint) and the workers' ``--ledger`` files (one line per
acknowledged batch, with the (group, sample) keys the learner stored). Every acknowledged
sample must be trained on, still buffered, or a counted stale drop. Used by the integration
tests and ``benchmarks/wide_area.py``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from learner.checkpoint import load_checkpoint
from learner.durable import live_after, read_log

Key = tuple[str, int]  # (group id, sample index)


@dataclass
class RunAudit:
    acked: set[Key]
    trained: set[Key]
    buffered: set[Key]
    dropped: set[Key]
    groups_trained_twice: int

    @property
    def lost(self) -> set[Key]:
        return self.acked - self.trained - self.buffered - self.dropped


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def audit_run(run_dir: Path, ledgers: Iterable[Path], group_size: int) -> RunAudit:
    groups = [g for row in _lines(run_dir / "consumed.jsonl") for g in row["groups"]]
    ckpt = load_checkpoint(run_dir)
    live, _ = live_after(*read_log(run_dir / "buffer.log"), ckpt["step"] if ckpt else -1)
    return RunAudit(
        acked={tuple(k) for p in ledgers for row in _lines(p) for k in row["stored"]},
        trained={(g, i) for g in groups for i in range(group_size)},
        buffered={(r.group_id, r.sample_idx) for r in live},
        dropped={tuple(k) for row in _lines(run_dir / "dropped.jsonl") for k in row["pairs"]},
        groups_trained_twice=len(groups) - len(set(groups)),
    )
