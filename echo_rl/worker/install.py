"""Snapshots into the model: the feed's newest rebuilt version installed between rollouts, the
install reported to the learner, a LoRA run's base model obtained and checked.

The ``Installer`` owns what the worker generates with (``Held``: backend, adapter, installed
version) and the snapshot feed (echo_rl/worker/snapshots.py) that fetches, relays and rebuilds each
published version beside generation.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from contextlib import AbstractAsyncContextManager, nullcontext
from dataclasses import dataclass, replace
from typing import Any

from echo_rl.broadcast.base_manifest import BaseManifest
from echo_rl.broadcast.basemodel import verify_base_manifest
from echo_rl.broadcast.fetch import FetchStats
from echo_rl.broadcast.manifest import Manifest
from echo_rl.broadcast.memory import trim
from echo_rl.broadcast.relay import Relay
from echo_rl.broadcast.snapshot import SnapshotError, verify_manifest
from echo_rl.broadcast.tickets import Source
from echo_rl.core import wire
from echo_rl.core.client import RequestTimeout
from echo_rl.core.lora import base_problem
from echo_rl.core.models import ModelError
from echo_rl.data.adapter import Adapter
from echo_rl.worker.backends import Backend
from echo_rl.worker.base import BaseResult, obtain_base, refuse
from echo_rl.worker.lifecycle import Activity
from echo_rl.worker.model import LoadChoice, load_model
from echo_rl.worker.session import Session, WorkerError
from echo_rl.worker.sharing import DeviceSeat
from echo_rl.worker.snapshots import SnapshotFeed
from echo_rl.worker.status import InstallProgress, StatusBoard

log = logging.getLogger("echo.worker")


@dataclass
class Held:
    """The model this worker generates with, and the snapshot version installed in it."""

    backend: Backend | None = None
    adapter: Adapter | None = None
    version: int = -1


def check_base(manifest: Manifest, backend: Backend, model_name: str) -> None:
    """A LoRA version applies to the base model it names, and to no other: a worker holding
    another base could only generate from a model nobody trained (fatal, with the fix)."""
    problem = base_problem(manifest.version, manifest.base_model, backend.base_hash, model_name)
    if problem:
        raise WorkerError(problem)


class Installer:
    def __init__(
        self,
        session: Session,
        relay: Relay,
        *,
        status: StatusBoard,
        activity: Activity,
        progress: InstallProgress,
        choice: LoadChoice,
        seat: DeviceSeat | None = None,
    ):
        """``seat``: this run's turns on the device (echo_rl/worker/sharing.py): installs take
        its turn, and the load asks it whether models will be parked (vLLM then builds its
        engine for sleep); None: the device is this run's alone."""
        self.session, self.relay, self.status = session, relay, status
        self.activity, self.progress, self.choice = activity, progress, choice
        self.held = Held()
        self.feed = SnapshotFeed(
            relay, self.ask_source, self.report_install, on_ready=self._snapshot_ready
        )
        self.new_snapshot = asyncio.Event()  # the feed rebuilt a version to install
        self.version_bytes = (0, "bfloat16")  # the run's full version: size and dtype, at join
        self.device_turn: Callable[[], AbstractAsyncContextManager[Any]] = (
            nullcontext if seat is None else seat.turn
        )
        # the device's Turns.parks, at load
        self.parks: Callable[[], bool] = (lambda: False) if seat is None else seat.parks
        self.base_offer: dict[str, Any] | None = None  # a LoRA run's base, as the join said
        # the base obtained (verified; echo_rl.worker.base): what the loaded model must hash to
        self.base_manifest: BaseManifest | None = None
        self.base: BaseResult | None = None  # where this worker's base model came from

    def _snapshot_ready(self) -> None:
        self.progress.received()
        self.new_snapshot.set()

    def joined(self, ack: wire.JoinAck, restarted: bool, new_run: bool) -> None:
        """What a join means for the snapshots held: another run (or one that went back in
        versions) makes them worthless, and the join names the version to fetch."""
        # A learner resumed after a crash (--resume) publishes again from its checkpoint's
        # step: versions from ack.version on may hold other bytes than the crashed instance's.
        republished = restarted and max(self.held.version, self.feed.newest_held()) >= ack.version
        if new_run or ack.version < self.held.version or republished:
            # What we hold is not this run's policy, and what our relay holds must not be
            # served under that run's version numbers.
            self.held.version = -1
            self.feed.reset()
        self.feed.joined(ack.learner_snapshot_endpoint)
        self.base_offer = ack.base_manifest  # verified by obtain_base, before the model loads
        manifest = self._verified(ack.version, ack.manifest) if ack.manifest is not None else None
        self.version_bytes = (
            (manifest.result_size, manifest.dtype) if manifest is not None else (0, "bfloat16")
        )  # for the memory plan
        if manifest is not None and ack.version > self.held.version:
            self.feed.offer(
                ack.version, manifest, Source(ack.snapshot_endpoint, ack.snapshot_key, ack.ticket)
            )

    def offer(self, version: int, raw: Mapping[str, object], source: Source) -> None:
        """A version the learner named, its manifest as it arrived: verified here, once."""
        if version > self.held.version:
            manifest = self._verified(version, raw)
            if manifest is not None:
                self.feed.offer(version, manifest, source)

    def _verified(self, version: int, raw: Mapping[str, object]) -> Manifest | None:
        try:
            return verify_manifest(raw, self.session.public_key)
        except SnapshotError as err:  # a learner's bug or a forgery: this version is skipped
            log.warning("snapshot v%d not received: %s", version, err)
            return None

    def load(self) -> tuple[Backend, Adapter]:
        """The model (blocking: the worker runs this on a loader thread)."""
        return load_model(
            self.session.view,
            replace(self.choice, parks=self.parks()),
            version_bytes=self.version_bytes,
            base=self.base,
            base_manifest=self.base_manifest,
        )

    async def obtain_base(self) -> None:
        """A LoRA run on a model folder: the base model from the cache, this machine's
        model.name, or fetched from a peer or the learner (echo_rl.worker.base)."""
        raw, view = self.base_offer, self.session.view
        if raw is None or not view.get("lora", {}).get("enabled"):
            return
        try:
            m = verify_base_manifest(raw, self.session.public_key, self.session.run_id)
            self.base_manifest = m
            self.base = await obtain_base(
                m, model_name=view["model"]["name"], relay=self.relay, ask=self.ask_source
            )
        except (SnapshotError, OSError) as err:  # OSError: the cache's disk
            raise WorkerError(refuse(err)) from None
        log.info("%s", self.base.line(m))
        self.status.update(
            base_model=m.base_model,
            base_origin=self.base.origin,
            base_fetched_bytes=self.base.fetched_bytes,
        )

    async def ensure_installed(self) -> None:
        """Between rollouts: load the newest version the feed rebuilt into the model."""
        ready = self.feed.take_ready()
        if ready is None or ready[0] <= self.held.version:
            return
        version, manifest, result = ready
        # rebuilt, or received whole into a buffer of the feed's: never a view or a map
        assert isinstance(result, (bytes, bytearray))
        backend = self.held.backend
        assert backend is not None
        # a WorkerError: out of the try, it ends the worker
        check_base(manifest, backend, self.session.view["model"]["name"])
        self.activity.state = "installing"
        try:
            t0 = time.monotonic()
            async with self.device_turn():  # shared with other runs (echo_rl/worker/sharing.py)
                await asyncio.to_thread(backend.install, manifest.tensor_index(), result, version)
            self.held.version = version
            self.status.update(
                installed_version=version,
                installed_at=time.time(),
                install_s=round(time.monotonic() - t0, 3),
            )
            trim()  # the install's transient copies go back to the kernel (docs/memory.md)
            self._first_install()
            log.info("installed snapshot v%d", version)
        except ModelError as err:
            log.warning("snapshot v%d not installed: %s", version, err)
        except (RuntimeError, ValueError) as err:
            # A verified snapshot that still fails to load (a torch error on a tensor the
            # manifest describes): this version is skipped, the worker keeps serving.
            log.exception("snapshot v%d could not be installed: %s", version, err)
        finally:
            self.activity.state = "idle"

    def _first_install(self) -> None:
        first = self.progress.installed()
        if first is not None:
            self.status.update(first_install=first, install_phase=None)
            self.status.flush(force=True)
            log.info(
                "first install %.1f s after joining (%.1f s after start): model loaded "
                "after %.1f s, snapshot received after %.1f s",
                first["since_join_s"],
                first["since_start_s"],
                first["model_s"],
                first["snapshot_s"],
            )

    async def report_install(
        self, version: int, stats: FetchStats, decode_s: float, keyframe: bool
    ) -> None:
        """The version is here, verified and rebuilt, with what this worker measured: the
        learner times the broadcast and plans on measured rates (echo_rl.broadcast.link_meter)."""
        await self.session.client.send(
            wire.Installed(
                worker_id=self.session.worker_id,
                version=version,
                decode_s=decode_s,
                keyframe=keyframe,
                **self.relay.measured(version, stats),
            )
        )

    async def ask_source(
        self, version: int, bad_source: str, reason: str, chunk: int, form: str
    ) -> Source:
        """A snapshot source failed (or this worker needs a keyframe): ask the learner."""
        try:
            grant = await self.session.client.request(
                wire.SourceRequest(
                    worker_id=self.session.worker_id,
                    version=version,
                    bad_source=bad_source,
                    reason=reason,
                    chunk=chunk,
                    form=form,
                ),
                self.session.timeout,
            )
        except RequestTimeout:
            raise SnapshotError("learner did not answer a source request") from None
        if not isinstance(grant, wire.SourceGrant):
            raise SnapshotError(f"source request refused: {grant}")
        return Source(grant.source, grant.source_key, grant.ticket)
