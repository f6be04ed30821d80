"""Control plane inside the learner process: its own thread running an asyncio loop.

Two ROUTER sockets: control (join, heartbeat, work, trajectories, leave; wire schema in
``echo.wire``) and snapshot chunks (``broadcast.source``). Every frame is validated; a bad one
is answered with ``error{reason}``, counted under that reason and logged with the sender's id,
and the loop goes on serving everyone else. The trainer thread talks to this object only
through ``publish``, ``stats`` and ``shutdown``, which hop onto the loop thread-safely.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from broadcast.coordinator import Coordinator
from broadcast.snapshot import RunKey, Snapshot
from broadcast.source import ChunkServer
from broadcast.store import SnapshotBuffer, SnapshotStore
from broadcast.topology import make_topology
from dataplane.records import Limits, Record, RecordError, parse_record
from echo import wire
from echo.config import EchoConfig
from learner.buffer import ACCEPTED, COMPLETED, DUPLICATE, STALE, ReplayBuffer
from learner.durable import BufferLog
from learner.work import WorkQueue
from provisioning.controller import ACTIVE, STANDBY, Controller, Decision

log = logging.getLogger("echo.control")

EWMA_ALPHA = 0.3


@dataclass
class WorkerState:
    worker_id: str
    ident: bytes
    price: float
    last_seen: float
    version: int = -1
    state: str = "idle"
    claimed_throughput: float = 0.0
    measured_throughput: float = 0.0  # EWMA of admitted samples/s, measured here
    admitted: int = 0
    last_batch_at: float = field(default_factory=time.monotonic)
    busy_s: float = 0.0  # the worker's cumulative busy seconds and output (heartbeats)
    busy_samples: int = 0


class ControlPlane:
    def __init__(self, cfg: EchoConfig, *, run_id: str, key: RunKey, buffer: ReplayBuffer,
                 work: WorkQueue, limits: Limits, buffer_log: BufferLog | None = None):
        self.cfg = cfg
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
        self.coordinator: Coordinator | None = None
        pc = cfg.provisioning
        # Without the controller every worker is active; with it, workers join as standby
        # (they keep their snapshot current and relay) until it activates them.
        self.controller = (Controller(pc.alpha, pc.delta, pc.window_s, tau_s=pc.tau_s,
                                      warmup_s=pc.warmup_s) if pc.enabled else None)
        self.decisions: list[Decision] = []  # appended by the loop, drained by the trainer
        self.workers: dict[str, WorkerState] = {}
        self.rejected: Counter[str] = Counter()
        self.endpoint = ""
        self.snapshot_endpoint = ""
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ctrl: zmq.asyncio.Socket | None = None
        self._thread = threading.Thread(target=self._run, name="echo-control", daemon=True)

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
        self._stop = asyncio.Event()
        ctx = zmq.asyncio.Context()
        ctrl = self._ctrl = self._router(ctx, self.cfg.learner.port)
        snap = self._router(ctx, 0)
        self.endpoint = ctrl.getsockopt_string(zmq.LAST_ENDPOINT)
        self.snapshot_endpoint = snap.getsockopt_string(zmq.LAST_ENDPOINT)
        self.coordinator = Coordinator(self.topology, self.snapshot_endpoint, q=self.cfg.broadcast.q)
        self._ready.set()
        try:
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(self._serve(ctrl)),
                         tg.create_task(ChunkServer(snap, self.store, self.max_bytes).serve_forever()),
                         tg.create_task(self._housekeeping())]
                await self._stop.wait()
                for t in tasks:
                    t.cancel()
        finally:
            ctrl.close(linger=500)
            snap.close(linger=0)
            ctx.term()

    def _router(self, ctx: zmq.asyncio.Context, port: int) -> zmq.asyncio.Socket:
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a vanished peer surfaces as an error
        # Hard cap far above the app-level limit: frames past it drop the connection before
        # they are buffered; frames between the two are rejected and counted as "oversize".
        sock.setsockopt(zmq.MAXMSGSIZE, 4 * self.max_bytes)
        sock.bind(f"tcp://{self.cfg.learner.host}:{port or '*'}")
        return sock

    def _call(self, coro_fn, *args, timeout: float = 30.0) -> Any:
        if self._error:
            raise RuntimeError(f"control plane crashed: {self._error}")
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coro_fn(*args), self._loop).result(timeout)

    def publish(self, snap: Snapshot) -> None:
        self._call(self._publish, snap)

    def stats(self) -> dict[str, Any]:
        return self._call(self._stats)

    def shutdown(self, reason: str) -> None:
        if self._loop is None or not self._thread.is_alive():
            return
        try:
            self._call(self._shutdown, reason)
        finally:
            self._thread.join(10)

    # ------------------------------------------------------------------ loop side

    async def _publish(self, snap: Snapshot) -> None:
        assert self.coordinator is not None
        self.store.add(SnapshotBuffer(snap.manifest, snap.payload))
        plan = self.coordinator.publish(snap.version)
        for w in list(self.workers.values()):
            await self._send(w, wire.SnapshotNotice(version=snap.version, manifest=snap.manifest,
                                                    source=plan.get(w.worker_id, self.snapshot_endpoint)))

    async def _stats(self) -> dict[str, Any]:
        now = time.monotonic()
        timeout = self.cfg.transport.heartbeat_timeout_s
        live = [w for w in self.workers.values() if now - w.last_seen < timeout]
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
            "learner_bytes_sent": self.store.bytes_sent,
            "t_bcast": self._last_t_bcast(),
            "in_flight_groups": self.work.in_flight,
            "reissued_groups": self.work.reissued,
            "installs": ({v: self.coordinator.install_times(v)
                          for v in sorted(self.coordinator.published)[-20:]}
                         if self.coordinator else {}),
            "workers": {w.worker_id: {"price": w.price, "version": w.version, "state": w.state,
                                      "active": self.is_active(w.worker_id),
                                      "reachable": now - w.last_seen < timeout,
                                      "throughput": round(w.measured_throughput, 3),
                                      "admitted": w.admitted} for w in self.workers.values()},
        }

    async def _shutdown(self, reason: str) -> None:
        for w in list(self.workers.values()):
            await self._send(w, wire.Shutdown(reason=reason))
        assert self._stop is not None
        self._stop.set()

    async def _send(self, w: WorkerState, msg: wire.Message) -> None:
        await self._send_ident(w.ident, msg, w.worker_id)

    async def _send_ident(self, ident: bytes, msg: wire.Message, who: str = "") -> None:
        assert self._ctrl is not None
        try:
            await self._ctrl.send_multipart([ident, wire.encode(msg)])
        except zmq.ZMQError as exc:  # EHOSTUNREACH: the peer disconnected; heartbeats reap it
            log.info("could not send %s to %s: %s", msg.type, who or ident.hex(), exc)

    async def _housekeeping(self) -> None:
        timeout = self.cfg.transport.heartbeat_timeout_s
        while True:
            await asyncio.sleep(min(0.5, timeout / 4))
            now = time.monotonic()
            for w in [w for w in self.workers.values() if now - w.last_seen > timeout]:
                self._forget(w.worker_id, f"no heartbeat for {now - w.last_seen:.1f}s")
            self._provision()
            expired = self.work.expire()
            if expired:
                log.info("%d group lease(s) expired: handed out again", expired)

    def _mu_prior(self) -> float:
        """An unmeasured worker is assumed as fast as the measured fleet's average (the
        measurements replace this after warm-up); before any measurement, the config's prior."""
        assert self.controller is not None
        measured = [w.mu_hat for w in self.controller.workers() if w.state == ACTIVE and w.mu_hat > 0]
        return sum(measured) / len(measured) if measured else self.cfg.provisioning.mu_prior

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

    def _forget(self, worker_id: str, why: str) -> None:
        w = self.workers.pop(worker_id, None)
        if w is None:
            return
        n = self.work.release_worker(worker_id)
        if self.coordinator is not None:
            self.coordinator.leave(worker_id)
        if self.controller is not None:
            self.controller.remove_worker(worker_id)
        log.info("worker %s removed (%s); %d group(s) handed out again", worker_id, why, n)

    # ------------------------------------------------------------------ request handling

    async def _serve(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            ident, *frames = await sock.recv_multipart()
            try:
                if len(frames) != 1:
                    raise wire.WireError("malformed", f"{len(frames)} frames, expected 1")
                msg = wire.decode(frames[0], self.max_bytes)
                reply = await self._dispatch(ident, msg)
            except wire.WireError as err:
                self.rejected[err.reason] += 1
                log.warning("rejected message from %s: %s", ident.hex(), err)
                reply = wire.Error(reason=err.reason, detail=err.detail)
            except Exception:
                # A bug in one handler must not take the learner's control plane down with it:
                # the message is answered, counted and logged with its traceback.
                self.rejected["internal_error"] += 1
                log.exception("internal error handling a message from %s", ident.hex())
                reply = wire.Error(reason="internal_error", detail="see the learner's log")
            if reply is not None:
                await self._send_ident(ident, reply)

    async def _dispatch(self, ident: bytes, msg: wire.Message) -> wire.Message | None:
        handler = {
            wire.Join: self._on_join, wire.Heartbeat: self._on_heartbeat,
            wire.WorkRequest: self._on_work_request, wire.Trajectories: self._on_trajectories,
            wire.Leave: self._on_leave, wire.SourceRequest: self._on_source_request,
            wire.Installed: self._on_installed,
        }.get(type(msg))
        if handler is None:
            raise wire.WireError("unknown_type", f"{msg.type} is not a request the learner serves")
        reply = handler(ident, msg)
        if reply is not None:
            reply.rid = msg.rid
        return reply

    def _touch(self, ident: bytes, worker_id: str) -> WorkerState | None:
        w = self.workers.get(worker_id)
        if w is not None:
            w.ident = ident  # a reconnecting DEALER gets a new routing id
            w.last_seen = time.monotonic()
        return w

    def _latest(self) -> tuple[int, dict[str, Any] | None]:
        buf = self.store.latest()
        return (buf.version, buf.manifest) if buf else (-1, None)

    def _on_join(self, ident: bytes, msg: wire.Join) -> wire.Message:
        now = time.monotonic()
        known = self._touch(ident, msg.worker_id)
        if known is None:
            self.workers[msg.worker_id] = WorkerState(msg.worker_id, ident, msg.price, now)
            log.info("worker %s joined (price $%.3f/h, relay %s)", msg.worker_id, msg.price,
                     msg.relay_endpoint or "none")
        assert self.coordinator is not None
        self.coordinator.join(msg.worker_id, msg.relay_endpoint if msg.can_relay else "",
                              msg.down_mbit, msg.up_mbit)
        if known is None and self.controller is not None:
            active = len(self.controller.active_ids())
            state = ACTIVE if active < self.cfg.provisioning.initial_active else STANDBY
            self.controller.add_worker(msg.worker_id, msg.price, state=state,
                                       mu_prior=self._mu_prior())
            log.info("worker %s is %s", msg.worker_id, state)
        version, manifest = self._latest()
        # A late joiner pulls the current snapshot from its place in the plan: a peer.
        return wire.JoinAck(run_id=self.run_id, instance_id=self.instance_id,
                            public_key=self.key.public_bytes, version=version, manifest=manifest,
                            config=self.cfg.worker_view(),
                            snapshot_endpoint=self.coordinator.source_for(msg.worker_id))

    def _on_heartbeat(self, ident: bytes, msg: wire.Heartbeat) -> wire.Message:
        w = self._touch(ident, msg.worker_id)
        version, manifest = self._latest()
        if w is None:
            return wire.HeartbeatAck(instance_id=self.instance_id, version=version, known=False)
        w.version, w.state, w.claimed_throughput = msg.version, msg.state, msg.throughput
        w.busy_s, w.busy_samples = msg.busy_s, msg.busy_samples
        if self.controller is not None:
            self.controller.heartbeat(msg.worker_id, up=True)
        behind = msg.version < version
        assert self.coordinator is not None
        return wire.HeartbeatAck(instance_id=self.instance_id, version=version,
                                 manifest=manifest if behind else None,
                                 source=self.coordinator.source_for(msg.worker_id) if behind else "")

    def _on_work_request(self, ident: bytes, msg: wire.WorkRequest) -> wire.Message:
        if self._touch(ident, msg.worker_id) is None:
            raise wire.WireError("unknown_worker", f"{msg.worker_id} has not joined: send join first")
        if not self.is_active(msg.worker_id):
            return wire.WorkGrant(groups=[], retry_after_s=0.5)  # standby: relay, don't roll out
        groups = self.work.grant(msg.worker_id, min(msg.max_groups, self._fair_share()),
                                 self.buffer.depth()["ready_groups"], msg.holding)
        return wire.WorkGrant(groups=groups, retry_after_s=0.0 if groups else 0.2)

    def _fair_share(self) -> int:
        """Groups one grant may carry: the outstanding bound split over the active workers.
        Workers on long links ask for large grants (worker/agent.py); without this one of
        them could lease most of the bound and leave the others idle."""
        active = (len(self.controller.active_ids()) if self.controller is not None
                  else len(self.workers))
        return max(1, math.ceil(self.work.max_outstanding / max(1, active)))

    def _on_source_request(self, ident: bytes, msg: wire.SourceRequest) -> wire.Message:
        assert self.coordinator is not None
        self._touch(ident, msg.worker_id)
        source = self.coordinator.reattach(msg.worker_id, msg.bad_source, msg.reason)
        log.info("worker %s: source %s failed (%s); now pulls from %s", msg.worker_id,
                 msg.bad_source, msg.reason, source)
        return wire.SourceGrant(version=msg.version, source=source)

    def _on_installed(self, ident: bytes, msg: wire.Installed) -> None:
        assert self.coordinator is not None
        self._touch(ident, msg.worker_id)
        self.coordinator.installed(msg.worker_id, msg.version)
        return None

    def _last_t_bcast(self) -> float | None:
        if self.coordinator is None or not self.coordinator.published:
            return None
        for version in sorted(self.coordinator.published, reverse=True):
            t = self.coordinator.t_bcast(version)
            if t is not None:
                return round(t, 4)
        return None

    def _on_leave(self, ident: bytes, msg: wire.Leave) -> None:
        self._forget(msg.worker_id, "left")
        return None

    def _on_trajectories(self, ident: bytes, msg: wire.Trajectories) -> wire.Message:
        w = self._touch(ident, msg.worker_id)
        try:
            raw = wire.unpack_records(msg.payload, self.max_bytes)
        except wire.WireError as err:
            self.rejected[err.reason] += 1
            log.warning("rejected trajectory batch %s from %s: %s", msg.batch_id, msg.worker_id, err)
            return wire.Error(reason=err.reason, detail=err.detail, ref=msg.batch_id)
        # (echo.wire refuses a bool count; were one let through, True == 1 must not pass here)
        if type(msg.count) is not int or msg.count != len(raw):
            self.rejected["count_mismatch"] += 1
            log.warning("rejected trajectory batch %s from %s: count %r for %d records",
                        msg.batch_id, msg.worker_id, msg.count, len(raw))
            return wire.Error(reason="count_mismatch", ref=msg.batch_id,
                              detail=f"count {msg.count!r} but {len(raw)} records: send count=len(records)")
        accepted: list[Record] = []
        duplicates = 0
        rejected: Counter[str] = Counter()
        rejected_idx: list[int] = []
        details: dict[str, str] = {}  # one example per reason, for the log
        for i, obj in enumerate(raw):
            outcome, rec = self._admit(obj, msg.worker_id)
            if outcome in (ACCEPTED, COMPLETED):
                accepted.append(rec)
            elif outcome == DUPLICATE:
                duplicates += 1
            else:  # stale ones are counted by the buffer as dropped_stale, the rest here
                rejected[outcome] += 1
                rejected_idx.append(i)
                if isinstance(rec, RecordError):
                    details.setdefault(outcome, rec.detail)
        if rejected:
            self.rejected.update({k: v for k, v in rejected.items()
                                  if k not in (STALE, "future_version", "buffer_full")})
            log.warning("batch %s from %s: rejected %s %s", msg.batch_id, msg.worker_id,
                        dict(rejected), details or "")
        if self.buffer_log is not None:
            self.buffer_log.admitted(accepted)  # durable before acknowledged
        if w is not None and accepted:
            self._measure(w, len(accepted))
        if w is not None and self.controller is not None:
            # Busy time of the batch (every record of a batch carries the same gen_s): the
            # controller then measures capacity, not how much work it was handed.
            busy = max((r.gen_s for r in accepted if r is not None), default=None)
            self.controller.observe(w.worker_id, len(raw), busy_s=busy)
        return wire.Ack(batch_id=msg.batch_id, accepted=len(accepted), duplicates=duplicates,
                        rejected=dict(rejected), rejected_idx=rejected_idx)

    def _admit(self, obj: Any, sender: str) -> tuple[str, Record | RecordError | None]:
        """(outcome, the record; or the parse error when it did not parse)."""
        try:
            rec = parse_record(obj, self.limits)
        except RecordError as err:
            return err.reason, err
        if rec.worker_id != sender:  # a record speaks for the worker that sent it, no other
            return "identity_mismatch", rec
        if self.buffer.is_done(rec.group_id):
            return self.buffer.admit(rec), rec  # counted there as a duplicate
        group = self.work.lookup(rec.group_id)
        if group is None:
            return "unknown_group", rec
        if rec.prompt_ids != group.prompt_ids:
            return "prompt_mismatch", rec
        outcome = self.buffer.admit(rec)
        if outcome == COMPLETED:
            self.work.fulfilled(rec.group_id)
        elif outcome == STALE:
            self.work.requeue(rec.group_id)  # regenerate it under a fresh snapshot
        return outcome, rec

    def _measure(self, w: WorkerState, accepted: int) -> None:
        now = time.monotonic()
        rate = accepted / max(now - w.last_batch_at, 1e-3)
        w.measured_throughput = (rate if w.admitted == 0 else
                                 EWMA_ALPHA * rate + (1 - EWMA_ALPHA) * w.measured_throughput)
        w.admitted += accepted
        w.last_batch_at = now
