"""The learner process: ``echo-rl learn CONFIG``.

Wires the pieces together and runs the step loop: take ``prompts_per_step`` whole admissible
groups from the buffer (time spent waiting is ``t_wait``), materialise them through the
adapter, run one GRPO step (``t_train``), bump the version, publish a snapshot every ``kappa``
steps, append one line to ``metrics.jsonl``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections import Counter
import random
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from broadcast.memory import trim
from broadcast.versions import VersionEncoder
from dataplane.records import Limits, Record
from echo.config import EchoConfig, ListenPorts, dump_toml
from echo.metrics import LearnerMetrics, finite_or_null
from echo.machine import machine_info
from echo.procs import READY_PREFIX
from echo.security import KeyList
from echo.models import TINY, params_to_payload, params_to_spill
from echo.spill import spill_dir
from learner.buffer import ReplayBuffer
from learner.checkpoint import load_checkpoint, load_or_create_key, save_checkpoint
from learner.auditor import Auditor
from learner.durable import BufferLog, live_after, quarantine, scan_log
from learner.listen import port_taken
from learner.server import LearnerServer
from learner.gate import security_dir
from learner.grants import GrantJournal, Lease, load as load_grants, open_leases
from learner.reputation import without_quarantined
from learner.policy import FullState, Policy
from learner.publisher import Publisher
from learner.work import WorkQueue
from provisioning.capacity import Infeasible, mu_req, t_train_average

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
        "staleness_counts": dict(Counter(version - r.version for r in records)),
        # generated tokens this step trains on, and those of samples continued after a
        # preemption (docs/preemption.md): the preemption drill's goodput
        "tokens_trained": sum(len(r.completion_ids) for r in records),
        "mixed_version_samples": sum(1 for r in records if r.versions and len(r.versions) > 1),
        # seconds a worker spent generating the batch each record came in (its busy time):
        # the capacity the simulator and the provisioner should use, not demand-capped rates
        "gen_s_mean": round(sum(r.gen_s for r in records) / len(records), 5),
        "t_train": round(t_train, 4), "t_wait": round(t_wait, 4), "t_publish": round(t_publish, 4),
        "bubble_ratio": round(totals.bubble_ratio, 4),
        "admitted": buffer.stats.admitted, "duplicates": buffer.stats.duplicates,
        "dropped_stale": buffer.stats.dropped_stale,
        "active_workers": control["active_workers"], "standby_workers": control["standby_workers"],
        "fleet_price_per_hour": control["fleet_price_per_hour"],
        "worker_rate_mean": round(control["worker_rate_mean"], 2),
        "worker_busy_rate": round(control["worker_busy_rate"], 2),
        "cost_step_usd": round(control["fleet_price_per_hour"] * (t_train + t_wait) / 3600, 8),
        "rejected": control["rejected"],
        "handbacks": control.get("handbacks", {}),  # docs/preemption.md
        # the control loop's CPU per kind of message, cumulative (learner.cpu, docs/scale.md)
        "control_cpu": control.get("control_cpu", {}),
        "learner_bytes_sent": control["learner_bytes_sent"], "t_bcast": control["t_bcast"],
        "reissued_groups": control["reissued_groups"], **buffer.depth(),
        # learner.grants: leases kept across a restart and the samples admitted under them
        "restored_leases": control["restored_leases"],
        "restored_admitted": control["restored_admitted"],
        # broadcast.reports: relay reports by reason:outcome, probes by outcome (docs/security.md)
        "relay_reports": control.get("relay_reports", {}),
        "relays_marked": control.get("relays_marked", 0),
        **{k: round(v, 5) for k, v in stats.items()},
        "wall_s": round(time.monotonic() - totals.started, 3),
    }


CUT_WARN_SHARE = 0.5  # warn when more than this share of a step's completions were cut
CUT_WARN_EVERY = 50  # ... at most once per this many steps


def cut_share(records: list[Record], max_new_tokens: int, eos_token_id: int | None) -> float | None:
    """Share of single-turn completions that stopped at ``worker.max_new_tokens`` without
    end-of-sequence: answers cut short. None for a batch of multi-turn episodes (their turns
    have their own limit)."""
    single = [r for r in records if r.loss_mask is None]
    if not single:
        return None
    cut = sum(1 for r in single if len(r.completion_ids) >= max_new_tokens
              and (not r.completion_ids or r.completion_ids[-1] != eos_token_id))
    return cut / len(single)


def _summary(cfg: EchoConfig, rows: list[dict[str, Any]], totals: RunTotals,
             ended: str) -> dict[str, Any]:
    """summary.json; ``ended``: how the run ended (complete, stopped by a signal, stalled)."""
    def mean(rs: list[dict[str, Any]]) -> float | None:
        vals = [r["reward_mean"] for r in rs if r.get("reward_mean") is not None]
        return sum(vals) / len(vals) if vals else None

    return {
        "steps": len(rows), "ended": ended, "staleness_budget": cfg.learner.staleness,
        "staleness_max": max((r["staleness_max"] for r in rows), default=None),
        "reward_first10": mean(rows[:10]), "reward_last10": mean(rows[-10:]),
        "bubble_ratio": totals.bubble_ratio, "startup_wait_s": totals.startup_wait,
        "wall_s": time.monotonic() - totals.started, "last": rows[-1] if rows else None,
        "machine": machine_info(),
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


class Terminated(KeyboardInterrupt):
    """SIGTERM, handled as Ctrl-C is (the summary tells the two apart)."""


def _sigterm_as_interrupt(signum: int, frame: Any) -> None:
    raise Terminated


def _previous_ports(run_dir: Path) -> ListenPorts | None:
    """The ports the run's last learner listened on, from its learner.json (one written
    before the ports were recorded gives its control port only)."""
    info = run_dir / "learner.json"
    if not info.exists():
        return None
    doc = json.loads(info.read_text())
    p = doc.get("ports") or {}
    control = int(doc["endpoint"].rsplit(":", 1)[1])
    return ListenPorts(control, int(p.get("chunks", 0)), tuple(p.get("reflectors", (0, 0))),
                       int(p.get("metrics", 0)))


def reuse_ports(cfg: EchoConfig, run_dir: Path) -> None:
    """On resume, listen where the workers knew us: every port the config leaves to the OS
    takes the run's previous one; a port the config fixes stays (docs/ports.md)."""
    previous = _previous_ports(run_dir)
    if previous is None:
        return
    ports = cfg.listen_ports().reusing(previous)
    cfg.learner = cfg.learner.model_copy(update={
        "port": ports.control, "chunk_port": ports.chunks,
        "reflector_ports": list(ports.reflectors)})
    cfg.metrics = cfg.metrics.model_copy(update={"port": ports.metrics})


