"""The learner's server: its own thread running an asyncio loop, serving the fleet.

Two ROUTER sockets: control (join, heartbeat, work, trajectories, leave; wire schema in
``echo_rl.core.wire``) and snapshot chunks (``echo_rl.broadcast.source``), both CurveZMQ servers whose ZAP
handler is the ``Gate`` (docs/security.md). A worker *is* its public key: its session is bound to
that key at join, every later message must come from the same key and name the same worker id,
so nobody can speak for, redirect or remove another worker. The trainer thread talks to this
object only through ``publish``, ``stats``, ``report`` and ``shutdown``, which hop onto the loop
thread-safely.

The work is done by parts that each own their state (this object wires them and serves the
sockets, which ``echo_rl.control.bind`` binds at start): the session table (``echo_rl.control.sessions``), joins, heartbeats and the provisioner
(``echo_rl.control.members``), snapshot routes and relay reports (``echo_rl.control.routes``), grants,
trajectories, hand-backs and quarantine (``echo_rl.control.deliveries``), publications
(``echo_rl.control.notices``), one message's handling (``echo_rl.control.dispatch``) and the statistics
(``echo_rl.control.server_stats``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import mmap
import random
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import TypeVar

from echo_rl.broadcast.base_manifest import BaseManifest
from echo_rl.broadcast.coordinator import Coordinator
from echo_rl.broadcast.nat.reflect import Reflector
from echo_rl.broadcast.snapshot import Snapshot
from echo_rl.broadcast.source import ChunkServer
from echo_rl.broadcast.store import SnapshotBuffer, SnapshotStore
from echo_rl.broadcast.topology import make_topology
from echo_rl.broadcast.tree import relay_tree
from echo_rl.control.bind import Served, bind
from echo_rl.control.listen import count_handshakes, handshake_monitor
from echo_rl.control.outside import doctor_ack
from echo_rl.control.parts import Inputs, Wiring, build_parts
from echo_rl.control.reputation import Verdict
from echo_rl.control.verify import Verifier
from echo_rl.core import wire
from echo_rl.core.config import EchoConfig
from echo_rl.core.control_stats import ControlStats
from echo_rl.core.errors import EchoError
from echo_rl.core.jsontypes import JsonObject
from echo_rl.core.security import JoinLine
from echo_rl.core.tree import RelayTree

log = logging.getLogger("echo.control")

# How long the trainer's thread waits for the loop to store a version or answer a stats call
# before it goes on without (counted in stats().slow); it never ends the run.
LOOP_WAIT_S = 10.0
TREE_WAIT_S = 2.0
T = TypeVar("T")  # a dashboard poll or a scrape waits this long for the loop's relay tree


class ControlStartFailed(EchoError, RuntimeError):
    """The server's loop did not come up; its ``reason`` is the cause's code when it has one
    (``port_taken``: a port another process holds)."""

    default_reason = "control_start"


class LearnerServer:
    def __init__(self, cfg: EchoConfig, inputs: Inputs):
        """``inputs``: the run, its buffer, queue and limits, and what checks deliveries
        (``echo_rl.control.parts.Inputs``)."""
        self.cfg = cfg
        self.run_id, self.key = inputs.run_id, inputs.key
        self.buffer, self.work = inputs.buffer, inputs.work
        self.max_bytes = int(cfg.transport.max_message_mib * 2**20)
        self.store = SnapshotStore()
        # Full payloads of the versions held (what a delta rebuilds): served as keyframes to
        # workers without the base when no peer that installed the version is left.
        self.results = SnapshotStore(keep=2, recycle=False)
        # A LoRA run on a model folder: its base model, served to workers that lack it
        # (``hold_base``, before ``start``; echo_rl.broadcast.basemodel).
        self.bases = SnapshotStore(keep=1, recycle=False)
        self._loop: asyncio.AbstractEventLoop | None = None  # ``report`` needs it first
        # Key pair, tokens, bans and allow-list live in the run folder (a throwaway one in tests).
        wiring = Wiring(
            inputs.run_dir or Path(tempfile.mkdtemp(prefix="echo-sec-")),
            report=self.report,  # called once the loop runs (the reward auditor starts then)
            doctor=lambda: doctor_ack(self),  # answered once the loop serves
        )
        p = self.parts = build_parts(cfg, inputs, wiring, self.store, self.results)
        self.gate, self.table, self.members, self.routes = p.gate, p.table, p.members, p.routes
        self.deliveries, self.intake, self.accounts = p.deliveries, p.intake, p.accounts
        self.reputation, self.rejected = p.reputation, p.rejected
        bc = cfg.broadcast
        # uplink_mbit / link_mbit inform the chain planner; they do not throttle anything.
        self.topology = make_topology(
            bc.topology,
            uplink_mbit=bc.uplink_mbit or None,
            link_mbit=bc.link_mbit or None,
            chunk_bytes=bc.chunk_bytes,
        )
        # what the sockets serve (echo_rl.control.bind binds them on the loop, at start)
        self._served = Served(
            self.store,
            self.results,
            self.bases,
            self.topology,
            self.key,
            self.run_id,
            self.max_bytes,
        )
        self.coordinator: Coordinator | None = None
        self.reflector: Reflector | None = None  # docs/nat.md; None with nat_traversal off
        self.verifier: Verifier | None = None
        self.chunks: ChunkServer | None = None
        self.endpoint = ""
        self.snapshot_endpoint = ""
        self.slow: Counter[str] = Counter()  # trainer calls the loop answered late (publish, stats)
        self._last_stats = ControlStats()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="echo-control", daemon=True)

    # ------------------------------------------------------------------ lifecycle

    def start(self, timeout: float = 30.0) -> None:
        self._thread.start()
        if not self._ready.wait(timeout) or self._error:
            err = self._error
            reason = err.reason if isinstance(err, EchoError) else None  # e.g. port_taken
            raise ControlStartFailed(
                f"control plane failed to start: {err}", reason=reason
            ) from err
        if self.intake.reward_audit is not None:  # its verdicts are recorded on this loop
            self.intake.reward_audit.start()

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # surfaced to the trainer through start()/stats()
            self._error = exc
            log.exception("control plane crashed")
            self._ready.set()

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.parts.cpu.bind_thread()
        self._stop = asyncio.Event()
        b = await bind(self.cfg, self.parts, self._served)
        # the bound endpoints and what was built on them, read from the server by others
        self.endpoint, self.snapshot_endpoint = b.endpoint, b.snapshot_endpoint
        self.reflector, self.coordinator = b.reflector, b.coordinator
        self.chunks, self.verifier = b.chunks, b.verifier
        curve = self.gate.keys is not None
        mons = [handshake_monitor(b.ctrl, curve), handshake_monitor(b.snap, curve)]
        self._ready.set()
        try:
            async with asyncio.TaskGroup() as tg:
                out = self.parts.socket
                tasks = [
                    tg.create_task(out.serve(b.ctrl, self.parts.dispatcher)),
                    tg.create_task(out.send_acks()),
                    tg.create_task(b.chunks.serve_forever()),
                    tg.create_task(self._housekeeping()),
                    *(tg.create_task(count_handshakes(m, self.gate.refused)) for m in mons),
                    tg.create_task(b.verifier.serve_forever(self.routes.probes.verdict)),
                ]
                if b.zap is not None:
                    tasks.append(tg.create_task(b.zap.serve()))
                await self._stop.wait()
                for t in tasks:
                    t.cancel()
        finally:
            b.close(curve)

    def bound_ports(self) -> dict[str, int | list[int]]:
        """The ports this server listens on (learner.json's "ports"; --resume reuses them)."""

        def port(endpoint: str) -> int:
            return int(endpoint.rsplit(":", 1)[1])

        return {
            "control": port(self.endpoint),
            "chunks": port(self.snapshot_endpoint),
            "reflectors": list(self.reflector.ports) if self.reflector else [0, 0],
        }

    @property
    def public_key(self) -> bytes | None:
        """The learner's CURVE public key (Z85), None when running plaintext."""
        return self.gate.keys.public if self.gate.keys is not None else None

    def join_line(self, token: str = "") -> str:
        """What a volunteer passes to ``echo-worker join``: address, key (and a token)."""
        return str(JoinLine(self.endpoint, self.public_key, token))

    # ------------------------------------------------------------------ from the trainer's thread

    def _call(
        self,
        coro_fn: Callable[..., Coroutine[object, None, T]],
        *args: object,
        timeout: float = 30.0,
    ) -> T:
        if self._error:
            raise RuntimeError(f"control plane crashed: {self._error}")
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coro_fn(*args), self._loop).result(timeout)

    def _on_loop(self) -> bool:
        """Is the loop running (else nobody else touches what it owns)?"""
        return self._loop is not None and self._thread.is_alive()

    def hold_base(self, manifest: BaseManifest, payload: bytes | bytearray | mmap.mmap) -> None:
        """Serve this run's base model (call before ``start``): its manifest goes out with
        every join_ack, its chunks to whoever the learner sends to fetch it here."""
        self.routes.base_manifest = manifest
        self.bases.add(SnapshotBuffer(manifest, payload))

    def publish(self, snap: Snapshot) -> None:
        """From the publisher thread: the version is stored on the loop (servable, offered in
        heartbeat replies) and its notices go out from a task of their own; this waits for the
        store only, and a slow loop delays it without ending the run (counted
        ``publish_slow``, after ``LOOP_WAIT_S``). Versions are stored in the order they are
        published (FIFO)."""
        if self._error:
            raise RuntimeError(f"control plane crashed: {self._error}")
        assert self._loop is not None
        stored = asyncio.run_coroutine_threadsafe(self.parts.notices.publish(snap), self._loop)
        try:
            stored.result(LOOP_WAIT_S)
        except TimeoutError:
            self.slow["publish_slow"] += 1
            log.warning(
                "the control loop took over %.0fs to store v%d: it will when it gets to "
                "it; training goes on",
                LOOP_WAIT_S,
                snap.version,
            )

    def stats(self) -> ControlStats:
        """The server's statistics for the trainer's metrics row. A loop that does not answer
        in ``LOOP_WAIT_S`` gives the last statistics (counted ``stats_slow``)
        instead of ending the run; a crashed loop still raises."""
        try:
            self._last_stats = self._call(self._stats, timeout=LOOP_WAIT_S)
        except TimeoutError:
            if self._error:
                raise
            self.slow["stats_slow"] += 1
            log.warning(
                "the control loop did not answer a stats call in %.0fs: last stats used",
                LOOP_WAIT_S,
            )
        return dataclasses.replace(self._last_stats, slow=dict(self.slow))

    async def _stats(self) -> ControlStats:
        return self.parts.stats.row(self.parts.socket.acks.qsize())

    def work_state(self, prompt_rng: random.Random) -> tuple[JsonObject, tuple[object, ...]]:
        """The work queue's leases and the prompt generator's state, for a checkpoint, read on
        the loop that grants work: read from the trainer's thread, a grant meanwhile changed
        the leases under it ("dictionary changed size during iteration" ended a run)."""

        async def read() -> tuple[JsonObject, tuple[object, ...]]:
            return self.work.state(), prompt_rng.getstate()

        if not self._on_loop():
            return self.work.state(), prompt_rng.getstate()  # no loop: nobody else touches them
        return self._call(read, timeout=LOOP_WAIT_S)

    def payloads(self) -> list[object]:
        """The payloads the chunk server holds (versions, full versions, the base model), read
        on the loop that changes them (echo_rl.core.memstat counts them)."""

        async def read() -> list[object]:
            return [
                buf.payload
                for store in (self.store, self.results, self.bases)
                for buf in store.buffers()
            ]

        return self._call(read, timeout=LOOP_WAIT_S) if self._on_loop() else []

    def relay_tree(self) -> RelayTree:
        """The current version's relay tree (``echo_rl.core.tree``), built on the loop, from any thread:
        the dashboard reads it at each poll. TimeoutError after ``TREE_WAIT_S`` of a busy loop."""

        async def build() -> RelayTree:
            if self.coordinator is None:
                return RelayTree(version=None, source=self.snapshot_endpoint, nodes=[])
            return relay_tree(self.coordinator)

        return self._call(build, timeout=TREE_WAIT_S)

    def report(self, verdict: Verdict) -> None:
        """From the trainer thread (audits): recorded on the loop, in order."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self.deliveries.record, verdict)

    def waiting(self, waiting: bool) -> None:
        """From the trainer thread: the learner started or stopped waiting for data."""
        if self.members.controller is not None:
            self.members.controller.waiting(waiting)

    def set_requirement(self, mu_req: float | None) -> None:
        """From the trainer thread: the capacity the learner needs (trajectories/s)."""
        if self.members.controller is not None:
            self.members.controller.set_requirement(mu_req)

    def shutdown(self, reason: str) -> None:
        if not self._on_loop():
            return
        try:
            self._call(self._shutdown, reason)
        finally:
            self._thread.join(10)

    async def _shutdown(self, reason: str) -> None:
        m, fleet = self.members, self.parts.fleet
        await asyncio.to_thread(fleet.books.save, fleet.state())
        if self.parts.intake.reward_audit is not None:
            await asyncio.to_thread(self.parts.intake.reward_audit.close)
        for w in list(self.table.workers.values()):
            await self.parts.socket.send(
                w, wire.Shutdown(reason=reason, account=m.account(w, reason))
            )
        assert self._stop is not None
        self._stop.set()

    # ------------------------------------------------------------------ loop side

    async def _housekeeping(self) -> None:
        timeout = self.cfg.transport.heartbeat_timeout_s
        fleet = self.parts.fleet
        while True:
            await asyncio.sleep(min(0.5, timeout / 4))
            t0 = time.thread_time()
            now = time.monotonic()
            self.parts.tidy(now)
            self.parts.cpu.add("housekeeping", time.thread_time() - t0)
            if fleet.books.due(now):
                await asyncio.to_thread(fleet.books.save, fleet.state())
