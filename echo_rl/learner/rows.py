"""The learner's rows: one metrics line per step (``metrics.jsonl``; names in
docs/observability.md), the run's ``summary.json``, and the totals both are built from.
Pure functions of what the step and the server's statistics report.
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from echo_rl.core.config import EchoConfig
from echo_rl.core.control_stats import ControlStats
from echo_rl.core.machine import machine_info
from echo_rl.core.metrics import finite_or_null
from echo_rl.core.steprow import TRAINER_FIELDS, RunSummary, StepRow
from echo_rl.data.buffer import ReplayBuffer
from echo_rl.data.records import Record

log = logging.getLogger("echo.learner")


@dataclass
class RunTotals:
    """Bubble ratio B = sum(t_wait) / sum(t_train + t_wait), over steps after the first: the
    first step's wait is start-up (workers joining, loading the model), reported in its own
    row's ``t_wait`` but not in B, which is about steady-state starvation."""

    t_train: float = 0.0
    t_wait: float = 0.0
    startup_wait: float = 0.0
    started: float = field(default_factory=time.monotonic)

    def add(self, step: int, t_wait: float, t_train: float) -> None:
        if step == 0:
            self.startup_wait = t_wait
        else:
            self.t_wait += t_wait
        self.t_train += t_train

    @property
    def bubble_ratio(self) -> float:
        busy = self.t_train + self.t_wait
        return self.t_wait / busy if busy > 0 else 0.0


CUT_WARN_SHARE = 0.5  # warn when more than this share of a step's completions were cut
CUT_WARN_EVERY = 50  # ... at most once per this many steps
COMPLETIONS_CUT = (
    "step %d: %.0f%% of completions stopped at worker.max_new_tokens = %d "
    "without end-of-sequence: answers are being cut short. Raise it for this "
    "task ([adapter.presets.%s.generation] max_new_tokens, or --set "
    "worker.max_new_tokens=N; docs/config.md)"
)
EPISODES_CUT = (
    "step %d: %.0f%% of episodes stopped at a limit: a decision at worker.max_new_tokens = %d "
    "without end-of-sequence, or the transcript at the adapter's max_completion_tokens (or a "
    "budget of its own). Raise the one the task needs ([adapter.presets.%s.generation] "
    "max_new_tokens, or the adapter's max_completion_tokens; docs/adapters.md)"
)


class CutWatch:
    """The share of each step's completions cut short (``cut_share``), with a warning when
    most were: nothing else would say that a limit is too small for the task."""

    def __init__(self, max_new_tokens: int, eos_token_id: int | None, adapter: str):
        self.max_new_tokens, self.eos_token_id, self.adapter = max_new_tokens, eos_token_id, adapter
        self.warned = -CUT_WARN_EVERY  # step of the last "completions cut" warning

    def share(self, step: int, records: list[Record]) -> float | None:
        """The step's share of cut completions, with a warning when most were cut: nothing
        else would say that worker.max_new_tokens is too small for the task."""
        max_new = self.max_new_tokens
        share = cut_share(records, max_new, self.eos_token_id)
        if share is not None and share > CUT_WARN_SHARE and step - self.warned >= CUT_WARN_EVERY:
            self.warned = step
            episodes = any(r.loss_mask is not None for r in records)
            log.warning(
                EPISODES_CUT if episodes else COMPLETIONS_CUT,
                step,
                100 * share,
                max_new,
                self.adapter,
            )
        return None if share is None else round(share, 4)


def metrics_row(
    step: int,
    version: int,
    groups: list[list[Record]],
    stats: dict[str, float],
    t_wait: float,
    t_train: float,
    t_publish: float,
    totals: RunTotals,
    buffer: ReplayBuffer,
    control: ControlStats,
) -> StepRow:
    """The step's row as far as the step itself, the buffer and the server's statistics
    know it; the learner adds the publication's and the audits' numbers after."""
    records = [r for g in groups for r in g]
    row = StepRow(step=step, version=version)
    _batch(row, version, records)
    row.t_train, row.t_wait = round(t_train, 4), round(t_wait, 4)
    row.t_publish = round(t_publish, 4)
    row.bubble_ratio = round(totals.bubble_ratio, 4)
    bs = buffer.stats
    row.admitted, row.duplicates, row.dropped_stale = bs.admitted, bs.duplicates, bs.dropped_stale
    _control(row, control, t_train + t_wait)
    row.ready_groups, row.partial_groups = buffer.depth()
    row.set_reported(TRAINER_FIELDS, {k: round(v, 5) for k, v in stats.items()})
    row.wall_s = round(time.monotonic() - totals.started, 3)
    return row


def _batch(row: StepRow, version: int, records: list[Record]) -> None:
    """What the trained records say: reward, staleness, tokens, generation time."""
    n = len(records)
    row.reward_mean = sum(r.reward for r in records) / n
    row.staleness_max = version - min(r.version for r in records)
    row.staleness_mean = sum(version - r.version for r in records) / n
    row.staleness_counts = dict(Counter(version - r.version for r in records))
    # generated tokens this step trains on, and those of samples continued after a
    # preemption (docs/preemption.md): the preemption drill's goodput
    row.tokens_trained = sum(len(r.completion_ids) for r in records)
    row.mixed_version_samples = sum(1 for r in records if r.versions and len(r.versions) > 1)
    # seconds a worker spent generating the batch each record came in (its busy time):
    # the capacity the simulator and the provisioner should use, not demand-capped rates
    row.gen_s_mean = round(sum(r.gen_s for r in records) / n, 5)
    row.episode_stats = episode_means(records)


