"""A trained version's way to the workers: checked finite (a NaN would break every worker
that installs it), handed to the auditor (the bytes workers install, for the audits) and to the
publisher thread (``echo_rl.learner.publisher``: encode, sign, publish). And the base model a LoRA run
on a model folder serves to workers that lack it.
"""

from __future__ import annotations

import logging
import mmap
from collections.abc import Callable
from pathlib import Path

import torch

from echo_rl.broadcast.base_manifest import BaseManifest
from echo_rl.broadcast.snapshot import RunKey, Snapshot
from echo_rl.broadcast.versions import VersionEncoder
from echo_rl.control.auditor import Auditor
from echo_rl.core import stopping
from echo_rl.core.config import EchoConfig, LearnerConfig
from echo_rl.core.models import TINY, params_to_payload, params_to_spill, rounding_seed
from echo_rl.core.spill import spill_dir
from echo_rl.core.steprow import PUBLISH_FIELDS, StepRow
from echo_rl.learner.checkpoint import CheckpointExtra, CheckpointState, save_checkpoint
from echo_rl.learner.parallel.base import FullState, ModelState
from echo_rl.learner.policy import Policy
from echo_rl.learner.publisher import Publisher
from echo_rl.learner.releasing import ReleaseThread, Version

log = logging.getLogger("echo.learner")


def release_threaded(lc: LearnerConfig, device: torch.device) -> bool:
    """``learner.release_thread``: auto is on for a GPU step, which leaves the host's cores
    idle; on the CPU the step and the workers beside it use them (docs/learner.md,
    "Durability and resume"). It places the publication's build (the publisher thread) too."""
    return lc.release_thread == "on" or (lc.release_thread == "auto" and device.type == "cuda")


class Releaser:
    """Each version's way out after its step: checkpointed (``learner.checkpoint``), then
    published, on the training thread or, with ``threaded`` (``learner.release_thread``), on
    the release thread (echo_rl/learner/releasing.py) while the next step trains. ``state(row)``: what
    a checkpoint holds besides the model and optimizer, read on the training thread as the step
    left it; ``compact_log()``: drop from the buffer log what checkpoints hold, called only
    where the newest checkpoint holds every step taken; ``saved(steps, path)``: a checkpoint
    is written (the held-out evaluation's cue, echo_rl/learner/heldout.py), on the thread that wrote it."""

    # With the thread lagging, the log is compacted at least every this many steps.
    COMPACT_EVERY = 10

    def __init__(
        self,
        run_dir: Path,
        release: Release,
        *,
        checkpoint: bool,
        threaded: bool,
        state: Callable[[StepRow | None], CheckpointExtra],
        compact_log: Callable[[], None],
        saved: Callable[[int, Path], None] | None = None,
    ):
        self.run_dir, self.release, self.checkpoint = run_dir, release, checkpoint
        self._state, self._compact_log = state, compact_log
        self._saved = saved
        self.thread = ReleaseThread(self._finite, self._save, self._send) if threaded else None
        self.compacted = 0  # steps the log was last compacted after (threaded)

    def release_version(self, steps: int, full: FullState, row: StepRow) -> None:
        """The version after ``steps`` steps; ``full`` as ``live`` asked the policy for it."""
        if self.thread is not None:  # frozen in host copies, then released on the thread
            model, optimizer = self.thread.freeze(*full)
            self.thread.submit(Version(steps, model, optimizer, self.checkpoint, self._state(row)))
        elif self.release.finite(steps, full[0]):
            # The row goes into the checkpoint too: a crash between the checkpoint and the
            # metrics line would otherwise lose the line of a step the resumed run skips.
            if self.checkpoint:
                self.save_now(steps, full, row)  # before publishing: no worker runs ahead of it
            self.release.send(steps, full[0])

    @property
    def live(self) -> bool:
        """Whether the policy may hand its state over as it lives (the thread copies it)."""
        return self.thread is not None

    def save_now(self, steps: int, full: FullState, row: StepRow | None = None) -> None:
        """The checkpoint after ``steps`` steps, on this thread, then the log compacted: every
        record consumed is inside it."""
        # Whole or not at all: a stop inside torch.save left its zip writer failing in
        # __exit__, a RuntimeError in place of the stop (exit 1, no summary).
        with stopping.uninterrupted():
            state: CheckpointState = {"model": full[0], "optimizer": full[1], **self._state(row)}
            path = save_checkpoint(self.run_dir, steps - 1, state)
            self._compact_log()
        if self._saved is not None:
            self._saved(steps, path)

    def compact(self, steps: int) -> None:
        """Threaded, before a step takes its groups, ``steps`` taken: compact the log if the
        newest checkpoint holds them all; after ``COMPACT_EVERY`` steps without, wait once."""
        t = self.thread
        if t is None or not self.checkpoint or self.compacted == steps:
            return
        if t.checkpointed != steps and steps - self.compacted >= self.COMPACT_EVERY:
            t.flush()
        if t.checkpointed == steps:
            self._compact_log()
            self.compacted = steps

    def describe(self, row: StepRow) -> None:
        """The thread's time on the newest version and the host copy it reads from."""
        if self.thread is not None:
            row.release_s = None if self.thread.last_s is None else round(self.thread.last_s, 4)
            if row.memory is not None:
                row.memory["release_copy"] = self.thread.mirror.nbytes

    def flush(self) -> None:
        if self.thread is not None:
            self.thread.flush()

    def close(self) -> None:
        """The version in flight finishes: its checkpoint whole."""
        if self.thread is not None:
            self.thread.close()

    def _finite(self, v: Version) -> bool:
        return self.release.finite(v.steps, v.model)

    def _save(self, v: Version) -> None:
        assert v.extra is not None  # the releaser's versions carry it
        state: CheckpointState = {"model": v.model, "optimizer": v.optimizer, **v.extra}
        path = save_checkpoint(self.run_dir, v.steps - 1, state)
        if self._saved is not None:
            self._saved(v.steps, path)

    def _send(self, v: Version) -> None:
        self.release.send(v.steps, v.model)