def run_learner(cfg: EchoConfig, run_dir: Path, resume: bool = False) -> dict[str, Any]:
    policy = Policy(cfg)
    if not policy.par.is_main:
        try:
            policy.follow()  # torchrun ranks > 0: train on their shards, nothing else
        finally:
            policy.par.close()
        return {}
    run_dir.mkdir(parents=True, exist_ok=True)
    _setup_logging(run_dir)
    # The control plane's loop shares the GIL with the training, publisher and log threads:
    # a 1 ms switch interval (default 5 ms) bounds how long a heartbeat waits for it when the
    # trainer runs Python code (benchmarks/load_control.py measures the round trip).
    sys.setswitchinterval(0.001)
    # SIGTERM ends the run like Ctrl-C: workers are told, sockets closed, metrics flushed.
    signal.signal(signal.SIGTERM, _sigterm_as_interrupt)
    if resume:
        reuse_ports(cfg, run_dir)
    (run_dir / "config.toml").write_text(dump_toml(cfg))
    learner = Learner(cfg, run_dir, policy)
    reason = "run complete"
    try:
        learner.start(resume)
        freeze_startup_objects()
        return learner.run()
    except KeyboardInterrupt as stop:
        reason = "learner stopped"
        # a run stopped by hand has a summary too, of the steps it took
        learner.write_summary("stopped (SIGTERM)" if isinstance(stop, Terminated)
                              else "stopped (Ctrl-C)")
        raise
    except LearnerStall as stall:
        learner.write_summary(f"stalled: {stall}")
        raise
    finally:
        learner.close(reason)


