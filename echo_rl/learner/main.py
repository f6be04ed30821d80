"""The learner process: ``echo-rl learn CONFIG``.

Wires the pieces together and runs the step loop: take ``prompts_per_step`` whole admissible
groups from the buffer (time spent waiting is ``t_wait``), materialise them through the
adapter, run one GRPO step (``t_train``), bump the version, publish a snapshot every ``kappa``
steps, append one line to ``metrics.jsonl``.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import random
import sys
import time
from pathlib import Path
from typing import Literal, TypedDict

import torch

from echo_rl.broadcast.memory import trim
from echo_rl.control.affinity import Affinity, LengthBook, SpeedBook
from echo_rl.control.auditor import Auditor
from echo_rl.control.grants import open_journal
from echo_rl.control.parts import Inputs
from echo_rl.control.reputation import Verdict
from echo_rl.control.screen import audit_screened
from echo_rl.control.server import LearnerServer
from echo_rl.control.work import WorkQueue
from echo_rl.core import stopping
from echo_rl.core.config import EchoConfig, dump_toml
from echo_rl.core.errors import EchoError
from echo_rl.core.metrics import LearnerMetrics
from echo_rl.core.metrics_server import MetricsServer
from echo_rl.core.spill import spill_dir
from echo_rl.core.steprow import COL, RunSummary, StepRow
from echo_rl.data.buffer import ReplayBuffer
from echo_rl.data.durable import BufferLog
from echo_rl.data.records import Limits
from echo_rl.learner.checkpoint import CheckpointExtra, load_or_create_key
from echo_rl.learner.heldout import HeldoutEval, open_heldout
from echo_rl.learner.memory import memory, say_memory_plan
from echo_rl.learner.policy import Policy, Step, Sync
from echo_rl.learner.provision import CapacityFeedback
from echo_rl.learner.publisher import Publisher
from echo_rl.learner.release import Release, Releaser, base_model, release_threaded, run_publisher
from echo_rl.learner.resume import Resume
from echo_rl.learner.rows import CutWatch, RunTotals, finite_row, metrics_row, save_summary
from echo_rl.learner.rows import summary as run_summary
from echo_rl.learner.startup import (
    announce,
    freeze_startup_objects,
    reuse_ports,
    say_config,
    say_length_fit,
    setup_logging,
)
from echo_rl.learner.trails import Trails
from echo_rl.learner.watch import PolicyWatch, take_groups

Terminated = stopping.Terminated  # raised by a SIGTERM (echo_rl/core/stopping.py)

log = logging.getLogger("echo.learner")


class LearnerStall(EchoError, RuntimeError):
    default_reason = "learner_stall"


def shutdown_reason(outcome: str | BaseException) -> str:
    """What the learner tells its workers as it closes (their status's "learner says" and
    exit): "run complete" only for a run that reached learner.max_steps. ``outcome``: the
    run's end as its summary says it ("complete", or why it stopped early), or what ended it."""
    if isinstance(outcome, KeyboardInterrupt):
        return "learner stopped"  # Ctrl-C or SIGTERM, by its operator
    if isinstance(outcome, LearnerStall):
        return f"learner stalled: {outcome}"
    if isinstance(outcome, BaseException):
        return (
            f"learner failed ({type(outcome).__name__}): the run did not complete "
            f"(the operator's learner.log says why)"
        )
    return (
        "run complete"
        if outcome == "complete"
        else f"run ended before learner.max_steps: {outcome}"
    )


def run_learner(cfg: EchoConfig, run_dir: Path, resume: bool = False) -> RunSummary | None:
    policy = Policy(cfg)
    if not policy.par.is_main:
        try:
            policy.follow()  # torchrun ranks > 0: train on their shards, nothing else
        finally:
            policy.par.close()
        return None  # rank 0 writes the summary
    run_dir.mkdir(parents=True, exist_ok=True)
    setup_logging(run_dir)
    # The learner server's loop shares the GIL with the training, publisher and log threads:
    # a 1 ms switch interval (default 5 ms) bounds how long a heartbeat waits for it when the
    # trainer runs Python code (benchmarks/load_control.py measures the round trip).
    sys.setswitchinterval(0.001)
    # SIGTERM ends the run like Ctrl-C: workers are told, sockets closed, metrics flushed
    # (taken while waiting for a batch or between steps: echo_rl/core/stopping.py).
    stopping.reset()
    stopping.install()
    if resume:
        reuse_ports(cfg, run_dir)
    (run_dir / "config.toml").write_text(dump_toml(cfg))
    say_config(cfg)
    say_length_fit(cfg, policy.adapter, policy.tokenizer, policy.model)
    learner = Learner(cfg, run_dir, policy)
    try:
        with stopping.interruptible():  # loading a model: nothing half done to leave behind
            learner.start(resume)
        freeze_startup_objects()
        summary = learner.run()
        reason = shutdown_reason(summary.ended)
        return summary
    except KeyboardInterrupt as stop:
        reason = shutdown_reason(stop)
        # a run stopped by hand has a summary too, of the steps it took
        learner.write_summary(
            "stopped (SIGTERM)" if isinstance(stop, Terminated) else "stopped (Ctrl-C)"
        )
        raise
    except LearnerStall as stall:
        reason = shutdown_reason(stall)
        learner.write_summary(f"stalled: {stall}")
        raise
    except BaseException as exc:  # a crash: the workers are not told the run completed
        reason = shutdown_reason(exc)
        raise
    finally:
        learner.close(reason)