class Release:
    def __init__(
        self, cfg: EchoConfig, run_dir: Path, policy: Policy, auditor: Auditor, publisher: Publisher
    ):
        self.cfg, self.run_dir, self.policy = cfg, run_dir, policy
        self.auditor = auditor
        self.publisher = publisher
        self.refused = 0  # snapshots not published because a tensor was not finite

    def finite(self, version: int, model_sd: ModelState) -> bool:
        """A snapshot with a NaN or inf would break every worker that installs it: refuse it,
        loudly; the workers keep the previous version."""
        bad = [
            n
            for n, t in self.policy.named_tensors(model_sd)
            if t.is_floating_point() and not bool(torch.isfinite(t).all())
        ]
        if bad:
            self.refused += 1
            log.error(
                "version %d NOT published (nor checkpointed): non-finite values in %d "
                "tensor(s), first %s; workers keep the previous version",
                version,
                len(bad),
                bad[:3],
            )
        return not bad

    def publish(self, version: int, model_sd: ModelState) -> None:
        if self.finite(version, model_sd):
            self.send(version, model_sd)

    def send(self, version: int, model_sd: ModelState) -> None:
        """Hand the version to the publisher thread (it encodes, signs and publishes); the
        caller has checked that the state is finite."""
        named, dtype = self.policy.named_tensors(model_sd), self.cfg.broadcast.dtype
        seed = rounding_seed(self.cfg.seed, self.cfg.broadcast.rounding, version)
        if self.cfg.learner.spill_payloads:  # written tensor by tensor: never whole in RAM
            where = spill_dir(self.run_dir / "spill")
            tensors, payload = params_to_spill(named, dtype, where, seed)
        else:
            tensors, payload = params_to_payload(named, dtype, seed)
        self.auditor.add_snapshot(version, tensors, payload)  # the bytes workers install
        self.publisher.submit(version, tensors, payload)

    def describe(self, row: StepRow) -> None:
        """The newest publication in the step's row: what it sent, against the full payload,
        and its costs; none of it before the first publication."""
        pub = self.publisher.last
        if pub is None:
            row.leave_out(PUBLISH_FIELDS)
            return
        row.publish_encoding = pub.manifest.encoding
        row.publish_bytes, row.publish_full_bytes = len(pub.payload), len(pub.result)
        row.delta_ratio = round(pub.stats.ratio, 5)
        row.delta_changed = round(pub.stats.changed_fraction, 6)
        row.encode_s, row.keyframes_published = round(pub.build_s, 4), self.publisher.keyframes


def run_publisher(
    cfg: EchoConfig, run_id: str, key: RunKey, policy: Policy, publish: Callable[[Snapshot], None]
) -> Publisher:
    """The run's publisher: versions encoded as ``broadcast`` says (chunks, dtype, deltas and
    their keyframes), signed with the run's key, naming the base model they train; built on a
    thread of its own where the release is threaded (``release_threaded``), else on the
    training thread."""
    bc = cfg.broadcast
    return Publisher(
        VersionEncoder(
            run_id=run_id,
            key=key,
            chunk_size=bc.chunk_bytes,
            dtype=bc.dtype,
            delta=bc.delta,
            keyframe_every=bc.keyframe_every,
            max_ratio=bc.delta_max_ratio,
            base_model=policy.base_hash,
        ),
        publish,
        threaded=release_threaded(cfg.learner, policy.par.device),
    )


def base_model(
    cfg: EchoConfig, policy: Policy, run_id: str, key: RunKey, run_dir: Path
) -> tuple[BaseManifest, bytes | bytearray | mmap.mmap] | None:
    """A LoRA run on a model folder publishes that folder, signed and chunked, to workers
    that lack it (echo_rl.broadcast.basemodel): its (manifest, payload), to hold before the server
    starts; None for the built-in tiny model, which every worker builds."""
    from echo_rl.broadcast.basemodel import build_base_manifest
    from echo_rl.broadcast.snapshot import SnapshotError

    name = cfg.model.name
    if policy.base_hash is None or name == TINY:
        return None
    payload: bytes | bytearray | mmap.mmap
    try:
        manifest, payload = build_base_manifest(
            run_id=run_id,
            base_model=policy.base_hash,
            folder=Path(name).expanduser(),
            chunk_size=cfg.broadcast.chunk_bytes,
            key=key,
        )
    except SnapshotError as err:  # no safetensors file, too many files
        log.warning(
            "base model not published to workers (%s): each worker needs it at "
            "model.name = %r on its own machine",
            err,
            name,
        )
        return None
    size = len(payload)
    if cfg.learner.spill_payloads:  # served for the whole run: a file, not RAM
        from echo_rl.core.spill import spill

        payload = spill(payload, spill_dir(run_dir / "spill"))
    log.info(
        "base model %s... published for workers without it: %d files, %d bytes, %d chunks",
        policy.base_hash[:16],
        len(manifest.files),
        size,
        manifest.layout.num_chunks,
    )
    return manifest, payload