def freeze_startup_objects() -> None:
    """Move every object alive after start-up (torch, transformers, the model: about 400,000
    here) out of the garbage collector's reach. A full collection walks every tracked object
    while holding the GIL: 160 ms on this machine, which stalled the control plane's loop and
    was the whole tail of the heartbeat round trip (benchmarks/load_control.py, docs/learner.md).
    Those objects live as long as the process, so nothing collectable is frozen for long."""
    import gc

    gc.collect()
    gc.freeze()


class Learner:
    """Rank 0's side of a run: buffer (with its log), work queue, control plane, checkpoints,
    publication and metrics around the ``Policy``."""

    def __init__(self, cfg: EchoConfig, run_dir: Path, policy: Policy):
        self.cfg, self.run_dir, self.policy = cfg, run_dir, policy
        lc = cfg.learner
        self.adapter = policy.adapter  # built once, with the policy's tokenizer
        # A multi-turn episode carries several generations (and the text between them).
        max_tokens = max(cfg.worker.max_new_tokens,
                         getattr(self.adapter, "max_completion_tokens", 0)
                         if getattr(self.adapter, "multi_turn", False) else 0)
        answers = policy.answer_tokens
        self.limits = Limits(policy.vocab_size, max_tokens, lc.group_size,
                             max_abs_reward=lc.max_abs_reward, min_logprob=lc.min_behaviour_logprob,
                             answer_tokens=frozenset(answers) if answers is not None else None)
        self.buffer = ReplayBuffer(lc.staleness, cfg.buffer.capacity_groups, lc.group_size,
                                   on_drop=self._audit_drop)
        self.log = BufferLog(run_dir / "buffer.log", fsync=lc.fsync, fsync_delay_s=lc.fsync_delay_s,
                             group_commit=lc.group_commit)
        self.prompt_rng = random.Random(cfg.seed)
        self.key = load_or_create_key(run_dir)
        self.run_id = run_dir.name
        self.control: LearnerServer | None = None
        self.totals = RunTotals()
        self.step = 0  # next step to run
        self.rows: list[dict[str, Any]] = []
        self.t_train_ewma: float | None = None
        self.metrics = (LearnerMetrics(learner_price_per_hour=lc.price_per_hour, run_id=self.run_id)
                        if cfg.metrics.enabled else None)
        self.metrics_server: Any = None
        self.publish_refused = 0  # snapshots not published because a tensor was not finite
        self.struck: Counter[str] = Counter()  # worker id -> records behind skipped updates
        self._cut_warned = -CUT_WARN_EVERY  # step of the last "completions cut" warning

    def _audit(self, name: str, entry: dict[str, Any]) -> None:
        """Append-only audit trails (consumed.jsonl, dropped.jsonl), keyed by step so a
        resume can set aside what the crash undid."""
        with (self.run_dir / f"{name}.jsonl").open("a") as f:
            f.write(json.dumps({"step": self.step, **entry}) + "\n")

    def _audit_drop(self, records: list[Record], rule: str) -> None:
        self._audit("dropped", {"rule": rule, "pairs": [[r.group_id, r.sample_idx] for r in records]})

    # ------------------------------------------------------------------ start / restore

    def start(self, resume: bool) -> None:
        lc = self.cfg.learner
        instance = os.urandom(3).hex()  # group ids never repeat across restarts
        self.work = WorkQueue(self.adapter.prompts(self.prompt_rng), group_size=lc.group_size,
                              max_outstanding=min(lc.effective_outstanding, self.cfg.buffer.capacity_groups),
                              lease_timeout_s=lc.lease_timeout_s, prefix=f"{self.run_id}.{instance}",
                              secret=hashlib.sha256(b"echo group seeds" + self.key.private_bytes()).digest())
        if resume:
            self._restore()
        self._open_journal()
        self.auditor = Auditor(self.cfg, self.policy.tokenizer, self._report,
                               lambda w: w in self.control.reputation.quarantined if self.control else False,
                               answer_tokens=self.policy.answer_tokens, **self._audit_in_policy())
        self.control = LearnerServer(self.cfg, run_id=self.run_id, key=self.key, buffer=self.buffer,
                                    work=self.work, limits=self.limits, buffer_log=self.log,
                                    run_dir=self.run_dir, adapter=self.adapter,
                                    audit=self.auditor.submit, step=lambda: self.step)
        if resume:
            self.control.members.restore_fleet()
        self._hold_base()
        self.control.start()
        bc = self.cfg.broadcast
        self.publisher = Publisher(VersionEncoder(
            run_id=self.run_id, key=self.key, chunk_size=bc.chunk_kib * 1024, dtype=bc.dtype,
            delta=bc.delta, keyframe_every=bc.keyframe_every, max_ratio=bc.delta_max_ratio,
            base_model=self.policy.base_hash),
            self.control.publish, background=bc.publish_thread)
        join = self.control.join_line()
        info = {"endpoint": self.control.endpoint, "snapshot_endpoint": self.control.snapshot_endpoint,
                "join": join, "public_key": (self.control.public_key or b"").decode(),
                "ports": self.control.bound_ports()}
        if self.metrics is not None:
            port = self.cfg.listen_ports().metrics
            try:
                self.metrics_server = self.metrics.serve(self.cfg.metrics.host, port)
            except OSError as exc:
                raise port_taken("metrics.port", self.cfg.metrics.host, port, exc) from None
            info["ports"]["metrics"] = self.metrics_server.address[1]
            self.metrics.accounts_source = self.control.accounts.export  # live per scrape
            self.metrics.tree_source = self.control.relay_tree  # live per scrape and poll
            info["metrics"] = self.metrics_server.url
            for r in self.rows:  # after --resume: cost and curves continue
                self.metrics.update(r, {})
            log.info("dashboard and /metrics at %s", self.metrics_server.url)
        (self.run_dir / "learner.json").write_text(json.dumps(info))
        # The join line carries the learner's public key: workers pin it (docs/security.md).
        print(READY_PREFIX + join, flush=True)
        # The line an operator copies, on the terminal (README "Running for real" quotes it).
        words = (f"echo-worker join '{join}?token=TOKEN' (a token: echo-rl token create "
                 f"--run-dir {self.run_dir})" if self.cfg.security.join == "token"
                 else f"echo-worker join '{join}'")
        print(f"workers join with: {words}", file=sys.stderr, flush=True)
        log.info("workers join with: %s", words)
        log.info("learner up at %s, run %s, step %d, kappa=%d, ranks=%d", self.control.endpoint,
                 self.run_id, self.step, lc.effective_kappa, self.policy.par.world)
        if self.policy.lora_note:
            log.info("%s", self.policy.lora_note)
        self._say_memory_plan()
        _, full = self.policy.command({"op": "sync"})
        assert full is not None
        if not resume or self.step == 0:
            self._checkpoint(full)
        self._publish(self.step, full[0])
        self.publisher.flush()  # workers that join now get a snapshot at once
        if self.rows:  # after --resume: the capacity the run needed, from its own history
            self._provisioning(None, self.rows[-1].get("t_bcast") or 0.0)

    def _open_journal(self) -> None:
        """Leases from here on go to the grant journal (``learner.grants``), which starts
        with the leases open now (restored ones included)."""
        journal = GrantJournal(self.run_dir / "grants.jsonl")
        journal.compact([Lease(it.group, it.worker_id, it.key) for it in self.work.issued.values()])
        self.work.journal = journal

    def _report(self, verdict: Any) -> None:
        if self.control is not None:
            self.control.report(verdict)

    def _restore(self) -> None:
        ckpt = load_checkpoint(self.run_dir)
        last = ckpt["step"] if ckpt else -1
        admitted, consumed, aside = scan_log(self.run_dir / "buffer.log", self.limits)
        live, trained = live_after(admitted, consumed, last)
        live, out = without_quarantined(live, security_dir(self.run_dir))
        aside += out
        if ckpt:
            self.policy.command({"op": "load", "state": ckpt})
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
        self.log.compact(lambda: live)
        self._trim_audit()
        if ckpt and ckpt.get("row") and not any(r["step"] == last for r in self.rows):
            self._restore_row(ckpt["row"])
        log.info("resumed at step %d: %d buffered records restored, %d groups already trained",
                 self.step, len(live), len(trained))

    def _restore_leases(self, live: list[Record], trained: set[str]) -> None:
        """Leases open at the crash come back bound to their holders (``learner.grants``),
        but for groups already trained or whole in the restored buffer."""
        leases, bad = load_grants(self.run_dir / "grants.jsonl")
        counts = Counter(r.group_id for r in live)
        done = (trained | self._trained_groups()
                | {g for g, n in counts.items() if n >= self.cfg.learner.group_size})
        kept = open_leases(leases, done)
        self.work.restore_leases(kept)
        self.work.forget(done)
        # A banned holder never delivers (intake refuses it): its groups are handed out at
        # once, not held for lease_timeout_s (15 minutes in examples/public.toml, a stalled run).
        bans = KeyList(security_dir(self.run_dir) / "bans.txt")
        banned = {(lease.worker_id, lease.key) for lease in kept if lease.key and lease.key in bans}
        freed = sum(self.work.release_worker(wid, key) for wid, key in banned)
        log.info("resume: %d lease(s) restored from grants.jsonl (%d finished, %d of banned "
                 "keys handed out again, %d unreadable line(s) skipped)", len(kept) - freed,
                 len(leases) - len(kept), freed, bad)

    def _trained_groups(self) -> set[str]:
        """Groups the restored steps trained on (``consumed.jsonl``; the buffer log forgets
        them at each checkpoint's compaction)."""
        path = self.run_dir / "consumed.jsonl"
        if not path.exists():
            return set()
        rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
        return {g for r in rows if r["step"] < self.step for g in r["groups"]}

    def _set_aside(self, aside: list[Any]) -> None:
        """Log entries that cannot be replayed go to buffer.log.rejected, counted under
        ``set_aside_on_resume``; the resume goes on without them."""
        if not aside:
            return
        path = quarantine(self.run_dir / "buffer.log", aside)
        self.buffer.stats.rejected["set_aside_on_resume"] += len(aside)
        log.error("resume: %d buffer log entr%s set aside into %s (%s)", len(aside),
                  "y" if len(aside) == 1 else "ies", path, dict(Counter(a.reason for a in aside)))

    def _trim_audit(self) -> None:
        """Steps after the checkpoint were lost with the crash: set their lines aside."""
        for name in ("metrics", "consumed", "dropped", "nonfinite"):
            path = self.run_dir / f"{name}.jsonl"
            if not path.exists():
                continue
            rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
            keep = [r for r in rows if r["step"] < self.step]
            lost = [r for r in rows if r["step"] >= self.step]
            if lost:
                with (self.run_dir / f"{name}.lost.jsonl").open("a") as f:
                    f.writelines(json.dumps(r) + "\n" for r in lost)
            path.write_text("".join(json.dumps(r) + "\n" for r in keep))
            if name == "metrics":
                self.rows = keep

    def _restore_row(self, row: dict[str, Any]) -> None:
        """The crash came after the checkpoint and before the step's metrics line."""
        self.rows.append(row)
        with (self.run_dir / "metrics.jsonl").open("a") as f:
            f.write(json.dumps(finite_or_null(row)[0], allow_nan=False) + "\n")
        log.info("metrics line of step %d restored from the checkpoint (t_publish unknown: 0)",
                 row["step"])

    def _hold_base(self) -> None:
        """A LoRA run on a model folder publishes that folder, signed and chunked, to workers
        that lack it (broadcast.basemodel); the built-in tiny model is built by every worker."""
        from broadcast.basemodel import build_base_manifest
        from broadcast.snapshot import SnapshotError

        name = self.cfg.model.name
        if self.policy.base_hash is None or name == TINY:
            return
        try:
            manifest, payload = build_base_manifest(
                run_id=self.run_id, base_model=self.policy.base_hash,
                folder=Path(name).expanduser(), chunk_size=self.cfg.broadcast.chunk_kib * 1024,
                key=self.key)
        except SnapshotError as err:  # no safetensors file, too many files
            log.warning("base model not published to workers (%s): each worker needs it at "
                        "model.name = %r on its own machine", err, name)
            return
        size = len(payload)
        if self.cfg.learner.spill_payloads:  # served for the whole run: a file, not RAM
            from echo.spill import spill

            payload = spill(payload, spill_dir(self.run_dir / "spill"))
        self.control.hold_base(manifest, payload)
        log.info("base model %s... published for workers without it: %d files, %d bytes, "
                 "%d chunks", self.policy.base_hash[:16], len(manifest["files"]), size,
                 len(manifest["chunk_hashes"]))

    # ------------------------------------------------------------------ checkpoint / publish

    def _checkpoint(self, full: FullState, row: dict[str, Any] | None = None) -> None:
        work, prompt_rng = self.control.work_state(self.prompt_rng)
        save_checkpoint(self.run_dir, self.step - 1, {
            "step": self.step - 1, "model": full[0], "optimizer": full[1], "row": row,
            **self.policy.rng_state(), "prompt_rng": prompt_rng,
            "work": work, "buffer_stats": self.buffer.stats_copy(), "totals": self.totals,
            "wall_s": time.monotonic() - self.totals.started,
        })
        # Everything consumed so far is now inside the checkpoint: the log keeps only the
        # records still owed to training.
        self.log.compact(self.buffer.contents)

    def _state_finite(self, version: int, model_sd: dict[str, Any]) -> bool:
        """A snapshot with a NaN or inf would break every worker that installs it: refuse it,
        loudly; the workers keep the previous version."""
        bad = [n for n, t in self.policy.named_tensors(model_sd)
               if t.is_floating_point() and not bool(torch.isfinite(t).all())]
        if bad:
            self.publish_refused += 1
            log.error("version %d NOT published (nor checkpointed): non-finite values in %d "
                      "tensor(s), first %s; workers keep the previous version", version,
                      len(bad), bad[:3])
        return not bad

    def _publish(self, version: int, model_sd: dict[str, Any]) -> None:
        if self._state_finite(version, model_sd):
            self._send_snapshot(version, model_sd)

    def _send_snapshot(self, version: int, model_sd: dict[str, Any]) -> None:
        """Hand the version to the publisher thread (it encodes, signs and publishes); the
        caller has checked that the state is finite."""
        named, dtype = self.policy.named_tensors(model_sd), self.cfg.broadcast.dtype
        if self.cfg.learner.spill_payloads:  # written tensor by tensor: never whole in RAM
            tensors, payload = params_to_spill(named, dtype, spill_dir(self.run_dir / "spill"))
        else:
            tensors, payload = params_to_payload(named, dtype)
        self.auditor.add_snapshot(version, tensors, payload)  # the bytes workers install
        self.publisher.submit(version, tensors, payload)

    def _publication_row(self) -> dict[str, Any]:
        """The newest publication: what it sent, against the full payload, and its costs."""
        pub = self.publisher.last
        if pub is None:
            return {}
        return {"publish_encoding": pub.manifest["encoding"], "publish_bytes": len(pub.payload),
                "publish_full_bytes": len(pub.result), "delta_ratio": round(pub.stats.ratio, 5),
                "delta_changed": round(pub.stats.changed_fraction, 6),
                "encode_s": round(pub.build_s, 4), "keyframes_published": self.publisher.keyframes}

    # ------------------------------------------------------------------ the step loop

    def run(self) -> dict[str, Any]:
        with (self.run_dir / "metrics.jsonl").open("a") as metrics:
            while self.step < self.cfg.learner.max_steps:
                row = self._one_step()
                self.rows.append(row)
                metrics.write(json.dumps(row, allow_nan=False) + "\n")  # _finite_row made it so
                metrics.flush()
        self.publisher.flush()
        return self.write_summary("complete")

    def write_summary(self, ended: str) -> dict[str, Any]:
        """summary.json, whole or not at all (a second Ctrl-C may come while it is written)."""
        summary = _summary(self.cfg, self.rows, self.totals, ended)
        tmp = self.run_dir / "summary.json.tmp"
        tmp.write_text(json.dumps(finite_or_null(summary)[0], indent=2, allow_nan=False))
        tmp.replace(self.run_dir / "summary.json")
        return summary

    def _one_step(self) -> dict[str, Any]:
        lc, step = self.cfg.learner, self.step
        version = step  # one version per learner step
        t0 = time.monotonic()
        assert self.control is not None
        self.control.waiting(True)  # the provisioner's liveness rule (provisioning/controller.py)
        try:
            groups = self.buffer.take(lc.prompts_per_step, timeout=lc.wait_timeout_s)
        finally:
            self.control.waiting(False)
        if groups is None:
            raise LearnerStall(
                f"no {lc.prompts_per_step} admissible groups within {lc.wait_timeout_s}s at "
                f"version {version}: are workers connected? (learner.wait_timeout_s)")
        self.log.consumed(step, [g[0].group_id for g in groups])
        self._audit("consumed", {"groups": [g[0].group_id for g in groups]})
        t1 = time.monotonic()
        publish = (step + 1) % lc.effective_kappa == 0
        batch = self.adapter.materialise(groups, lc.adv_eps, scale_rewards=lc.scale_rewards)
        stats, full = self.policy.command({"op": "step", "sync": publish, "batch": batch})
        t2 = time.monotonic()
        if stats.get("skipped_nonfinite"):
            self._strike(groups, self.policy.trainer.nonfinite_rows)
        self.totals.add(step, t1 - t0, t2 - t1)
        self.step += 1
        self.buffer.set_version(self.step)
        assert self.control is not None
        control = self.control.stats()
        row = self._finite_row(_metrics_row(step, version, groups, stats, t1 - t0, t2 - t1, 0.0,
                                            self.totals, self.buffer, control))
        row["completions_cut"] = self._cut(step, [r for g in groups for r in g])
        if full is not None and self._state_finite(self.step, full[0]):
            # The row goes into the checkpoint too: a crash between the checkpoint and the
            # metrics line would otherwise lose the line of a step the resumed run skips.
            if lc.checkpoint:
                self._checkpoint(full, row)  # before publishing: no worker runs ahead of it
            self._send_snapshot(self.step, full[0])
        row["t_publish"] = round(time.monotonic() - t2, 4)
        row["publish_refused"] = self.publish_refused
        row.update(self._publication_row())
        row.update(decode_s=control["decode_s"], keyframe_installs=control["keyframes"])
        row.update(self._audits(t2 - t1))
        trim()  # the step's and the audits' freed transients go back to the kernel
        row["memory"] = self._memory()
        self._provisioning(t2 - t1, control["t_bcast"] or 0.0)
        if self.metrics is not None:
            self.metrics.update(row, control)
        return row

    def _cut(self, step: int, records: list[Record]) -> float | None:
        """The step's share of cut completions, with a warning when most were cut: nothing
        else would say that worker.max_new_tokens is too small for the task."""
        max_new = self.cfg.worker.max_new_tokens
        share = cut_share(records, max_new, self.policy.tokenizer.eos_token_id)
        if share is not None and share > CUT_WARN_SHARE and step - self._cut_warned >= CUT_WARN_EVERY:
            self._cut_warned = step
            log.warning("step %d: %.0f%% of completions stopped at worker.max_new_tokens = %d "
                        "without end-of-sequence: answers are being cut short. Raise it for this "
                        "task ([adapter.presets.%s.generation] max_new_tokens, or --set "
                        "worker.max_new_tokens=N; docs/config.md)", step, 100 * share, max_new,
                        self.cfg.adapter.name)
        return None if share is None else round(share, 4)

    def _audit_in_policy(self) -> dict[str, Any]:
        """security.audit_model = "policy": audits borrow the trainer's model between steps,
        where that model is one plain float32 module (one process, on the CPU)."""
        par = self.policy.par
        if self.cfg.security.audit_model != "policy" or par.world > 1 or par.device.type != "cpu":
            return {}
        return {"borrow": self.policy.model, "spill_to": spill_dir(self.run_dir / "spill")}

    def _say_memory_plan(self) -> None:
        """What the run needs in host memory (echo/memplan.py), and what a budget changed."""
        plan, lc = self.policy.memory_plan, self.cfg.learner
        budget = f" (learner.host_memory_gb = {lc.host_memory_gb:g})" if lc.host_memory_gb else ""
        log.info("memory: this run needs %s%s", plan.describe(), budget)
        if self.policy.memory_refit:
            log.warning("memory: to fit learner.host_memory_gb = %g, gradient checkpointing is on and "
                        "%d rows go through the model at a time (learner.micro_batch_rows = %d)",
                        lc.host_memory_gb, plan.rows, lc.micro_batch_rows)

    def _memory(self) -> dict[str, int]:
        """Where the learner's memory goes (docs/memory.md): its resident set, the training
        state, the audit model, and the published versions it holds (in RAM or spilled)."""
        from echo.memstat import payload_bytes, resident, tensor_bytes

        model, opt = self.policy.model, self.policy.trainer.optimizer
        base = self.publisher.encoder._base
        held = payload_bytes(self.control.payloads() + self.auditor.payloads()
                             + ([base[2]] if base else []))
        return {**resident(), "model": tensor_bytes(model.parameters()),
                "grads": tensor_bytes(p.grad for p in model.parameters()),
                "optimizer": tensor_bytes(t for st in opt.state.values() for t in st.values()
                                          if hasattr(t, "untyped_storage")),
                "audit_model": tensor_bytes(self.auditor.model_tensors()),
                "payloads_ram": held["ram"], "payloads_spilled": held["spilled"]}

    def _audits(self, t_train: float) -> dict[str, Any]:
        """Audit waiting groups for at most ``security.audit_budget`` of the learner's time
        (audit / (train + audit) <= budget); their cost goes into the metrics row."""
        share = self.cfg.security.audit_budget
        used = self.auditor.run(share / (1 - share) * t_train if share < 1 else float("inf"))
        a = self.auditor
        return {"t_audit": round(used, 4), "audits": a.done, "audit_failures": a.failed,
                "audit_queue": a.waiting, "audits_dropped": a.dropped, "audits_expired": a.expired}

    def _finite_row(self, row: dict[str, Any]) -> dict[str, Any]:
        """NaN and inf are not JSON (and not numbers a reader can plot): written as null and
        counted in the row's ``nonfinite_values``."""
        clean, n = finite_or_null(row)
        if n:
            log.warning("step %s: %d non-finite metric value(s) written as null", row["step"], n)
        clean["nonfinite_values"] = n
        return clean

    def _strike(self, groups: list[list[Record]], rows: list[int]) -> list[str]:
        """Trace the rows behind skipped non-finite updates to their groups and senders:
        logged, written to ``nonfinite.jsonl``, counted in ``self.struck``; returned."""
        records = [r for g in groups for r in g]
        culprits = [records[i] for i in sorted(set(rows)) if 0 <= i < len(records)]
        workers = sorted({r.worker_id for r in culprits})
        gids = sorted({r.group_id for r in culprits})
        self.struck.update(r.worker_id for r in culprits)
        self._audit("nonfinite", {"groups": gids, "workers": workers})
        log.error("step %d: update(s) skipped for non-finite loss/gradient; behind them %d "
                  "group(s) %s from worker(s) %s", self.step, len(gids), gids[:5], workers)
        return workers

    def _provisioning(self, t_train: float | None, t_bcast: float) -> None:
        """Tell the controller what capacity the learner needs now (docs/design.md §4), and record the
        decisions it took since the last step. ``t_train`` None: after ``--resume``, from the
        run's own history (the restored metrics rows), so a restarted learner knows its
        mu_req before its first step."""
        assert self.control is not None
        lc = self.cfg.learner
        for t in ([r["t_train"] for r in self.rows if r.get("t_train")] if t_train is None
                  else [t_train]):
            self.t_train_ewma = t_train_average(self.t_train_ewma, t)
        if self.t_train_ewma is None:
            return
        try:
            need = mu_req(lc.prompts_per_step * lc.group_size, lc.effective_kappa,
                          self.t_train_ewma, t_bcast)
        except Infeasible as err:
            log.warning("%s", err)
            need = None
        self.control.set_requirement(need)
        while self.control.members.decisions:
            d = self.control.members.decisions.pop(0)
            entry = {"action": d.action, "worker": d.worker_id, "reason": d.reason,
                     "c_eff": d.c_eff, "target": d.target, "mu_req": need}
            self._audit("decisions", entry)
            if self.metrics is not None:
                self.metrics.add_decision({"step": self.step, **entry})

    def close(self, reason: str) -> None:
        if getattr(self, "publisher", None) is not None:
            self.publisher.close()
        if self.metrics_server is not None:
            self.metrics_server.close()
        if self.control is not None:
            self.control.shutdown(reason)
        self.log.close()
        work = getattr(self, "work", None)
        if work is not None and work.journal is not None:
            work.journal.close()
        self.policy.close()
