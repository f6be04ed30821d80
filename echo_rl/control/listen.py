"""The learner server's sockets (docs/ports.md): CURVE ROUTERs on learner.host, their
handshake monitors, the error that names the config key of a port already taken, and the
control socket's traffic once bound (``ControlSocket``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter

import zmq
import zmq.asyncio

from echo_rl.control.cpu import CpuBook
from echo_rl.control.deliveries import Deferred
from echo_rl.control.dispatch import Dispatcher
from echo_rl.control.sessions import WorkerState
from echo_rl.core import wire
from echo_rl.core.errors import EchoError
from echo_rl.core.security import ZAP_DOMAIN, KeyPair, curve_server, sender_key

log = logging.getLogger("echo.control")

CHUNK_DOMAIN = b"echo-chunks"
# Acknowledgements waiting for their records to be durable (group commit); bounded, the
# overflow policy is back-pressure (ControlSocket.acks).
ACK_QUEUE = 1024
SERVE_BURST = 8  # messages served back to back before the loop lets its other tasks run
SERVE_SLICE_S = 0.005  # ... or this long, whichever comes first


class PortTaken(EchoError, RuntimeError):
    """A listening port the learner cannot have (a start-up error, one line with its fix)."""

    default_reason = "port_taken"


def port_taken(key: str, host: str, port: object, exc: Exception) -> PortTaken:
    """A listening port the learner cannot have, said with the key that sets it."""
    return PortTaken(
        f"cannot listen on {host} port {port} ({key}): {exc}. Another process holds it (a "
        f"learner still running?): stop it, or set {key} to a free port (0: the OS picks; "
        f"docs/ports.md)"
    )


def router(
    ctx: zmq.asyncio.Context,
    host: str,
    port: int,
    max_msg: int,
    key: str,
    keys: KeyPair | None,
    zap_domain: bytes = b"",
) -> zmq.asyncio.Socket:
    """A ROUTER listening on ``host``:``port`` (the config's ``key``), a CURVE server with
    ``keys`` (None: plaintext)."""
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a vanished peer surfaces as an error
    # Hard cap above the app-level limit: frames past it drop the connection before they
    # are buffered; frames between the two are rejected and counted as "oversize".
    sock.setsockopt(zmq.MAXMSGSIZE, max_msg)
    if keys is not None:
        curve_server(sock, keys, zap_domain or ZAP_DOMAIN)
    try:
        sock.bind(f"tcp://{host}:{port or '*'}")
    except zmq.ZMQError as exc:
        sock.close(linger=0)
        raise port_taken(key, host, port, exc) from None
    return sock


def handshake_monitor(sock: zmq.asyncio.Socket, curve: bool) -> zmq.asyncio.Socket | None:
    """Set up before the socket serves anyone, so no failed handshake goes uncounted."""
    if not curve:
        return None
    return sock.get_monitor_socket(
        zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    )


async def count_handshakes(mon: zmq.asyncio.Socket | None, refused: Counter[str]) -> None:
    """Counts failed handshakes: plaintext clients and clients pinning another key (ZAP
    refusals are counted by the gate with their reason)."""
    if mon is None:
        return
    try:
        while True:
            await mon.recv_multipart()
            refused["handshake_failed"] += 1
    finally:
        mon.close(linger=0)


class ControlSocket:
    """The control ROUTER once bound: requests in (each through the dispatcher, served in
    bursts), replies and pushes out, and acknowledgements held until their records are
    durable. Every send is NOBLOCK: a peer that never reads loses its replies, nobody else
    waits for it."""

    def __init__(self, workers: dict[str, WorkerState], cpu: CpuBook):
        self.workers = workers  # the session table's: worker id -> its connection
        self.cpu = cpu
        self.sock: zmq.asyncio.Socket | None = None
        # Acknowledgements waiting for their records to be durable (group commit). Overflow
        # policy: when full, the serve loop waits for room before it reads the next message.
        self.acks: asyncio.Queue[tuple[bytes, Deferred]] = asyncio.Queue(ACK_QUEUE)

    def push(self, worker_id: str, msg: wire.Message) -> None:
        """Send ``msg`` to a worker now, from synchronous code (a punch must leave before the
        source it goes with). A full queue drops it; the link then fails and the worker asks
        again (``unpunchable``)."""
        w = self.workers.get(worker_id)
        if w is not None:
            self.push_ident(w.ident, msg, worker_id)

    def push_ident(self, ident: bytes, msg: wire.Message, who: str) -> None:
        """``push`` to a connection, for a worker the server no longer holds a session for."""
        assert self.sock is not None
        try:
            zmq.Socket.shadow(self.sock.underlying).send_multipart(
                [ident, wire.encode(msg)], flags=zmq.NOBLOCK
            )
        except zmq.ZMQError as exc:
            log.info("could not send %s to %s: %s", msg.type, who, exc)

    async def send(self, w: WorkerState, msg: wire.Message) -> None:
        await self.send_ident(w.ident, msg, w.worker_id)

    async def send_ident(self, ident: bytes, msg: wire.Message, who: str = "") -> None:
        assert self.sock is not None
        try:
            # NOBLOCK: a peer that sends but never reads fills its queue; a reply it will not
            # read is dropped rather than stalling the loop that serves everyone.
            await self.sock.send_multipart([ident, wire.encode(msg)], flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # EHOSTUNREACH: the peer disconnected; heartbeats reap it
            log.info("could not send %s to %s: %s", msg.type, who or ident.hex(), exc)

    async def serve(self, sock: zmq.asyncio.Socket, d: Dispatcher) -> None:
        """Every request on ``sock``, each through ``d``, until cancelled."""
        served, turn = 0, time.monotonic()
        while True:
            ident, *frames = await sock.recv_multipart(copy=False)
            t0 = time.thread_time()
            key = sender_key([ident, *frames])
            d.kind = "refused"  # until the dispatcher names the request
            reply = await d.handle(ident.bytes, key, [f.bytes for f in frames])
            if isinstance(reply, Deferred):
                await self.acks.put((ident.bytes, reply))  # full: back-pressure on this loop
            elif reply is not None:
                await self.send_ident(ident.bytes, reply)
            self.cpu.add(d.kind, time.thread_time() - t0)
            # A receive that finds a message queued returns without suspending: under a backlog
            # (a join flood) this loop would serve every queued message before the trainer's
            # publish or stats call got a turn. SERVE_BURST messages or SERVE_SLICE_S (a join
            # flood: 22 ms a join), then everyone else's turn: a turn after every message cost a
            # loop cycle each (docs/scale.md).
            served += 1
            if served >= SERVE_BURST or time.monotonic() - turn > SERVE_SLICE_S:
                await asyncio.sleep(0)
                served, turn = 0, time.monotonic()

    async def send_acks(self) -> None:
        """Acknowledgements, in order, each once its records are durable (group commit,
        ``echo_rl.data.durable``): the loop serves heartbeats and chunks meanwhile. A failed write
        ends the server: what was not made durable must not be acknowledged, ever."""
        while True:
            ident, deferred = await self.acks.get()
            try:
                await asyncio.wrap_future(deferred.durable)
            except Exception as exc:
                await self.send_ident(
                    ident,
                    wire.Error(
                        reason="internal_error",
                        detail="the learner could not store the batch; resend it",
                        rid=deferred.reply.rid,
                    ),
                )
                raise RuntimeError(f"buffer log write failed: {exc!r}") from exc
            await self.send_ident(ident, deferred.reply)
