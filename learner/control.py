"""Control plane inside the learner process: its own thread running an asyncio loop.

Two ROUTER sockets: control (join, heartbeat, work, trajectories, leave; wire schema in
``echo.wire``) and snapshot chunks (``broadcast.source``), both CurveZMQ servers whose ZAP
handler is the ``Gate`` (docs/security.md). A worker *is* its public key: its session is bound to
that key at join, every later message must come from the same key and name the same worker id,
so nobody can speak for, redirect or remove another worker. Every frame is validated; a bad one
is answered with ``error{reason}``, counted under that reason and logged with the sender's key,
and the loop goes on serving everyone else. The trainer thread talks to this object only
through ``publish``, ``stats``, ``report`` and ``shutdown``, which hop onto the loop
thread-safely. Trajectory admission is ``learner.intake``; snapshot routes (sources, tickets,
corruption reports) are ``learner.routes``; strikes and quarantine ``learner.reputation``.
"""

from __future__ import annotations

import asyncio
import logging
import mmap
import tempfile
import threading
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from broadcast.coordinator import Coordinator
from broadcast.reports import ReportBook
from broadcast.nat.reflect import Reflector
from broadcast.snapshot import RunKey, Snapshot, result_view
from broadcast.source import ChunkServer
from broadcast.store import SnapshotBuffer, SnapshotStore
from broadcast.tickets import mint
from broadcast.topology import make_topology
from broadcast.tree import relay_tree
from dataplane import rules
from dataplane.records import Limits
from echo import wire
from echo.addresses import public_endpoint
from echo.config import EchoConfig
from echo.security import ZAP_DOMAIN, JoinLine, LogThrottle, ZapHandler, curve_server, sender_key
from echo.tree import RelayTree
from learner.accounts import Accounts
from learner.gate import Gate
from learner.verify import Verifier
from learner.buffer import ReplayBuffer
from learner.durable import BufferLog
from learner.gate import security_dir
from learner.handback import PrefixLimits
from learner.handbacks import Handbacks
from learner.intake import NOT_COUNTED, AuditJob, Intake
from learner.reputation import Reputation, Verdict
from learner.routes import SnapshotRoutes
from learner.sessions import EWMA_ALPHA, Sessions, WorkerState
from learner.cpu import CpuBook
from learner.staleness import Staleness
from learner.fleet import FLEET_FILE, FleetBooks
from learner.work import WorkQueue
from provisioning.controller import Controller, Decision
from provisioning.words import in_words

log = logging.getLogger("echo.control")

SMALL_FRAME = 1 << 16
# Acknowledgements waiting for their records to be durable (group commit). Overflow policy:
# when full, the control loop waits for room before it reads the next message (back-pressure).
ACK_QUEUE = 1024
# How long the trainer's thread waits for the loop to store a version or answer a stats call
# before it goes on without (counted in stats()["slow"]); it never ends the run.
LOOP_WAIT_S = 10.0
# The per-worker tables in the stats (dashboard rows, /metrics labels) of a fleet larger than
# PER_WORKER_FRESH_UP_TO are rebuilt at most every PER_WORKER_EVERY_S: each costs the loop time
# in proportion to the fleet, and stats are asked for at every step (docs/scale.md).
PER_WORKER_EVERY_S = 2.0
PER_WORKER_FRESH_UP_TO = 256
STANDBY_RETRY_S, EMPTY_RETRY_S = 0.5, 0.2  # a small fleet's retry after a grant without work
SERVE_BURST = 8  # messages served back to back before the loop lets its other tasks run
SERVE_SLICE_S = 0.005  # ... or this long, whichever comes first
TREE_WAIT_S = 2.0  # a dashboard poll or a scrape waits this long for the loop's relay tree


@dataclass
class Deferred:
    """A reply that may leave only once ``durable`` (a buffer log future) has resolved."""

    reply: wire.Message
    durable: Any
CHUNK_DOMAIN = b"echo-chunks"


def port_taken(key: str, host: str, port: Any, exc: Exception) -> RuntimeError:
    """A listening port the learner cannot have, said with the key that sets it."""
    return RuntimeError(
        f"cannot listen on {host} port {port} ({key}): {exc}. Another process holds it (a "
        f"learner still running?): stop it, or set {key} to a free port (0: the OS picks; "
        f"docs/ports.md)")


def _ban_detail(note: str) -> str:
    """What a banned worker is told: the reason written with the ban (docs/volunteers.md)."""
    return f"this key is banned ({note})" if note else "this key is banned"


def _small(frame: bytes, max_bytes: int) -> wire.Message | None:
    """A refused frame decoded only when small (for its request id, so the sender's request
    ends with the refusal instead of a timeout); a large one is not worth the CPU."""
    if len(frame) > SMALL_FRAME:
        return None
    try:
        return wire.decode(frame, max_bytes)
    except wire.WireError:
        return None


