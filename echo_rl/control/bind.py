"""The learner server's start-up on its loop: every listening socket bound on its port
(docs/ports.md: ZAP, control, chunks, reflector), the endpoints handed out, and what needs the
bound sockets (the broadcast plan, the chunk server, the prober), handed to the parts that use
them. ``bind`` returns it all as one ``Bound``, which the server serves and closes at the end.
"""

from __future__ import annotations

from dataclasses import dataclass

import zmq
import zmq.asyncio

from echo_rl.broadcast.coordinator import Coordinator
from echo_rl.broadcast.nat.reflect import Reflector, ReflectorPortTaken
from echo_rl.broadcast.reports import ReportBook
from echo_rl.broadcast.snapshot import RunKey
from echo_rl.broadcast.source import ChunkServer, ServeLimits
from echo_rl.broadcast.store import SnapshotStore
from echo_rl.broadcast.tickets import mint
from echo_rl.broadcast.topology import Topology
from echo_rl.control.listen import CHUNK_DOMAIN, port_taken, router
from echo_rl.control.parts import Parts
from echo_rl.control.verify import Verifier
from echo_rl.core.addresses import public_endpoint
from echo_rl.core.config import EchoConfig
from echo_rl.core.security import ZapHandler


@dataclass
class Served:
    """What the server serves from its sockets: the snapshot stores and the run's ticket key."""

    store: SnapshotStore  # the versions held
    results: SnapshotStore  # their full payloads (keyframes)
    bases: SnapshotStore  # a LoRA run's base model
    topology: Topology
    key: RunKey
    run_id: str
    max_bytes: int


@dataclass
class Bound:
    """The bound sockets, the endpoints they are reached at, and what was built on them."""

    ctx: zmq.asyncio.Context
    zap: ZapHandler | None
    ctrl: zmq.asyncio.Socket
    snap: zmq.asyncio.Socket
    endpoint: str
    snapshot_endpoint: str
    reflector: Reflector | None  # docs/nat.md; None with nat_traversal off
    coordinator: Coordinator
    chunks: ChunkServer
    verifier: Verifier

    def close(self, curve: bool) -> None:
        """When the loop ends: monitors off, sockets closed, the context ended."""
        for sock in (self.ctrl, self.snap):
            if curve:
                sock.disable_monitor()
        self.ctrl.close(linger=500)
        self.snap.close(linger=0)
        if self.reflector is not None:
            self.reflector.close()
        if self.zap is not None:
            self.zap.close()
        self.ctx.term()


async def bind(cfg: EchoConfig, parts: Parts, served: Served) -> Bound:
    """Bind every socket, then build what needs them and attach it to the parts."""
    ctx = zmq.asyncio.Context()
    try:
        zap, ctrl, snap, endpoints, reflector = await _listen(ctx, cfg, parts, served.max_bytes)
    except BaseException:
        ctx.destroy(linger=0)  # a start that failed (a port taken) frees what it bound
        raise
    endpoint, snapshot_endpoint = endpoints
    bc, sc = cfg.broadcast, cfg.security
    coordinator = Coordinator(
        served.topology,
        snapshot_endpoint,
        q=bc.q,
        reports=ReportBook(bc.convict_after, bc.report_avoid_s, bc.relay_mark_s),
    )
    coordinator.punches.timeout_s = bc.punch_timeout_s
    chunks = ChunkServer(
        snap,
        served.store,
        served.max_bytes,
        authorize=parts.routes.may_pull,
        limits=ServeLimits(
            max_parked_per_peer=sc.max_parked_per_peer,
            max_parked_total=sc.max_parked_total,
            requests_per_s=sc.peer_chunk_requests_per_s,
        ),
        results=served.results,
        bases=served.bases,
    )
    # The probe's tickets live as long as a child's: nothing in them tells the two apart.
    verifier = Verifier(
        ctx,
        lambda child, parent: mint(served.key, child, parent, served.run_id, sc.ticket_ttl_s),
        served.max_bytes,
        window=bc.window,
    )
    parts.routes.attach(coordinator, verifier, snapshot_endpoint)
    parts.members.attach(coordinator, reflector, (endpoint, snapshot_endpoint))
    parts.stats.chunks = chunks
    return Bound(
        ctx, zap, ctrl, snap, endpoint, snapshot_endpoint, reflector, coordinator, chunks, verifier
    )


async def _listen(
    ctx: zmq.asyncio.Context, cfg: EchoConfig, parts: Parts, max_bytes: int
) -> tuple[ZapHandler | None, zmq.asyncio.Socket, zmq.asyncio.Socket, list[str], Reflector | None]:
    """Every listening socket on its port (docs/ports.md): ZAP, control, chunks, reflector."""
    gate = parts.gate
    # Bound before the sockets: no handshake may come before the handler that judges it.
    zap = (
        ZapHandler(ctx, parts.members.zap_control, {CHUNK_DOMAIN: parts.routes.zap_chunks})
        if gate.keys is not None
        else None
    )
    ports, lc = cfg.listen_ports(), cfg.learner
    ctrl = parts.socket.sock = router(
        ctx, lc.host, ports.control, 4 * max_bytes, "learner.port", gate.keys
    )
    # Chunk requests only; only joined keys connect here (SnapshotRoutes.zap_chunks).
    snap = router(
        ctx,
        lc.host,
        ports.chunks,
        1 << 16,
        "learner.chunk_port",
        gate.keys,
        zap_domain=CHUNK_DOMAIN,
    )
    # Every endpoint handed out names the learner's public host (echo_rl.core.addresses).
    endpoints = [
        public_endpoint(s.getsockopt_string(zmq.LAST_ENDPOINT), lc.host, lc.public_host)
        for s in (ctrl, snap)
    ]
    reflector = None
    if cfg.broadcast.nat_traversal:
        # bound where the server is, announced where workers reach it
        reflector = Reflector(lc.host, advertise=lc.public_host, ports=ports.reflectors)
        try:
            await reflector.start()
        except ReflectorPortTaken as exc:
            cause = exc.__cause__ if isinstance(exc.__cause__, OSError) else exc
            raise port_taken("learner.reflector_ports", lc.host, exc.port, cause) from None
    return zap, ctrl, snap, endpoints, reflector
