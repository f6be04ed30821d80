"""The learner's append-only audit trails in the run folder (``consumed.jsonl``,
``dropped.jsonl``, ``nonfinite.jsonl``, ``decisions.jsonl``), one JSON line per entry keyed by
the step it was written at, so a resume can set aside what the crash undid
(echo_rl/learner/resume.py). And the workers behind skipped non-finite updates, traced and counted."""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import NotRequired, TypedDict

from echo_rl.data.records import Record

log = logging.getLogger("echo.learner")


class TrailLine(TypedDict):
    """What every line of a trail (and of ``metrics.jsonl``) holds: the learner step it was
    written at, by which a resume sets aside the lines of the steps the crash undid."""

    step: int


class ConsumedLine(TrailLine):
    """``consumed.jsonl``: the groups a step took from the buffer (trained or left out)."""

    groups: list[str]


class DroppedLine(TrailLine):
    """``dropped.jsonl``: admitted records the buffer dropped, and by which rule."""

    rule: NotRequired[str]  # absent from lines written before rules were named: "stale"
    pairs: list[list[str | int]]  # [group id, sample index]


class NonfiniteLine(TrailLine):
    """``nonfinite.jsonl``: the groups and senders behind a step's skipped updates."""

    groups: list[str]
    workers: list[str]


class Trails:
    def __init__(self, run_dir: Path, step: Callable[[], int]):
        self.run_dir, self._step = run_dir, step
        self.struck: Counter[str] = Counter()  # worker id -> records behind skipped updates

    def write(self, name: str, entry: Mapping[str, object]) -> None:
        """Append one entry to ``{name}.jsonl``, keyed by the learner's step."""
        with (self.run_dir / f"{name}.jsonl").open("a") as f:
            f.write(json.dumps({"step": self._step(), **entry}) + "\n")

    def dropped(self, records: list[Record], rule: str) -> None:
        """The buffer's ``on_drop``: records it dropped, and by which rule."""
        self.write(
            "dropped", {"rule": rule, "pairs": [[r.group_id, r.sample_idx] for r in records]}
        )

    def strike(self, groups: list[list[Record]], rows: list[int]) -> list[str]:
        """Trace the rows behind skipped non-finite updates to their groups and senders:
        logged, written to ``nonfinite.jsonl``, counted in ``self.struck``; returned."""
        records = [r for g in groups for r in g]
        culprits = [records[i] for i in sorted(set(rows)) if 0 <= i < len(records)]
        workers = sorted({r.worker_id for r in culprits})
        gids = sorted({r.group_id for r in culprits})
        self.struck.update(r.worker_id for r in culprits)
        self.write("nonfinite", {"groups": gids, "workers": workers})
        log.error(
            "step %d: update(s) skipped for non-finite loss/gradient; behind them %d "
            "group(s) %s from worker(s) %s",
            self._step(),
            len(gids),
            gids[:5],
            workers,
        )
        return workers