class ControlPlane(Sessions, SnapshotRoutes):
    def __init__(self, cfg: EchoConfig, *, run_id: str, key: RunKey, buffer: ReplayBuffer,
                 work: WorkQueue, limits: Limits, buffer_log: BufferLog | None = None,
                 run_dir: Path | None = None, adapter: Any = None,
                 audit: Callable[[AuditJob], None] | None = None, step: Callable[[], int] = lambda: 0):
        """``adapter``: recompute rewards with it (None: no recomputation, for protocol tests);
        ``audit``: where groups chosen for audit go (``learner.auditor``); ``step``: the
        learner's current step, for the security files."""
        self.cfg = cfg
        # Key pair, tokens, bans and allow-list live in the run folder (a throwaway one in tests).
        run_dir = run_dir or Path(tempfile.mkdtemp(prefix="echo-sec-"))
        self.gate = Gate(cfg.security, run_dir)
        sc = cfg.security
        self.reputation = Reputation(security_dir(run_dir), sc.strikes, step, self._quarantine)
        self.intake = Intake(limits=limits, buffer=buffer, work=work, reputation=self.reputation,
                             buffer_log=buffer_log, adapter=adapter,
                             audit=audit if sc.audit else None, audit_rate=sc.audit_rate,
                             probation_groups=sc.probation_groups)
        self.sessions: dict[str, str] = {}  # public key -> worker id (one session per key)
        self._log_gate = LogThrottle()  # one refusal line per peer per 10 s
        self.relay_keys: dict[str, str] = {}  # relay endpoint -> the key that serves there
        self.relay_canon: dict[str, str] = {}  # the same, by canonical endpoint (sessions)
        self.verifier: Verifier | None = None
        self.chunks: ChunkServer | None = None
        self.run_id = run_id
        self.key = key
        self.buffer = buffer
        self.work = work
        self.limits = limits
        self.buffer_log = buffer_log
        self.instance_id = uuid.uuid4().hex[:12]
        self.max_bytes = int(cfg.transport.max_message_mib * 2**20)
        bc = cfg.broadcast
        # uplink_mbit / link_mbit inform the chain planner; they do not throttle anything.
        self.topology = make_topology(bc.topology, uplink_mbit=bc.uplink_mbit or None,
                                      link_mbit=bc.link_mbit or None, chunk_bytes=bc.chunk_kib * 1024)
        self.store = SnapshotStore()
        # Full payloads of the versions held (what a delta rebuilds): served as keyframes to
        # workers without the base when no peer that installed the version is left.
        self.results = SnapshotStore(keep=2, recycle=False)
        # A LoRA run on a model folder: its base model, served to workers that lack it
        # (``hold_base``, before ``start``; broadcast.basemodel).
        self.bases = SnapshotStore(keep=1, recycle=False)
        self.base_manifest: dict[str, Any] | None = None
        # (version, decode seconds, took a keyframe) per accepted install report; bounded.
        self.installs: deque[tuple[int, float, bool]] = deque(maxlen=1024)
        self.keyframe_installs = 0  # installs that needed a keyframe (the run's total)
        self.coordinator: Coordinator | None = None
        self.reflector: Reflector | None = None  # docs/nat.md; None with nat_traversal off
        pc = cfg.provisioning
        # Without the controller every worker is active; with it, workers join as standby
        # (they keep their snapshot current and relay) until it activates them.
        self.controller = (Controller(pc.alpha, pc.delta, pc.window_s, tau_s=pc.tau_s,
                                      warmup_s=pc.warmup_s, probation_slots=pc.probation_slots,
                                      probation_ready_s=pc.probation_ready_s,
                                      group_size=cfg.learner.group_size,
                                      probation_group_s=pc.probation_group_s)
                           if pc.enabled else None)
        self.decisions: list[Decision] = []  # appended by the loop, drained by the trainer
        self.workers: dict[str, WorkerState] = {}
        self.accounts = Accounts()  # what each worker is told about itself (docs/volunteers.md)
        self.rejected: Counter[str] = Counter()
        self.noticed: Counter[str] = Counter()  # snapshot notices sent / deferred to heartbeats
        self.cpu = CpuBook()  # the loop's CPU per kind of work (learner.cpu, docs/scale.md)
        self._kind = ""  # the kind of the message being handled, for self.cpu
        self.unconfirmed: Counter[str] = Counter()  # learner.routes: reports not confirmed
        self.reprobing: set[str] = set()
        # docs/preemption.md: hand-backs checked, counted and bounded (learner.handbacks)
        self.returns = Handbacks(sc, work, audit if sc.audit else None)
        self.intake.on_complete = self.returns.completed
        # docs/security.md, "Staleness is not free": stale deliveries earn less credit
        self.staleness = Staleness(cfg.learner.staleness, cfg.provisioning.staleness_discount)
        self.multi_turn = bool(getattr(adapter, "multi_turn", False))
        self.books = FleetBooks(run_dir / FLEET_FILE)  # the fleet's books across a restart
        self.endpoint = ""
        self.snapshot_endpoint = ""
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ctrl: zmq.asyncio.Socket | None = None
        self._thread = threading.Thread(target=self._run, name="echo-control", daemon=True)
        self.slow: Counter[str] = Counter()  # trainer calls the loop answered late (publish, stats)
        self._last_stats: dict[str, Any] = {}
        self._per_worker_cache: tuple[float, dict[str, Any]] | None = None  # (built at, tables)
        self._notices: set[asyncio.Task[None]] = set()  # fan-outs in flight (kept referenced)

    # ------------------------------------------------------------------ lifecycle

    def start(self, timeout: float = 30.0) -> None:
        self._thread.start()
        if not self._ready.wait(timeout) or self._error:
            raise RuntimeError(f"control plane failed to start: {self._error}")

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # surfaced to the trainer through start()/stats()
            self._error = exc
            log.exception("control plane crashed")
            self._ready.set()

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.cpu.bind_thread()
        self._stop = asyncio.Event()
        ctx = zmq.asyncio.Context()
        try:
            zap, ctrl, snap = await self._listen(ctx)
        except BaseException:
            ctx.destroy(linger=0)  # a start that failed (a port taken) frees what it bound
            raise
        bc = self.cfg.broadcast
        self.coordinator = Coordinator(self.topology, self.snapshot_endpoint, q=bc.q,
                                       reports=ReportBook(bc.convict_after, bc.report_avoid_s,
                                                          bc.relay_mark_s))
        self.coordinator.punches.timeout_s = self.cfg.broadcast.punch_timeout_s
        sc = self.cfg.security
        self.chunks = ChunkServer(snap, self.store, self.max_bytes, authorize=self._may_pull,
                                  max_parked_per_peer=sc.max_parked_per_peer,
                                  max_parked_total=sc.max_parked_total,
                                  requests_per_s=sc.peer_chunk_requests_per_s,
                                  results=self.results, bases=self.bases)
        mons = [self._handshake_monitor(ctrl), self._handshake_monitor(snap)]
        # The probe's tickets live as long as a child's: nothing in them tells the two apart.
        self.verifier = Verifier(ctx, lambda child, parent: mint(
            self.key, child, parent, self.run_id, sc.ticket_ttl_s), self.max_bytes,
            window=self.cfg.broadcast.window)
        self._acks: asyncio.Queue[tuple[bytes, Deferred]] = asyncio.Queue(ACK_QUEUE)
        self._ready.set()
        try:
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(self._serve(ctrl)),
                         tg.create_task(self._send_acks()),
                         tg.create_task(self.chunks.serve_forever()),
                         tg.create_task(self._housekeeping()),
                         tg.create_task(self._count_handshakes(mons[0])),
                         tg.create_task(self._count_handshakes(mons[1])),
                         tg.create_task(self.verifier.serve_forever(self._verdict))]
                if zap is not None:
                    tasks.append(tg.create_task(zap.serve()))
                await self._stop.wait()
                for t in tasks:
                    t.cancel()
        finally:
            for sock in (ctrl, snap):
                if self.gate.keys is not None:
                    sock.disable_monitor()
            ctrl.close(linger=500)
            snap.close(linger=0)
            if self.reflector is not None:
                self.reflector.close()
            if zap is not None:
                zap.close()
            ctx.term()

    async def _listen(self, ctx: zmq.asyncio.Context) -> tuple[ZapHandler | None, zmq.asyncio.Socket,
                                                              zmq.asyncio.Socket]:
        """Every listening socket on its port (docs/ports.md): ZAP, control, chunks, reflector."""
        # Bound before the sockets: no handshake may come before the handler that judges it.
        zap = (ZapHandler(ctx, self._zap_control, {CHUNK_DOMAIN: self._zap_chunks})
               if self.gate.keys is not None else None)
        ports = self.cfg.listen_ports()
        ctrl = self._ctrl = self._router(ctx, ports.control, 4 * self.max_bytes, "learner.port")
        # Chunk requests only; only joined keys connect here (_zap_chunks).
        snap = self._router(ctx, ports.chunks, 1 << 16, "learner.chunk_port",
                            zap_domain=CHUNK_DOMAIN)
        # Every endpoint handed out names the learner's public host (echo.addresses).
        lc = self.cfg.learner
        self.endpoint, self.snapshot_endpoint = (
            public_endpoint(s.getsockopt_string(zmq.LAST_ENDPOINT), lc.host, lc.public_host)
            for s in (ctrl, snap))
        if self.cfg.broadcast.nat_traversal:
            # bound where the control plane is, announced where workers reach it
            self.reflector = Reflector(lc.host, advertise=lc.public_host, ports=ports.reflectors)
            try:
                await self.reflector.start()
            except OSError as exc:
                raise port_taken("learner.reflector_ports", lc.host,
                                 getattr(exc, "port", ports.reflectors), exc) from None
        return zap, ctrl, snap

    def _router(self, ctx: zmq.asyncio.Context, port: int, max_msg: int, key: str,
                zap_domain: bytes = b"") -> zmq.asyncio.Socket:
        """A CURVE ROUTER listening on learner.host:``port`` (the config's ``key``)."""
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a vanished peer surfaces as an error
        # Hard cap above the app-level limit: frames past it drop the connection before they
        # are buffered; frames between the two are rejected and counted as "oversize".
        sock.setsockopt(zmq.MAXMSGSIZE, max_msg)
        if self.gate.keys is not None:
            curve_server(sock, self.gate.keys, zap_domain or ZAP_DOMAIN)
        try:
            sock.bind(f"tcp://{self.cfg.learner.host}:{port or '*'}")
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            raise port_taken(key, self.cfg.learner.host, port, exc) from None
        return sock

    def bound_ports(self) -> dict[str, Any]:
        """The ports this plane listens on (learner.json's "ports"; --resume reuses them)."""
        def port(endpoint: str) -> int:
            return int(endpoint.rsplit(":", 1)[1])

        return {"control": port(self.endpoint), "chunks": port(self.snapshot_endpoint),
                "reflectors": list(self.reflector.ports) if self.reflector else [0, 0]}

    @property
    def public_key(self) -> bytes | None:
        """The learner's CURVE public key (Z85), None when running plaintext."""
        return self.gate.keys.public if self.gate.keys is not None else None

    def join_line(self, token: str = "") -> str:
        """What a volunteer passes to ``echo-worker join``: address, key (and a token)."""
        return str(JoinLine(self.endpoint, self.public_key, token))

    def _zap_control(self, address: str, key: str) -> str:
        """The control socket's door: the gate's checks, and for a key without a session (a
        newcomer) the admission budget of its IP prefix (``security.newcomers_per_s_per_prefix``):
        a thousand fresh keys from one host wait their turn at the handshake, before any
        message of theirs is decoded. A key with a session reconnects freely."""
        reason = self.gate.handshake(address, key)
        if not reason and key not in self.sessions:
            reason = self.gate.newcomer(address)
        return reason

    def _handshake_monitor(self, sock: zmq.asyncio.Socket) -> zmq.asyncio.Socket | None:
        """Set up before the socket serves anyone, so no failed handshake goes uncounted."""
        if self.gate.keys is None:
            return None
        return sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                                       | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)

    async def _count_handshakes(self, mon: zmq.asyncio.Socket | None) -> None:
        """Counts failed handshakes: plaintext clients and clients pinning another key (ZAP
        refusals are counted by the gate with their reason)."""
        if mon is None:
            return
        try:
            while True:
                await mon.recv_multipart()
                self.gate.refused["handshake_failed"] += 1
        finally:
            mon.close(linger=0)

    def _call(self, coro_fn, *args, timeout: float = 30.0) -> Any:
        if self._error:
            raise RuntimeError(f"control plane crashed: {self._error}")
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coro_fn(*args), self._loop).result(timeout)

    def hold_base(self, manifest: dict[str, Any], payload: bytes | bytearray | mmap.mmap) -> None:
        """Serve this run's base model (call before ``start``): its manifest goes out with
        every join_ack, its chunks to whoever the learner sends to fetch it here."""
        self.base_manifest = manifest
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
        stored = asyncio.run_coroutine_threadsafe(self._publish(snap), self._loop)
        try:
            stored.result(LOOP_WAIT_S)
        except TimeoutError:
            self.slow["publish_slow"] += 1
            log.warning("the control loop took over %.0fs to store v%d: it will when it gets to "
                        "it; training goes on", LOOP_WAIT_S, snap.version)

    def stats(self) -> dict[str, Any]:
        """The plane's statistics for the trainer's metrics row. A loop that does not answer
        in ``LOOP_WAIT_S`` gives the last statistics (counted ``stats_slow``)
        instead of ending the run; a crashed loop still raises."""
        try:
            self._last_stats = self._call(self._stats, timeout=LOOP_WAIT_S)
        except TimeoutError:
            if self._error:
                raise
            self.slow["stats_slow"] += 1
            log.warning("the control loop did not answer a stats call in %.0fs: last stats used",
                        LOOP_WAIT_S)
        return {**self._last_stats, "slow": dict(self.slow)}

    def work_state(self, prompt_rng: Any) -> tuple[dict[str, Any], Any]:
        """The work queue's leases and the prompt generator's state, for a checkpoint, read on
        the loop that grants work: read from the trainer's thread, a grant meanwhile changed
        the leases under it ("dictionary changed size during iteration" ended a run)."""
        if self._loop is None or not self._thread.is_alive():
            return self.work.state(), prompt_rng.getstate()  # no loop: nobody else touches them
        return self._call(self._work_state, prompt_rng, timeout=LOOP_WAIT_S)

    async def _work_state(self, prompt_rng: Any) -> tuple[dict[str, Any], Any]:
        return self.work.state(), prompt_rng.getstate()

    def payloads(self) -> list[Any]:
        """The payloads the chunk server holds (versions, full versions, the base model), read
        on the loop that changes them (echo.memstat counts them)."""
        if self._loop is None or not self._thread.is_alive():
            return []
        return self._call(self._payloads, timeout=LOOP_WAIT_S)

    async def _payloads(self) -> list[Any]:
        return [buf.payload for store in (self.store, self.results, self.bases)
                for buf in store.buffers()]

    def relay_tree(self) -> RelayTree:
        """The current version's relay tree (``echo.tree``), built on the loop, from any thread:
        the dashboard reads it at each poll. TimeoutError after ``TREE_WAIT_S`` of a busy loop."""
        return self._call(self._relay_tree, timeout=TREE_WAIT_S)

    async def _relay_tree(self) -> RelayTree:
        if self.coordinator is None:
            return RelayTree(version=None, source=self.snapshot_endpoint, nodes=[])
        return relay_tree(self.coordinator)

    def shutdown(self, reason: str) -> None:
        if self._loop is None or not self._thread.is_alive():
            return
        try:
            self._call(self._shutdown, reason)
        finally:
            self._thread.join(10)

    # ------------------------------------------------------------------ loop side

    async def _publish(self, snap: Snapshot) -> None:
        """Store the version and plan it (members only: pending keys are not in the plan);
        the notices go out from their own task, so the publisher waits for none of them."""
        assert self.coordinator is not None
        self.store.add(SnapshotBuffer(snap.manifest, snap.payload))
        self.results.add(SnapshotBuffer(result_view(snap.manifest), snap.full))
        self.coordinator.publish(snap.version)
        task = asyncio.create_task(self._notify(snap.version, snap.manifest))
        self._notices.add(task)
        task.add_done_callback(self._notices.discard)

    def _notice_order(self, version: int) -> list[WorkerState]:
        """Who is told of ``version`` now: at most ``security.notices_per_publication``;
        members first, among them those whose deliveries were admitted (what no key fakes
        without doing the work), then active ones, then pending keys, each least recently
        told first. The rest learn it from their next heartbeat reply (``worker.heartbeat_s``
        later), so a thousand keys add a bounded amount of work to a publication."""
        order = sorted(self.workers.values(), key=lambda w: (
            not w.member, w.admitted == 0, not (w.member and self.is_active(w.worker_id)),
            w.noticed))
        chosen = order[:self.cfg.security.notices_per_publication]
        for w in chosen:
            w.noticed = version
        self.noticed["sent"] += len(chosen)
        self.noticed["deferred"] += len(order) - len(chosen)
        return chosen

    async def _notify(self, version: int, manifest: dict[str, Any]) -> None:
        for n, w in enumerate(self._notice_order(version)):
            if self.store.latest() is None or self.store.latest().version != version:
                return  # superseded: the next publication's notices carry the newer version
            if self.workers.get(w.worker_id) is not w:
                continue  # left meanwhile
            t0 = time.thread_time()
            src = self._snapshot_source(w)
            await self._send(w, wire.SnapshotNotice(version=version, manifest=manifest,
                                                    source=src.endpoint, source_key=src.key,
                                                    ticket=src.ticket))
            self.cpu.add("notice", time.thread_time() - t0)
            if n % 8 == 7:
                # A notice costs a ticket signature and an encryption: let waiting heartbeats
                # in between (a send to a ROUTER does not suspend).
                await asyncio.sleep(0)

    async def _stats(self) -> dict[str, Any]:
        t0 = time.thread_time()
        out = self._stats_now()
        self.cpu.add("stats", time.thread_time() - t0)
        out["control_cpu"] = self.cpu.snapshot()
        return out

    def _stats_now(self) -> dict[str, Any]:
        now = time.monotonic()
        live = [w for w in self.workers.values() if now - w.last_seen < self._timeout(w)]
        active = [w for w in live if self.is_active(w.worker_id)]
        return {
            "active_workers": len(active), "standby_workers": len(live) - len(active),
            "fleet_price_per_hour": sum(w.price for w in active),
            # what the active workers report they generate per busy second (heartbeats)
            "worker_rate_mean": (sum(w.claimed_throughput for w in active) / len(active)
                                 if active else 0.0),
            # whole-run average busy-time rate per active worker
            "worker_busy_rate": (sum(w.busy_samples for w in active) / sum(w.busy_s for w in active)
                                 if active and sum(w.busy_s for w in active) > 0 else 0.0),
            "rejected": dict(self.rejected + self.buffer.stats.rejected),
            "handbacks": {**self.returns.counts, "continued_samples": self.intake.continued,
                          "held": len(self.work.held)},
            # docs/security.md: refused joins and connections, rate-limited or banned messages,
            # refused chunk requests (this socket's), by reason
            "join_refused": dict(self.gate.refused),
            "limited": dict(self.gate.limited),
            "chunk_rejected": dict(self.chunks.rejected) if self.chunks else {},
            "chunk_parked": self.chunks.parked if self.chunks else 0,
            # broadcast.reports: relay reports by "reason:outcome", the learner's probes by
            # outcome, and the relays kept out now (docs/security.md, "Relay reports")
            "relay_reports": dict(self.coordinator.reports.counts) if self.coordinator else {},
            "relays_marked": len(self.coordinator.reports.marks) if self.coordinator else 0,
            "sessions": len(self.sessions),
            # docs/security.md, "Sybils": joined keys not yet members, notices sent and left
            # to heartbeat replies
            "pending_workers": sum(not w.member for w in self.workers.values()),
            "notices": dict(self.noticed),
            "learner_bytes_sent": self.store.bytes_sent,
            "ack_queue": self._acks.qsize(),
            **self._install_stats(),
            "t_bcast": self._last_t_bcast(),
            "in_flight_groups": self.work.in_flight,
            # learner.grants: leases kept across a restart, and what was admitted under them
            "restored_leases": len(self.work.restored),
            "restored_admitted": self.intake.restored_admitted,
            "reissued_groups": self.work.reissued,
            "installs": ({v: self.coordinator.install_times(v)
                          for v in sorted(self.coordinator.published)[-20:]}
                         if self.coordinator else {}),
            **self._per_worker(now),
        }

    def _per_worker(self, now: float) -> dict[str, Any]:
        """The per-worker tables (the dashboard's and /metrics' rows); for a large fleet,
        rebuilt at most every PER_WORKER_EVERY_S (docs/scale.md)."""
        cached = self._per_worker_cache
        if (cached and len(self.workers) > PER_WORKER_FRESH_UP_TO
                and now - cached[0] < PER_WORKER_EVERY_S):
            return cached[1]
        workers = {w.worker_id: {
            "price": w.price, "version": w.version, "state": w.state,
            "active": self.is_active(w.worker_id), "reachable": now - w.last_seen < self._timeout(w),
            # docs/nat.md: the reflector's verdict, and how its snapshot link is carried now
            "nat": w.nat,
            "transport": self.coordinator.transport(w.worker_id) if self.coordinator else "tcp",
            "throughput": round(w.measured_throughput, 3), "admitted": w.admitted,
            "granted": self.work.granted[w.worker_id], "returned": self.work.returned[w.worker_id],
            "taken_back": self.work.taken_back[w.worker_id],
            # learner.handbacks, learner.staleness
            **self.returns.per_worker(w.worker_id), **self.staleness.view(w.worker_id)}
            for w in self.workers.values()}
        tables = {
            "workers": workers,
            # per worker id, quarantined ones included: checks made, failed, quarantined
            "reputation": self.reputation.per_worker(),
            "checks": dict(self.reputation.by_check),
            # learner.accounts: each worker's books, departed ones included (bounded)
            "accounts": self.accounts.export(),
        }
        self._per_worker_cache = (now, tables)
        return tables

    async def _shutdown(self, reason: str) -> None:
        await asyncio.to_thread(self.books.save, self._fleet_state())
        for w in list(self.workers.values()):
            await self._send(w, wire.Shutdown(reason=reason, account=self._account(w, reason)))
        assert self._stop is not None
        self._stop.set()

    async def _send(self, w: WorkerState, msg: wire.Message) -> None:
        await self._send_ident(w.ident, msg, w.worker_id)

    def _push(self, worker_id: str, msg: wire.Message) -> None:
        """Send ``msg`` to a worker now, from synchronous code (a punch must leave before the
        source it goes with). NOBLOCK: a full queue drops it; the link then fails and the
        worker asks again (``unpunchable``)."""
        w = self.workers.get(worker_id)
        if w is not None:
            self._push_ident(w.ident, msg, worker_id)

    def _push_ident(self, ident: bytes, msg: wire.Message, who: str) -> None:
        """``_push`` to a connection, for a worker the plane no longer holds a session for."""
        assert self._ctrl is not None
        try:
            zmq.Socket.shadow(self._ctrl.underlying).send_multipart(
                [ident, wire.encode(msg)], flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.info("could not send %s to %s: %s", msg.type, who, exc)

    async def _send_ident(self, ident: bytes, msg: wire.Message, who: str = "") -> None:
        assert self._ctrl is not None
        try:
            # NOBLOCK: a peer that sends but never reads fills its queue; a reply it will not
            # read is dropped rather than stalling the loop that serves everyone.
            await self._ctrl.send_multipart([ident, wire.encode(msg)], flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # EHOSTUNREACH: the peer disconnected; heartbeats reap it
            log.info("could not send %s to %s: %s", msg.type, who or ident.hex(), exc)

    async def _housekeeping(self) -> None:
        timeout = self.cfg.transport.heartbeat_timeout_s
        while True:
            await asyncio.sleep(min(0.5, timeout / 4))
            t0 = time.thread_time()
            self.gate.reload()
            now = time.monotonic()
            for w in [w for w in self.workers.values() if now - w.last_seen > self._timeout(w)]:
                self._forget(w.worker_id, f"no heartbeat for {now - w.last_seen:.1f}s")
            self._provision()
            self._reprobe()
            self.accounts.tick(self.workers if self.controller is None
                               else self.controller.active_ids(), now)
            expired = self.work.expire()
            if expired:
                log.info("%d group lease(s) expired: handed out again", expired)
            late = self.returns.expire()
            if late:
                log.info("%d handed-back group(s) went out without prefixes whose check was "
                         "not back within security.handback_hold_s", late)
            self.cpu.add("housekeeping", time.thread_time() - t0)
            if self.books.due(now):
                await asyncio.to_thread(self.books.save, self._fleet_state())

    def _fleet_state(self) -> dict[str, Any]:
        """What a restarted learner needs to know about its fleet (``learner.fleet``)."""
        return {"controller": self.controller.state() if self.controller is not None else {},
                "accounts": self.accounts.state()}

    def restore_fleet(self) -> None:
        """``--resume``: the books the last instance saved; before ``start``."""
        state = self.books.load()
        n = self.controller.restore(state.controller) if self.controller is not None else 0
        m = self.accounts.restore(state.accounts)
        log.info("resume: fleet books restored for %d worker identities (provisioner) and %d "
                 "accounts", n, m)

    def waiting(self, waiting: bool) -> None:
        """From the trainer thread: the learner started or stopped waiting for data."""
        if self.controller is not None:
            self.controller.waiting(waiting)

    def is_active(self, worker_id: str) -> bool:
        return self.controller is None or worker_id in self.controller.active_ids()

    def set_requirement(self, mu_req: float | None) -> None:
        """From the trainer thread: the capacity the learner needs (trajectories/s)."""
        if self.controller is not None:
            self.controller.set_requirement(mu_req)

    def _provision(self) -> None:
        if self.controller is None:
            return
        for d in self.controller.tick():
            log.info("provisioner: %s %s: %s", d.action, d.worker_id or "-", d.reason)
            self.decisions.append(d)
            if d.worker_id:
                self.accounts.note(d.worker_id, in_words(d))  # a sentence, then the numbers

    def _forget(self, worker_id: str, why: str) -> None:
        w = self.workers.pop(worker_id, None)
        if w is None:
            return
        self._refresh_book(w)
        self.accounts.close(worker_id, "left", f"removed: {why}")
        self.sessions.pop(w.key, None)
        n = self.work.release_worker(worker_id, w.key)
        if self.coordinator is not None:
            self.coordinator.leave(worker_id)
        if self.controller is not None and w.member:
            self.controller.remove_worker(worker_id)
        log.info("worker %s removed (%s); %d group(s) handed out again", worker_id, why, n)

    # ------------------------------------------------------------------ request handling

    async def _serve(self, sock: zmq.asyncio.Socket) -> None:
        served, turn = 0, time.monotonic()
        while True:
            ident, *frames = await sock.recv_multipart(copy=False)
            t0 = time.thread_time()
            key = sender_key([ident, *frames])
            self._kind = "refused"  # until _dispatch names the request
            reply = await self._handle(ident.bytes, key, [f.bytes for f in frames])
            if isinstance(reply, Deferred):
                await self._acks.put((ident.bytes, reply))  # full: back-pressure on this loop
            elif reply is not None:
                await self._send_ident(ident.bytes, reply)
            self.cpu.add(self._kind, time.thread_time() - t0)
            # A receive that finds a message queued returns without suspending: under a backlog
            # (a join flood) this loop would serve every queued message before the trainer's
            # publish or stats call got a turn. SERVE_BURST messages or SERVE_SLICE_S (a join
            # flood: 22 ms a join), then everyone else's turn: a turn after every message cost a
            # loop cycle each (docs/scale.md).
            served += 1
            if served >= SERVE_BURST or time.monotonic() - turn > SERVE_SLICE_S:
                await asyncio.sleep(0)
                served, turn = 0, time.monotonic()

    async def _send_acks(self) -> None:
        """Acknowledgements, in order, each once its records are durable (group commit,
        ``learner.durable``): the loop serves heartbeats and chunks meanwhile. A failed write
        ends the control plane: what was not made durable must not be acknowledged, ever."""
        while True:
            ident, deferred = await self._acks.get()
            try:
                await asyncio.wrap_future(deferred.durable)
            except Exception as exc:
                await self._send_ident(ident, wire.Error(
                    reason="internal_error", detail="the learner could not store the batch; "
                    "resend it", rid=deferred.reply.rid))
                raise RuntimeError(f"buffer log write failed: {exc!r}") from exc
            await self._send_ident(ident, deferred.reply)

    async def _handle(self, ident: bytes, key: str, frames: list[bytes]) -> wire.Message | None:
        """One message from one peer: whatever it holds ends at most this message."""
        msg: wire.Message | None = None
        try:
            if len(frames) != 1:
                raise wire.WireError("malformed", f"{len(frames)} frames, expected 1")
            refused = self.gate.message(key, len(frames[0])) if key else ""
            if refused:
                self._end_banned(key, refused)
                msg = _small(frames[0], self.max_bytes)  # for its request id, if cheap
                raise wire.WireError(refused, _ban_detail(self.gate.bans.note(key))
                                     if refused == "banned" else
                                     "too many messages from this key: slow down")
            msg = wire.decode(frames[0], self.max_bytes)
            return await self._dispatch(ident, key, msg)
        except wire.WireError as err:
            self.rejected[err.reason] += 1
            if self._log_gate.ok(key or ident.hex()):
                log.warning("rejected message from %s: %s", key or ident.hex(), err)
            # The request id, when the message had one, so the sender's request ends now.
            return wire.Error(reason=err.reason, detail=err.detail, rid=msg.rid if msg else 0)
        except Exception:
            # A bug in one handler must not take the learner's control plane down with it:
            # the message is answered, counted and logged with its traceback.
            self.rejected["internal_error"] += 1
            log.exception("internal error handling a message from %s", key or ident.hex())
            return wire.Error(reason="internal_error", detail="see the learner's log")

    def _end_banned(self, key: str, refused: str) -> None:
        """A banned key's live session ends at its next message (CURVE keeps the connection)."""
        if refused == "banned" and key in self.sessions:
            self._forget(self.sessions[key], "banned")

    async def _dispatch(self, ident: bytes, key: str, msg: wire.Message) -> wire.Message | None:
        handler = {
            wire.Join: self._on_join, wire.Heartbeat: self._on_heartbeat,
            wire.WorkRequest: self._on_work_request, wire.Trajectories: self._on_trajectories,
            wire.Leave: self._on_leave, wire.SourceRequest: self._on_source_request,
            wire.Installed: self._on_install_report, wire.NatReport: self._on_nat_report,
            wire.Handback: self._on_handback, wire.Doctor: self._on_doctor,
        }.get(type(msg))
        if handler is None:
            raise wire.WireError("unknown_type", f"{msg.type} is not a request the learner serves")
        self._kind = msg.TYPE
        if not key:
            if self.gate.keys is not None:  # CURVE on, yet no key: never trust the claimed id
                raise wire.WireError("unauthenticated", "this connection carries no verified "
                                     "key; reconnect (the learner may have been starting)")
            key = f"id:{getattr(msg, 'worker_id', '')}"  # plaintext: the claimed id is all there is
        reply = handler(ident, key, msg)
        if isinstance(reply, Deferred):
            reply.reply.rid = msg.rid
        elif reply is not None:
            reply.rid = msg.rid
        return reply

    def _on_doctor(self, ident: bytes, key: str, msg: wire.Doctor) -> wire.Message:
        """A health check (``echo-worker doctor``): the endpoints a worker is handed."""
        return wire.DoctorAck(run_id=self.run_id, instance_id=self.instance_id,
                              snapshot_endpoint=self.snapshot_endpoint,
                              reflectors=self.reflector.endpoints if self.reflector else [],
                              join=self.cfg.security.join, version=self._latest()[0])

    def _on_install_report(self, ident: bytes, key: str, msg: wire.Installed) -> None:
        """A pending key that installed a snapshot has done its first useful act."""
        self._promote(self._joined(ident, key, msg.worker_id), f"installed v{msg.version}")
        return self._on_installed(ident, key, msg)

    def _install_stats(self) -> dict[str, Any]:
        """Of the newest delta workers rebuilt: the median seconds; and keyframes taken."""
        rebuilt = [(v, d) for v, d, k in self.installs if d > 0 and not k]
        if not rebuilt:
            return {"decode_s": None, "keyframes": self.keyframe_installs}
        newest = max(v for v, _ in rebuilt)
        times = sorted(d for v, d in rebuilt if v == newest)
        return {"decode_s": round(times[len(times) // 2], 4) if times else None,
                "keyframes": self.keyframe_installs}

    def _latest(self) -> tuple[int, dict[str, Any] | None]:
        buf = self.store.latest()
        return (buf.version, buf.manifest) if buf else (-1, None)

    def _on_heartbeat(self, ident: bytes, key: str, msg: wire.Heartbeat) -> wire.Message:
        w = self._session(ident, key, msg.worker_id)
        version, manifest = self._latest()
        if w is None:
            return wire.HeartbeatAck(instance_id=self.instance_id, version=version, known=False)
        w.version, w.state, w.claimed_throughput = msg.version, msg.state, msg.throughput
        w.busy_s, w.busy_samples = msg.busy_s, msg.busy_samples
        if self.coordinator is not None:
            self.coordinator.holds_base(msg.worker_id, msg.base and self.base_manifest is not None)
        if self.controller is not None and w.member:
            self.controller.heartbeat(msg.worker_id, up=True)
            if self.controller.set_yielded(msg.worker_id, msg.state == "yielded"):
                log.info("worker %s yielded to its owner: standby", msg.worker_id)
        account = self._account(w)
        w.period = self._period()
        if msg.version >= version:
            return wire.HeartbeatAck(instance_id=self.instance_id, version=version, account=account,
                                     heartbeat_s=w.period)
        src = self._snapshot_source(w)
        return wire.HeartbeatAck(instance_id=self.instance_id, version=version, manifest=manifest,
                                 source=src.endpoint, source_key=src.key, ticket=src.ticket,
                                 account=account, heartbeat_s=w.period)

    def _on_work_request(self, ident: bytes, key: str, msg: wire.WorkRequest) -> wire.Message:
        self._promote(self._joined(ident, key, msg.worker_id), "asked for work")
        if not self.is_active(msg.worker_id):  # standby: relay, don't roll out
            return wire.WorkGrant(groups=[], retry_after_s=self._poll_after(STANDBY_RETRY_S))
        if self.controller is not None:
            self.controller.ready(msg.worker_id)
        probation = self.controller is not None and self.controller.on_probation(msg.worker_id)
        capped = self.returns.capped(msg.worker_id)  # past its share of hand-backs
        ask = 1 if probation or capped else min(msg.max_groups, self._fair_share())  # dataplane/rules.py
        groups = self.work.grant(msg.worker_id, ask, self.buffer.depth()["ready_groups"],
                                 msg.holding, key=key)
        self.accounts.granted(msg.worker_id, len(groups))
        return wire.WorkGrant(groups=groups, retry_after_s=0.0 if groups else self._poll_after(EMPTY_RETRY_S))

    def _poll_after(self, base: float) -> float:
        """When a worker that got no work may ask again: ``base``, or fleet size over
        transport.heartbeats_per_s once that is longer (docs/scale.md): a thousand idle workers
        asking five times a second cost the loop more than all their heartbeats."""
        return self._fleet_interval(base)

    def _fair_share(self) -> int:
        """Groups one grant may carry: the outstanding bound split over the active workers.
        Workers on long links ask for large grants (worker/agent.py); without this one of
        them could lease most of the bound and leave the others idle."""
        active = (len(self.controller.active_ids()) if self.controller is not None
                  else len(self.workers))
        return rules.fair_share(self.work.max_outstanding, active)

    def _on_handback(self, ident: bytes, key: str, msg: wire.Handback) -> wire.Message:
        """Leases given back before the worker stops generating (docs/preemption.md): only
        the holder's own; their prefixes are checked, counted and bounded, and may wait for a
        recomputation before anyone continues them (``learner.handbacks``)."""
        self._joined(ident, key, msg.worker_id)
        lim = PrefixLimits(self.limits.vocab_size, self.limits.max_new_tokens,
                           self.limits.min_logprob, self.cfg.learner.staleness, self.multi_turn)
        return self.returns.receive(msg.worker_id, key, msg, self.buffer.version, lim)

    def _on_leave(self, ident: bytes, key: str, msg: wire.Leave) -> wire.Message:
        self._joined(ident, key, msg.worker_id)
        self._forget(msg.worker_id, "left")
        account = self.accounts.account(msg.worker_id)
        assert account is not None  # _forget closed the book; closed books are kept
        return wire.Farewell(account=account)

    def _farewell(self, worker_id: str, ident: bytes) -> None:
        """A quarantined worker's final books, sent before the refusal that stops it (its
        key is banned: nothing it sends is answered any more)."""
        account = self.accounts.account(worker_id)
        if account is not None:
            self._push_ident(ident, wire.Farewell(account=account), worker_id)

    def _account(self, w: WorkerState, message: str = "") -> wire.Account:
        """This worker's books, brought up to date (learner.accounts)."""
        self._refresh_book(w)
        if message:
            self.accounts.note(w.worker_id, message)
        account = self.accounts.account(w.worker_id)
        assert account is not None  # every joined worker has a book
        return account

    def _refresh_book(self, w: WorkerState) -> None:
        rep, co = self.reputation, self.coordinator
        peer = co.peers.get(w.worker_id) if co else None  # O(1): this runs at every heartbeat
        install = peer.installed.get(w.version, 0.0) if peer is not None else 0.0
        self.accounts.refresh(
            w.worker_id, version=w.version, install_s=install, nat=w.nat,
            throughput=w.measured_throughput,
            checks=rep.audits[w.worker_id], check_failures=rep.failures[w.worker_id],
            down_mbit=co.links.down.get(w.worker_id, 0.0) if co else 0.0,
            up_mbit=co.links.up.get(w.worker_id, 0.0) if co else 0.0)

    def _on_trajectories(self, ident: bytes, key: str, msg: wire.Trajectories) -> wire.Message:
        w = self._joined(ident, key, msg.worker_id)
        try:
            raw = wire.unpack_records(msg.payload, self.max_bytes)
        except wire.WireError as err:
            self.rejected[err.reason] += 1
            self.accounts.delivered(w.worker_id, 0, 0, {err.reason: 1}, {err.reason: err.detail})
            log.warning("rejected trajectory batch %s from %s: %s", msg.batch_id, msg.worker_id, err)
            return wire.Error(reason=err.reason, detail=err.detail, ref=msg.batch_id)
        # (echo.wire refuses a bool count; were one let through, True == 1 must not pass here)
        if type(msg.count) is not int or msg.count != len(raw):
            self.rejected["count_mismatch"] += 1
            self.accounts.delivered(w.worker_id, 0, 0, {"count_mismatch": 1})
            log.warning("rejected trajectory batch %s from %s: count %r for %d records",
                        msg.batch_id, msg.worker_id, msg.count, len(raw))
            return wire.Error(reason="count_mismatch", ref=msg.batch_id,
                              detail=f"count {msg.count!r} but {len(raw)} records: send count=len(records)")
        out = self.intake.batch(msg.worker_id, key, raw)
        self.accounts.delivered(w.worker_id, len(out.accepted), out.duplicates, out.rejected,
                                out.details)
        if out.rejected:
            self.rejected.update({k: v for k, v in out.rejected.items() if k not in NOT_COUNTED})
            log.warning("batch %s from %s: rejected %s %s", msg.batch_id, msg.worker_id,
                        dict(out.rejected), out.details or "")
        if msg.worker_id in self.reputation.quarantined:
            self._farewell(msg.worker_id, ident)  # its books are complete only now
            why = self.reputation.quarantined[msg.worker_id]
            raise wire.WireError("banned", f"this worker was quarantined ({why}): its "
                                 f"deliveries failed the learner's checks (docs/security.md)")
        if out.accepted:
            self._measure(w, len(out.accepted))
        # stale trajectories earn less (learner.staleness); refused ones earn nothing
        credit = self.staleness.admitted(w.worker_id, out.accepted, self.buffer.version)
        if self.controller is not None:
            # Busy time of the batch (every record of a batch carries the same gen_s): the
            # controller then measures capacity, not how much work it was handed.
            busy = max((r.gen_s for r in out.accepted), default=None)
            self.controller.observe(w.worker_id, len(out.accepted), busy_s=busy,
                                    credit=min(credit, len(out.accepted)))
        ack = wire.Ack(batch_id=msg.batch_id, accepted=len(out.accepted), duplicates=out.duplicates,
                       rejected=dict(out.rejected), rejected_idx=out.rejected_idx)
        if out.durable is not None:
            # Sent when the write-ahead log has it on disk; a future that already failed must
            # still go through _send_acks, which answers with an error, never an ack.
            return Deferred(ack, out.durable)
        return ack

    # ------------------------------------------------------------------ strikes and quarantine

    def report(self, verdict: Verdict) -> None:
        """From the trainer thread (audits): recorded on the loop, in order."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._record, verdict)

    def _record(self, verdict: Verdict) -> None:
        """On the loop: the strike first (a forged prefix's author answers for it), then a
        held hand-back goes out with or without its prefixes (learner.handbacks)."""
        self.reputation.record(verdict)
        self.returns.verdict(verdict)

    def _quarantine(self, worker_id: str, key: str, reason: str) -> None:
        """The worker's key is banned, its unconsumed records leave the buffer, its leases go
        to others. Runs on the loop (reputation calls it)."""
        self.gate.ban(key, f"quarantined: {reason}")
        w = self.workers.get(worker_id)
        if w is not None:
            self._refresh_book(w)
        self.accounts.close(worker_id, "quarantined", f"quarantined: {reason}")
        if w is not None:
            self._farewell(worker_id, w.ident)
        removed = self.buffer.remove_worker(worker_id)
        log.error("quarantine of %s: %d buffered record(s) removed", worker_id, len(removed))
        self.returns.forget(worker_id)  # its held hand-backs go out without its prefixes
        self._forget(worker_id, "quarantined")

    def _measure(self, w: WorkerState, accepted: int) -> None:
        now = time.monotonic()
        rate = accepted / max(now - w.last_batch_at, 1e-3)
        w.measured_throughput = (rate if w.admitted == 0 else
                                 EWMA_ALPHA * rate + (1 - EWMA_ALPHA) * w.measured_throughput)
        w.admitted += accepted
        w.last_batch_at = now