class AuditBorrow(TypedDict, total=False):
    """The auditor's arguments for audits on the trainer's own model (none: a copy)."""

    borrow: torch.nn.Module  # the trainer's model, audited between steps
    spill_to: Path  # where its weights are spilled meanwhile


def audit_in_policy(cfg: EchoConfig, policy: Policy, run_dir: Path) -> AuditBorrow:
    """security.audit_model = "policy": audits borrow the trainer's model between steps,
    where that model is one plain float32 module (one process, on the CPU)."""
    par = policy.par
    if cfg.security.audit_model != "policy" or par.world > 1 or par.device.type != "cpu":
        return {}
    return {"borrow": policy.model, "spill_to": spill_dir(run_dir / "spill")}


class Learner:
    """Rank 0's side of a run: buffer (with its log), work queue, server (echo_rl.control.server), checkpoints,
    publication and metrics around the ``Policy``."""

    def __init__(self, cfg: EchoConfig, run_dir: Path, policy: Policy):
        self.cfg, self.run_dir, self.policy = cfg, run_dir, policy
        lc = cfg.learner
        self.adapter = policy.adapter  # built once, with the policy's tokenizer
        # A multi-turn episode carries several generations (and the text between them).
        max_tokens = max(
            cfg.worker.max_new_tokens,
            getattr(self.adapter, "max_completion_tokens", 0)
            if getattr(self.adapter, "multi_turn", False)
            else 0,
        )
        answers = policy.answer_tokens
        self.limits = Limits(
            policy.vocab_size,
            max_tokens,
            lc.group_size,
            max_abs_reward=lc.max_abs_reward,
            min_logprob=lc.min_behaviour_logprob,
            answer_tokens=frozenset(answers) if answers is not None else None,
        )
        self.trails = Trails(run_dir, lambda: self.step)  # consumed, dropped, nonfinite, decisions
        self.buffer = ReplayBuffer(
            lc.staleness, cfg.buffer.capacity_groups, lc.group_size, on_drop=self.trails.dropped
        )
        self.log = BufferLog(run_dir / "buffer.log", fsync=lc.fsync)
        self.prompt_rng = random.Random(cfg.seed)
        self.key = load_or_create_key(run_dir)
        self.run_id = run_dir.name
        self.server: LearnerServer | None = None
        self.totals = RunTotals()
        self.step = 0  # next step to run
        self.rows: list[StepRow] = []
        self.metrics = (
            LearnerMetrics(learner_price_per_hour=lc.price_per_hour, run_id=self.run_id)
            if cfg.metrics.enabled
            else None
        )
        self.metrics_server: MetricsServer | None = None
        self.struck = self.trails.struck  # worker id -> records behind skipped updates
        self.cuts = CutWatch(
            cfg.worker.max_new_tokens, policy.tokenizer.eos_token_id, cfg.adapter.name
        )
        instance = os.urandom(3).hex()  # group ids never repeat across restarts
        self.work = WorkQueue(
            self.adapter.prompts(self.prompt_rng),
            group_size=lc.group_size,
            max_outstanding=min(lc.effective_outstanding, cfg.buffer.capacity_groups),
            lease_timeout_s=lc.lease_timeout_s,
            prefix=f"{self.run_id}.{instance}",
            secret=hashlib.sha256(b"echo group seeds" + self.key.private_bytes()).digest(),
            affinity=(
                Affinity(LengthBook(), SpeedBook(), window=lc.affinity_window)
                if lc.affinity
                else None
            ),
        )
        # Built in ``start`` (``--resume`` restores into the buffer and the work queue first):
        self.auditor: Auditor | None = None  # audits, handed to the server
        self.release: Release | None = None  # a version's checks and way to the publisher
        self.publisher: Publisher | None = None  # encodes, signs and publishes (its thread)
        self.heldout: HeldoutEval | None = None  # echo_rl/learner/heldout.py (None: off)
        self.watch: PolicyWatch | None = None  # collapse rules over the steps
        self.releaser: Releaser | None = None  # a version's way out
        self.feedback: CapacityFeedback | None = None  # the capacity the run needs, told

    # ------------------------------------------------------------------ start / restore

    def start(self, resume: bool) -> None:
        lc = self.cfg.learner
        if resume:
            back = Resume(
                self.run_dir,
                self.cfg,
                self.limits,
                self.policy,
                self.buffer,
                self.work,
                self.log,
                self.prompt_rng,
            ).run()
            self.step, self.totals, self.rows = back.step, back.totals or self.totals, back.rows
        # leases from here on go to the grant journal, which starts with those open now
        self.work.journal = open_journal(self.run_dir, self.work.issued.values())
        server, auditor = self._start_server(resume)
        self.release = release = Release(
            self.cfg,
            self.run_dir,
            self.policy,
            auditor,
            run_publisher(self.cfg, self.run_id, self.key, self.policy, server.publish),
        )
        self.publisher = publisher = release.publisher
        self.heldout = open_heldout(lc.heldout, self.run_dir, lc.max_steps, self.adapter, self.step)
        self.watch = PolicyWatch(lc.collapse, self.heldout)
        self.releaser = releaser = Releaser(
            self.run_dir,
            self.release,
            checkpoint=lc.checkpoint,
            threaded=release_threaded(lc, self.policy.par.device),
            state=self._checkpoint_state,
            compact_log=lambda: self.log.compact(self.buffer.contents),
            saved=None if self.heldout is None else self.heldout.offer,
        )
        self.metrics_server = announce(self.cfg, self.run_dir, server, self.metrics, self.rows)
        log.info(
            "learner up at %s, run %s, step %d, kappa=%d, ranks=%d",
            server.endpoint,
            self.run_id,
            self.step,
            lc.effective_kappa,
            self.policy.par.world,
        )
        if self.policy.lora_note:
            log.info("%s", self.policy.lora_note)
        say_memory_plan(self.policy, lc)
        _, full = self.policy.command(Sync())
        assert full is not None
        if not resume or self.step == 0:
            releaser.save_now(self.step, full)
        release.publish(self.step, full[0])
        publisher.flush()  # workers that join now get a snapshot at once
        if self.rows and self.feedback is not None:  # after --resume: the capacity the run
            # needed, from its own history
            self.feedback.tell(None, self.rows[-1].t_bcast or 0.0, self.rows)

    def _start_server(self, resume: bool) -> tuple[LearnerServer, Auditor]:
        """The auditor, and the server that hands its audits over (and serves the base model
        of a LoRA run); after ``--resume``, with the fleet's books the last instance saved."""
        self.auditor = auditor = Auditor(
            self.cfg,
            self.policy.tokenizer,
            self._report,
            lambda w: w in self.server.reputation.quarantined if self.server else False,
            answer_tokens=self.policy.answer_tokens,
            **audit_in_policy(self.cfg, self.policy, self.run_dir),
        )
        self.server = LearnerServer(
            self.cfg,
            Inputs(
                run_id=self.run_id,
                key=self.key,
                buffer=self.buffer,
                work=self.work,
                limits=self.limits,
                buffer_log=self.log,
                run_dir=self.run_dir,
                adapter=self.adapter,
                audit=self.auditor.submit,
                step=lambda: self.step,
            ),
        )
        if resume:
            self.server.parts.fleet.restore()
        base = base_model(self.cfg, self.policy, self.run_id, self.key, self.run_dir)
        if base is not None:
            self.server.hold_base(*base)
        self.server.start()
        self.feedback = CapacityFeedback(
            self.cfg, self.server, self.trails, self.metrics, lambda: self.step
        )
        return self.server, auditor

    def _key_of(self, worker_id: str) -> str | None:  # a screened group's sender's key
        return getattr(
            self.server.table.workers.get(worker_id) if self.server else None, "key", None
        )

    def _report(self, verdict: Verdict) -> None:
        if self.server is not None:
            self.server.report(verdict)

    # ------------------------------------------------------------------ checkpoint / publish

    def _checkpoint_state(self, row: StepRow | None) -> CheckpointExtra:
        """What a checkpoint holds besides the model and optimizer, read now, as the last step
        left it (on the training thread, also for a checkpoint the release thread writes)."""
        assert self.server is not None
        work, prompt_rng = self.server.work_state(self.prompt_rng)
        return {
            "step": self.step - 1,
            # a dict: older checkpoints hold one
            "row": None if row is None else row.to_json(),
            **self.policy.rng_state(),
            "prompt_rng": prompt_rng,
            "work": work,
            "buffer_stats": self.buffer.stats_copy(),
            "totals": copy.deepcopy(self.totals),
            "wall_s": time.monotonic() - self.totals.started,
        }

    # ------------------------------------------------------------------ the step loop

    def run(self) -> RunSummary:
        assert self.watch is not None and self.releaser is not None  # ``start`` built them
        assert self.publisher is not None
        with (self.run_dir / "metrics.jsonl").open("a") as metrics:
            while self.step < self.cfg.learner.max_steps:
                stopping.check()  # a SIGTERM or Ctrl-C that came during the last step
                row = self._one_step()
                self.rows.append(row)
                metrics.write(
                    json.dumps(row.to_json(), allow_nan=False) + "\n"
                )  # finite_row made it so
                metrics.flush()
                if self.watch.stop:  # learner.collapse = "stop"
                    break
        self.releaser.flush()
        self.publisher.flush()
        if self.heldout is not None:
            self.heldout.finish()  # the last checkpoint's score
        return self.write_summary(self.watch.stop or "complete")

    def write_summary(self, ended: str) -> RunSummary:
        """summary.json, whole or not at all (a second Ctrl-C may come while it is written)."""
        return save_summary(self.run_dir, run_summary(self.cfg, self.rows, self.totals, ended))

    def _one_step(self) -> StepRow:
        lc, step = self.cfg.learner, self.step
        version = step  # one version per learner step
        release, auditor, watch, feedback = self.release, self.auditor, self.watch, self.feedback
        assert release is not None and auditor is not None and self.publisher is not None
        assert watch is not None and feedback is not None  # ``start`` built them
        assert self.releaser is not None
        self.releaser.compact(step)
        t0 = time.monotonic()
        assert self.server is not None
        self.server.waiting(True)  # the provisioner's liveness rule (provisioning/controller)
        try:
            with stopping.interruptible():  # a stop while waiting has nothing half done
                taken = take_groups(
                    self.buffer, lc.prompts_per_step, lc.wait_timeout_s, lc.dynamic_sampling
                )
        finally:
            self.server.waiting(False)
        if taken is None:
            raise LearnerStall(
                f"no {lc.prompts_per_step} admissible groups within {lc.wait_timeout_s}s at "
                f"version {version}: are workers connected? (learner.wait_timeout_s)"
            )
        groups, left_out = taken
        ids = [g[0].group_id for g in groups + left_out]
        self.log.consumed(step, ids)
        self.trails.write("consumed", {"groups": ids})
        t1 = time.monotonic()
        publish = (step + 1) % lc.effective_kappa == 0
        batch = self.adapter.materialise(groups, lc.adv_eps, scale_rewards=lc.scale_rewards)
        # with the release thread the state comes as it lives, for its mirror to copy
        sync: bool | Literal["live"] = (
            ("live" if self.releaser.live else True) if publish else False
        )
        stats, full = self.policy.command(Step(batch, sync))
        t2 = time.monotonic()
        if stats.get(COL.skipped_nonfinite):  # the trainer names its numbers as the row does
            self.trails.strike(groups, self.policy.trainer.nonfinite_rows)
        if self.policy.trainer.screened_rows:  # left out of the step: audited at once
            screened = self.policy.trainer.screened_rows
            audit_screened(groups, screened, self._key_of, auditor.submit, self.trails.write)
        self.totals.add(step, t1 - t0, t2 - t1)
        self.step += 1
        self.buffer.set_version(self.step)
        assert self.server is not None
        control = self.server.stats()
        row = finite_row(
            metrics_row(
                step,
                version,
                groups,
                stats,
                t1 - t0,
                t2 - t1,
                0.0,
                self.totals,
                self.buffer,
                control,
            )
        )
        row.completions_cut = self.cuts.share(step, [r for g in groups for r in g])
        if full is not None:  # checkpoint, then publication (echo_rl.learner.release)
            self.releaser.release_version(self.step, full, row)
        row.t_publish = round(time.monotonic() - t2, 4)
        row.publish_refused = release.refused
        release.describe(row)
        row.decode_s, row.keyframe_installs = control.decode_s, control.keyframes
        auditor.after_step(row, t2 - t1)
        watch.observe(row, groups + left_out, len(left_out))
        trim()  # the step's and the audits' freed transients go back to the kernel
        row.memory = memory(
            self.policy,
            self.publisher,
            self.server.payloads() + auditor.payloads(),
            auditor.model_tensors(),
        )
        self.releaser.describe(row)
        feedback.tell(t2 - t1, control.t_bcast or 0.0, self.rows, control.snapshot_path)
        if self.metrics is not None:
            self.metrics.update(row, control)
        return row

    def close(self, reason: str) -> None:
        if self.releaser is not None:  # the version in flight: its checkpoint whole
            self.releaser.close()
        if self.heldout is not None:
            self.heldout.close()
        if self.publisher is not None:
            self.publisher.close()
        if self.metrics_server is not None:
            self.metrics_server.close()
        if self.server is not None:
            self.server.shutdown(reason)
        self.log.close()
        if self.work.journal is not None:
            self.work.journal.close()
        self.policy.close()
