"""The learner process: ``echo-rl learn CONFIG``.

Wires the pieces together and runs the step loop: take ``prompts_per_step`` whole admissible
groups from the buffer (time spent waiting is ``t_wait``), materialise them through the
adapter, run one GRPO step (``t_train``), bump the version, publish a snapshot every ``kappa``
steps, append one line to ``metrics.jsonl``.
"""

from __future__ import annotations

import json
import logging
import random
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from broadcast.snapshot import RunKey, Snapshot, build_manifest
from dataplane.adapter import load_adapter
from dataplane.records import Limits, Record
from echo.config import EchoConfig, dump_toml
from echo.machine import machine_info
from echo.procs import READY_PREFIX
from echo.models import load_model, load_tokenizer, params_to_payload, vocab_size
from learner.buffer import ReplayBuffer
from learner.control import ControlPlane
from learner.trainer import Trainer
from learner.work import WorkQueue

log = logging.getLogger("echo.learner")



class LearnerStall(RuntimeError):
    pass


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


class Publisher:
    def __init__(self, model: Any, control: ControlPlane, cfg: EchoConfig, key: RunKey, run_id: str):
        self.model, self.control, self.cfg, self.key, self.run_id = model, control, cfg, key, run_id

    def publish(self, version: int) -> None:
        tensors, payload = params_to_payload(self.model, self.cfg.broadcast.dtype)
        manifest = build_manifest(run_id=self.run_id, version=version, tensors=tensors,
                                  payload=payload, chunk_size=self.cfg.broadcast.chunk_kib * 1024,
                                  dtype=self.cfg.broadcast.dtype, key=self.key)
        self.control.publish(Snapshot(manifest, payload))


def _metrics_row(step: int, version: int, groups: list[list[Record]], stats: dict[str, float],
                 t_wait: float, t_train: float, t_publish: float, totals: RunTotals,
                 buffer: ReplayBuffer, control: dict[str, Any]) -> dict[str, Any]:
    records = [r for g in groups for r in g]
    min_u = min(r.version for r in records)
    return {
        "step": step, "version": version,
        "reward_mean": sum(r.reward for r in records) / len(records),
        "staleness_max": version - min_u,
        "staleness_mean": sum(version - r.version for r in records) / len(records),
        "t_train": round(t_train, 4), "t_wait": round(t_wait, 4), "t_publish": round(t_publish, 4),
        "bubble_ratio": round(totals.bubble_ratio, 4),
        "admitted": buffer.stats.admitted, "duplicates": buffer.stats.duplicates,
        "dropped_stale": buffer.stats.dropped_stale,
        "active_workers": control["active_workers"], "rejected": control["rejected"],
        "learner_bytes_sent": control["learner_bytes_sent"],
        "reissued_groups": control["reissued_groups"], **buffer.depth(),
        **{k: round(v, 5) for k, v in stats.items()},
        "wall_s": round(time.monotonic() - totals.started, 3),
    }


def _summary(cfg: EchoConfig, rows: list[dict[str, Any]], totals: RunTotals) -> dict[str, Any]:
    def mean(rs: list[dict[str, Any]]) -> float:
        return sum(r["reward_mean"] for r in rs) / len(rs)

    return {
        "steps": len(rows), "staleness_budget": cfg.learner.staleness,
        "staleness_max": max(r["staleness_max"] for r in rows),
        "reward_first10": mean(rows[:10]), "reward_last10": mean(rows[-10:]),
        "bubble_ratio": totals.bubble_ratio, "startup_wait_s": totals.startup_wait,
        "wall_s": time.monotonic() - totals.started, "last": rows[-1], "machine": machine_info(),
    }


def _setup_logging(run_dir: Path) -> None:
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    fh = logging.FileHandler(run_dir / "learner.log")
    fh.setFormatter(fmt)
    err = logging.StreamHandler(sys.stderr)
    err.setFormatter(fmt)
    err.setLevel(logging.WARNING)
    root.addHandler(fh)
    root.addHandler(err)


def _sigterm_as_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def run_learner(cfg: EchoConfig, run_dir: Path) -> dict[str, Any]:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.toml").write_text(dump_toml(cfg))
    _setup_logging(run_dir)
    # SIGTERM ends the run like Ctrl-C: workers are told, sockets closed, metrics flushed.
    signal.signal(signal.SIGTERM, _sigterm_as_interrupt)
    torch.set_num_threads(cfg.learner.torch_threads)
    random.seed(cfg.seed)

    tokenizer = load_tokenizer(cfg.model)
    model = load_model(cfg.model, tokenizer, "float32")
    adapter = load_adapter(cfg.adapter.name, cfg.adapter.options, tokenizer)
    lc = cfg.learner
    limits = Limits(vocab_size(model), cfg.worker.max_new_tokens, lc.group_size)
    buffer = ReplayBuffer(lc.staleness, cfg.buffer.capacity_groups, lc.group_size)
    work = WorkQueue(adapter.prompts(random.Random(cfg.seed)), group_size=lc.group_size,
                     max_outstanding=min(lc.effective_outstanding, cfg.buffer.capacity_groups),
                     lease_timeout_s=lc.lease_timeout_s, prefix=run_dir.name, seed=cfg.seed)
    key = RunKey.generate()
    control = ControlPlane(cfg, run_id=run_dir.name, key=key, buffer=buffer, work=work, limits=limits)
    control.start()
    (run_dir / "learner.json").write_text(json.dumps(
        {"endpoint": control.endpoint, "snapshot_endpoint": control.snapshot_endpoint}))
    print(READY_PREFIX + control.endpoint, flush=True)
    log.info("learner up at %s, run %s, kappa=%d", control.endpoint, run_dir.name, lc.effective_kappa)

    trainer = Trainer(model, lc, seed=cfg.seed)
    publisher = Publisher(model, control, cfg, key, run_dir.name)
    reason = "run complete"
    try:
        publisher.publish(0)
        return _train_loop(cfg, run_dir, adapter, buffer, trainer, publisher, control)
    except KeyboardInterrupt:
        reason = "learner stopped"
        raise
    finally:
        control.shutdown(reason)


def _train_loop(cfg: EchoConfig, run_dir: Path, adapter: Any, buffer: ReplayBuffer,
                trainer: Trainer, publisher: Publisher, control: ControlPlane) -> dict[str, Any]:
    lc = cfg.learner
    totals = RunTotals()
    version = 0
    rows: list[dict[str, Any]] = []
    with (run_dir / "metrics.jsonl").open("a") as metrics:
        for step in range(lc.max_steps):
            t0 = time.monotonic()
            groups = buffer.take(lc.prompts_per_step, timeout=lc.wait_timeout_s)
            if groups is None:
                raise LearnerStall(
                    f"no {lc.prompts_per_step} admissible groups within {lc.wait_timeout_s}s at "
                    f"version {version}: are workers connected? (learner.wait_timeout_s)")
            t1 = time.monotonic()
            stats = trainer.step(adapter.materialise(groups, lc.adv_eps))
            t2 = time.monotonic()
            totals.add(step, t1 - t0, t2 - t1)
            buffer.set_version(version + 1)
            if (version + 1) % lc.effective_kappa == 0:
                publisher.publish(version + 1)
            t3 = time.monotonic()
            row = _metrics_row(step, version, groups, stats, t1 - t0, t2 - t1, t3 - t2, totals,
                               buffer, control.stats())
            rows.append(row)
            metrics.write(json.dumps(row) + "\n")
            metrics.flush()
            version += 1
    summary = _summary(cfg, rows, totals)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
