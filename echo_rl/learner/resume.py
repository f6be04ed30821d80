"""``--resume``: a restarted learner takes up where the crashed one's last checkpoint left it.

From the run folder: the checkpoint (model, optimizer, generators, work queue, totals), the
buffer log's records still owed to training (minus those of quarantined workers), the leases
open at the crash (``echo_rl.control.grants``), and the audit trails cut back to the checkpoint's step
(lines of the lost steps set aside in ``NAME.lost.jsonl``). Entries that cannot be replayed are
set aside into ``buffer.log.rejected``, counted, and the resume goes on without them.
"""

from __future__ import annotations

import json
import logging
import random
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from echo_rl.control.gate import security_dir
from echo_rl.control.grants import load as load_grants
from echo_rl.control.grants import open_leases
from echo_rl.control.reputation import without_quarantined
from echo_rl.control.work import WorkQueue
from echo_rl.core.config import EchoConfig
from echo_rl.core.jsontypes import JsonObject
from echo_rl.core.metrics import finite_or_null
from echo_rl.core.security import KeyList
from echo_rl.core.steprow import StepRow
from echo_rl.data.buffer import ReplayBuffer
from echo_rl.data.durable import BufferLog, SetAside, live_after, quarantine, scan_log
from echo_rl.data.records import Limits, Record
from echo_rl.learner.checkpoint import load_checkpoint
from echo_rl.learner.policy import Load, Policy
from echo_rl.learner.rows import RunTotals
from echo_rl.learner.trails import ConsumedLine, TrailLine

log = logging.getLogger("echo.learner")


@dataclass
class Resumed:
    """Where the restarted learner stands: its next step, the run's totals (None: no
    checkpoint, the new ones stand) and the metrics rows of the steps kept."""

    step: int
    totals: RunTotals | None
    rows: list[StepRow]


class Resume:
    def __init__(
        self,
        run_dir: Path,
        cfg: EchoConfig,
        limits: Limits,
        policy: Policy,
        buffer: ReplayBuffer,
        work: WorkQueue,
        buffer_log: BufferLog,
        prompt_rng: random.Random,
    ):
        """Restores into ``policy``, ``buffer``, ``work``, ``buffer_log`` and ``prompt_rng``."""
        self.run_dir, self.cfg, self.limits, self.policy = run_dir, cfg, limits, policy
        self.buffer, self.work, self.buffer_log, self.prompt_rng = (
            buffer,
            work,
            buffer_log,
            prompt_rng,
        )
        self.step = 0
        self.totals: RunTotals | None = None
        self.rows: list[StepRow] = []

    def run(self) -> Resumed:
        ckpt = load_checkpoint(self.run_dir)
        last = ckpt["step"] if ckpt else -1
        admitted, consumed, aside = scan_log(self.run_dir / "buffer.log", self.limits)
        live, trained = live_after(admitted, consumed, last)
        live, out = without_quarantined(live, security_dir(self.run_dir))
        aside += out
        if ckpt:
            self.policy.command(Load(ckpt))
            self.prompt_rng.setstate(ckpt["prompt_rng"])
            self.work.restore(ckpt["work"])
            self.buffer.stats = ckpt["buffer_stats"]
            self.totals = ckpt["totals"]
            self.totals.started = time.monotonic() - ckpt["wall_s"]
            self.step = last + 1
        self.buffer.set_version(self.step)
        self.buffer.restore(live, trained)
        self._restore_leases(live, trained)
        self._set_aside(aside)  # before the compaction drops them from the log
        self.buffer_log.compact(lambda: live)
        self._trim_audit()
        row = ckpt.get("row") if ckpt else None
        if row and not any(r.step == last for r in self.rows):
            self._restore_row(StepRow.from_json(row))
        log.info(
            "resumed at step %d: %d buffered records restored, %d groups already trained",
            self.step,
            len(live),
            len(trained),
        )
        return Resumed(self.step, self.totals, self.rows)

    def _restore_leases(self, live: list[Record], trained: set[str]) -> None:
        """Leases open at the crash come back bound to their holders (``echo_rl.control.grants``),
        but for groups already trained or whole in the restored buffer."""
        leases, bad = load_grants(self.run_dir / "grants.jsonl")
        counts = Counter(r.group_id for r in live)
        done = (
            trained
            | self._trained_groups()
            | {g for g, n in counts.items() if n >= self.cfg.learner.group_size}
        )
        kept = open_leases(leases, done)
        self.work.restore_leases(kept)
        self.work.forget(done)
        # A banned holder never delivers (intake refuses it): its groups are handed out at
        # once, not held for lease_timeout_s (15 minutes in examples/public.toml, a stalled run).
        bans = KeyList(security_dir(self.run_dir) / "bans.txt")
        banned = {(lease.worker_id, lease.key) for lease in kept if lease.key and lease.key in bans}
        freed = sum(self.work.release_worker(wid, key) for wid, key in banned)
        log.info(
            "resume: %d lease(s) restored from grants.jsonl (%d finished, %d of banned "
            "keys handed out again, %d unreadable line(s) skipped)",
            len(kept) - freed,
            len(leases) - len(kept),
            freed,
            bad,
        )

    def _trained_groups(self) -> set[str]:
        """Groups the restored steps trained on (``consumed.jsonl``; the buffer log forgets
        them at each checkpoint's compaction)."""
        path = self.run_dir / "consumed.jsonl"
        if not path.exists():
            return set()
        rows: list[ConsumedLine] = [
            json.loads(x) for x in path.read_text().splitlines() if x.strip()
        ]
        return {g for r in rows if r["step"] < self.step for g in r["groups"]}

    def _set_aside(self, aside: list[SetAside]) -> None:
        """Log entries that cannot be replayed go to buffer.log.rejected, counted under
        ``set_aside_on_resume``; the resume goes on without them."""
        if not aside:
            return
        path = quarantine(self.run_dir / "buffer.log", aside)
        self.buffer.stats.rejected["set_aside_on_resume"] += len(aside)
        log.error(
            "resume: %d buffer log entr%s set aside into %s (%s)",
            len(aside),
            "y" if len(aside) == 1 else "ies",
            path,
            dict(Counter(a.reason for a in aside)),
        )

    def _trim_audit(self) -> None:
        """Steps after the checkpoint were lost with the crash: set their lines aside."""
        for name in ("metrics", "consumed", "dropped", "nonfinite"):
            path = self.run_dir / f"{name}.jsonl"
            if not path.exists():
                continue
            rows: list[TrailLine] = [
                json.loads(x) for x in path.read_text().splitlines() if x.strip()
            ]
            keep = [r for r in rows if r["step"] < self.step]
            lost = [r for r in rows if r["step"] >= self.step]
            if lost:
                with (self.run_dir / f"{name}.lost.jsonl").open("a") as f:
                    f.writelines(json.dumps(r) + "\n" for r in lost)
            path.write_text("".join(json.dumps(r) + "\n" for r in keep))
            if name == "metrics":  # a metrics line is a whole row, of which TrailLine
                # declares the step (``StepRow.to_json``)
                self.rows = [StepRow.from_json(cast(JsonObject, r)) for r in keep]

    def _restore_row(self, row: StepRow) -> None:
        """The crash came after the checkpoint and before the step's metrics line."""
        self.rows.append(row)
        with (self.run_dir / "metrics.jsonl").open("a") as f:
            f.write(json.dumps(finite_or_null(row.to_json())[0], allow_nan=False) + "\n")
        log.info(
            "metrics line of step %d restored from the checkpoint (t_publish unknown: 0)", row.step
        )