MAX_ROW_STATS = 16  # names in a row's episode_stats: those the most records carry


def episode_means(records: list[Record]) -> dict[str, float] | None:
    """Per name, the mean of the records' ``stats`` over those that carry it (None: none
    does). At most MAX_ROW_STATS names, those the most records carry (then by name): workers
    are strangers, and a row or a gauge must not grow with the names they make up."""
    sums: dict[str, float] = {}
    counts: Counter[str] = Counter()
    for r in records:
        for k, v in (r.stats or {}).items():
            sums[k] = sums.get(k, 0.0) + v
            counts[k] += 1
    if not counts:
        return None
    names = sorted(counts, key=lambda k: (-counts[k], k))[:MAX_ROW_STATS]
    return {k: round(sums[k] / counts[k], 5) for k in sorted(names)}


def _control(row: StepRow, control: ControlStats, step_s: float) -> None:
    """The fleet's and the server's numbers, copied from its statistics."""
    c = control
    row.active_workers, row.standby_workers = c.active_workers, c.standby_workers
    row.fleet_price_per_hour = c.fleet_price_per_hour
    row.worker_rate_mean = round(c.worker_rate_mean, 2)
    row.worker_busy_rate = round(c.worker_busy_rate, 2)
    row.cost_step_usd = round(c.fleet_price_per_hour * step_s / 3600, 8)
    row.rejected = c.rejected
    row.handbacks = c.handbacks  # docs/preemption.md
    row.reward_audit = c.reward_audit or None
    row.affinity = c.affinity or None
    # the control loop's CPU per kind of message, cumulative (echo_rl.control.cpu, docs/scale.md)
    row.control_cpu = c.control_cpu
    row.learner_bytes_sent, row.t_bcast = c.learner_bytes_sent, c.t_bcast
    row.reissued_groups = c.reissued_groups
    # echo_rl.control.grants: leases kept across a restart and the samples admitted under them
    row.restored_leases, row.restored_admitted = c.restored_leases, c.restored_admitted
    # echo_rl.broadcast.reports: relay reports by reason:outcome, probes by outcome (docs/security.md)
    row.relay_reports, row.relays_marked = c.relay_reports, c.relays_marked


def cut_share(records: list[Record], max_new_tokens: int, eos_token_id: int | None) -> float | None:
    """Share of completions cut short: a single-turn one that stopped at
    ``worker.max_new_tokens`` without end-of-sequence; a multi-turn episode whose record says
    ``cut`` (the worker's rule, ``echo_rl.data.episodes.episode_cut``: a decision cut so, or the
    transcript at its limit). Episodes from workers that do not say are left out; None when no
    record counts."""
    single = [r for r in records if r.loss_mask is None]
    told = [r for r in records if r.loss_mask is not None and r.cut is not None]
    if not single and not told:
        return None
    cut = sum(
        1
        for r in single
        if len(r.completion_ids) >= max_new_tokens
        and (not r.completion_ids or r.completion_ids[-1] != eos_token_id)
    )
    return (cut + sum(1 for r in told if r.cut)) / (len(single) + len(told))


def summary(cfg: EchoConfig, rows: list[StepRow], totals: RunTotals, ended: str) -> RunSummary:
    """summary.json; ``ended``: how the run ended (complete, stopped by a signal, stalled)."""

    def mean(rs: list[StepRow]) -> float | None:
        vals = [r.reward_mean for r in rs if r.reward_mean is not None]
        return sum(vals) / len(vals) if vals else None

    stale = [r.staleness_max for r in rows if r.staleness_max is not None]
    return RunSummary(
        steps=len(rows),
        ended=ended,
        staleness_budget=cfg.learner.staleness,
        staleness_max=max(stale, default=None),
        reward_first10=mean(rows[:10]),
        reward_last10=mean(rows[-10:]),
        bubble_ratio=totals.bubble_ratio,
        startup_wait_s=totals.startup_wait,
        wall_s=time.monotonic() - totals.started,
        last=rows[-1].to_json() if rows else None,
        machine=machine_info(),
    )


def finite_row(row: StepRow) -> StepRow:
    """NaN and inf are not JSON (and not numbers a reader can plot): written as null and
    counted in the row's ``nonfinite_values``."""
    clean, n = finite_or_null(row.to_json())
    if n:
        log.warning("step %s: %d non-finite metric value(s) written as null", row.step, n)
    out = StepRow.from_json(clean)
    out.missing = set(row.missing)  # fields not yet set stay where they will be written
    out.nonfinite_values = n
    return out


def save_summary(run_dir: Path, summary: RunSummary) -> RunSummary:
    """``summary.json``, whole or not at all (written aside, then renamed)."""
    tmp = run_dir / "summary.json.tmp"
    tmp.write_text(json.dumps(finite_or_null(summary.to_json())[0], indent=2, allow_nan=False))
    tmp.replace(run_dir / "summary.json")
    return summary
