"""The root of the broadcast benchmark: the learner's broadcast side with the same code the
learner uses (``Coordinator`` + ``ChunkServer``, uplink shaped at U), serving the relay processes
of ``labs.broadcast_relay`` over a ROUTER socket (joins, NAT reports, re-attaches, installs and
audit digests). ``RecordedVersions`` replays real recorded versions through the learner's
``VersionEncoder``.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import blake3
import zmq
import zmq.asyncio

from echo_rl.broadcast.coordinator import Coordinator
from echo_rl.broadcast.dialer import SOCKET_BUFFER
from echo_rl.broadcast.manifest import Manifest
from echo_rl.broadcast.nat.reflect import Reflector
from echo_rl.broadcast.relay import bucket
from echo_rl.broadcast.snapshot import RunKey, build_manifest
from echo_rl.broadcast.source import ChunkServer
from echo_rl.broadcast.store import SnapshotBuffer, SnapshotStore
from echo_rl.broadcast.tickets import Source, TicketCheck, mint
from echo_rl.broadcast.topology import make_topology
from echo_rl.broadcast.versions import VersionEncoder
from echo_rl.core import wire
from echo_rl.core.security import KeyPair, ZapHandler, curve_server, peer_key
from labs import natlab, netns
from labs.broadcast_relay import MAX_BYTES
from labs.doubles import DeclaredRatesCoordinator


@dataclass
class BenchParams:
    workers: int
    snapshot_mib: float
    uplink_mbit: float
    link_mbit: float
    topology: str
    kill_fraction: float = 0.0
    corrupt_relays: int = 0
    chunk_kib: int = 1024
    window: int = 4
    chains: int = 0
    timeout_s: float = 10.0
    seed: int = 0
    netns: bool = False  # links shaped by the kernel (tc tbf in namespaces), not in the app
    nat: int = 0  # with netns: this many workers behind home NATs (docs/nat.md)
    symmetric: int = 0  # ... of which this many behind symmetric NATs
    punch: bool = True  # NAT'd workers relay through punched links (False: they are tails)
    curve: bool = False  # CurveZMQ on every socket and pull tickets, as a real run has
    publications: int = 1  # versions published in a row (re-planned at each)
    liar_up_mbit: float = 0.0  # r00's real uplink; it declares 10x this (0: no liar)
    trust_declared: bool = False  # plan on declared rates only (the old behaviour)
    versions_dir: str = ""  # replay recorded full payloads (layout.json, v000.bin, ...)
    delta: bool = True  # with versions_dir: publish deltas between keyframes
    keyframe_every: int = 10
    trace: str = ""  # a folder: per-node traces (root.json, rNN.json) of who fed whom, when


class Root:
    def __init__(self, p: BenchParams):
        self.p = p
        self.ctx = zmq.asyncio.Context()
        self.ctrl = self.ctx.socket(zmq.ROUTER)
        self.ctrl.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.keys = KeyPair.generate() if p.curve else None
        self.zap = ZapHandler(self.ctx, lambda addr, key: "") if self.keys is not None else None
        if self.keys is not None:
            curve_server(self.ctrl, self.keys)
        host = (natlab.ROOT_ADDR if p.nat else netns.address(None)) if p.netns else "127.0.0.1"
        self.host = host
        self.reflector: Reflector | None = None  # started in serve() when NAT'd workers punch
        self.classified: set[str] = set()
        self.ctrl.bind(f"tcp://{host}:*")
        self.endpoint = self.ctrl.getsockopt_string(zmq.LAST_ENDPOINT)
        snap = self.ctx.socket(zmq.ROUTER)
        snap.setsockopt(zmq.ROUTER_MANDATORY, 1)
        snap.setsockopt(zmq.SNDBUF, SOCKET_BUFFER)
        if self.keys is not None:
            curve_server(snap, self.keys)
        snap.bind(f"tcp://{host}:*")
        self.store = SnapshotStore()
        uplink = (
            None
            if p.topology == "star-unlimited" or p.netns
            else bucket(p.uplink_mbit, p.chunk_kib * 1024)
        )
        self.key = RunKey.generate()
        tickets = (
            TicketCheck(
                lambda: self.key.public_bytes, snap.getsockopt_string(zmq.LAST_ENDPOINT)
            ).check
            if self.keys is not None
            else None
        )
        self.server = ChunkServer(snap, self.store, MAX_BYTES, upload=uplink, authorize=tickets)
        self.peer_keys: dict[str, str] = {}  # worker -> its CURVE key
        self.relay_keys: dict[str, str] = {}  # relay endpoint -> its CURVE key
        topo = make_topology(
            p.topology,
            uplink_mbit=p.uplink_mbit or None,
            link_mbit=p.link_mbit or None,
            chunk_bytes=p.chunk_kib * 1024,
        )
        if p.chains and hasattr(topo, "params"):
            from dataclasses import replace

            topo.params = replace(topo.params, chains=p.chains)  # type: ignore[attr-defined]
        kind = DeclaredRatesCoordinator if p.trust_declared else Coordinator
        self.coord = kind(topo, snap.getsockopt_string(zmq.LAST_ENDPOINT))
        self.version = 1  # the version being broadcast
        self.idents: dict[str, bytes] = {}
        self.joined = asyncio.Event()
        self.digests: dict[int, dict[str, bytes]] = {}  # version -> worker -> audit digest
        self.all_installed = asyncio.Event()
        self.audited = asyncio.Event()
        self.dead: set[str] = set()
        self.reattaches: list[tuple[str, str, str]] = []
        self.events: list[dict[str, Any]] = []  # the root's trace (--trace)

    async def source_routed(self, wid: str, endpoint: str) -> Source:
        """``source``, through a punched link when the parent is only punchable (its punches
        leave first, as the learner's do)."""
        routed, punches = self.coord.route(wid, endpoint)
        for to, punch in punches:
            await self.ctrl.send_multipart([self.idents[to], wire.encode(punch)])
        src = self.source(wid, endpoint)
        return Source(routed, src.key, src.ticket)

    def source(self, wid: str, endpoint: str) -> Source:
        if self.keys is None:
            return Source(endpoint)
        server = (
            self.keys.text if endpoint == self.coord.source else self.relay_keys.get(endpoint, "")
        )
        return Source(
            endpoint, server.encode(), mint(self.key, self.peer_keys[wid], endpoint, "bench", 3600)
        )

    async def serve(self) -> None:
        if self.p.nat and self.p.punch:
            self.reflector = Reflector(self.host)
            await self.reflector.start()
        if self.zap is not None:
            self.zap_task = asyncio.ensure_future(self.zap.serve())
        while True:
            ident, frame = await self.ctrl.recv_multipart(copy=False)
            key = peer_key(frame)
            ident = ident.bytes
            msg = wire.decode(frame.bytes, MAX_BYTES)
            reply: wire.Message | None = None
            if isinstance(msg, wire.Join):
                self.idents[msg.worker_id] = ident
                self.peer_keys[msg.worker_id] = key
                self.relay_keys[msg.relay_endpoint] = key
                self.coord.join(
                    msg.worker_id,
                    msg.relay_endpoint,
                    msg.down_mbit,
                    msg.up_mbit,
                    nat="unknown" if self.reflector else "reachable",
                )
                reply = wire.JoinAck(
                    run_id="bench",
                    instance_id="bench",
                    public_key=self.key.public_bytes,
                    version=-1,
                    config={},
                    snapshot_endpoint=self.coord.source,
                    reflectors=self.reflector.endpoints if self.reflector else [],
                )
                self._check_joined()
            elif isinstance(msg, wire.NatReport) and self.reflector is not None:
                peer = self.coord.peers[msg.worker_id]
                nat, address = self.reflector.classify(msg.nonces, peer.endpoint)
                self.coord.classify(msg.worker_id, nat, address)
                self.classified.add(msg.worker_id)
                reply = wire.NatStatus(nat=nat, address=address)
                self._check_joined()
            elif isinstance(msg, wire.SourceRequest):
                self.reattaches.append((msg.worker_id, msg.bad_source, msg.reason))
                src = await self.source_routed(
                    msg.worker_id, self.coord.reattach(msg.worker_id, msg.bad_source, msg.reason)
                )
                self.events.append(
                    {
                        "at": time.time(),
                        "event": "reattach",
                        "worker": msg.worker_id,
                        "bad": msg.bad_source,
                        "reason": msg.reason,
                        "granted": src.endpoint,
                    }
                )
                reply = wire.SourceGrant(
                    version=msg.version, source=src.endpoint, source_key=src.key, ticket=src.ticket
                )
            elif isinstance(msg, wire.Installed):
                if msg.digest:  # an audit digest, sent when asked
                    self.digests.setdefault(msg.version, {})[msg.worker_id] = msg.digest
                    self._check_audited()
                else:
                    self.coord.installed(msg.worker_id, msg.version)
                    self.coord.measured(msg.worker_id, msg.version, msg.down_mbit, msg.up_mbit)
                    self._check_done()
            if reply is not None:
                reply.rid = msg.rid
                await self.ctrl.send_multipart([ident, wire.encode(reply)])

    def _check_joined(self) -> None:
        if len(self.idents) == self.p.workers and (
            self.reflector is None or len(self.classified) == self.p.workers
        ):
            self.joined.set()

    def _check_done(self) -> None:
        alive = set(self.idents) - self.dead
        if alive and alive <= set(self.coord.install_times(self.version)):
            self.all_installed.set()

    def _check_audited(self) -> None:
        alive = set(self.idents) - self.dead
        if alive and alive <= set(self.digests.get(self.version, {})):
            self.audited.set()

    async def audit(self) -> None:
        """Ask every live relay for the digest of what it rebuilt (untimed)."""
        self.audited.clear()
        for wid, ident in self.idents.items():
            if wid not in self.dead:
                await self.ctrl.send_multipart([ident, wire.encode(wire.Shutdown(reason="audit"))])
        await asyncio.wait_for(self.audited.wait(), 120)

    def prepare(self, payload: bytes, version: int = 1) -> Manifest:
        manifest = build_manifest(
            run_id="bench",
            version=version,
            tensors=[],
            payload=payload,
            chunk_size=self.p.chunk_kib * 1024,
            dtype="uint8",
            key=self.key,
        )
        self.store.add(SnapshotBuffer(manifest, payload))
        return manifest

    async def publish(self, manifest: Manifest) -> dict[str, str]:
        self.version = manifest.version
        self.all_installed.clear()
        sources = self.coord.publish(self.version)
        notices = {}  # minted before the first goes out: signing is not broadcast time
        for wid, endpoint in sources.items():
            src = await self.source_routed(wid, endpoint)
            notices[wid] = wire.encode(
                wire.SnapshotNotice(
                    version=self.version,
                    manifest=manifest.to_wire(),
                    source=src.endpoint,
                    source_key=src.key,
                    ticket=src.ticket,
                )
            )
        self.events.append(
            {"at": time.time(), "event": "publish", "version": self.version, "sources": sources}
        )
        for wid, frame in notices.items():
            await self.ctrl.send_multipart([self.idents[wid], frame])
        self.events.append({"at": time.time(), "event": "notices_sent", "version": self.version})
        return sources

    async def shutdown(self) -> None:
        for ident in self.idents.values():
            try:
                await self.ctrl.send_multipart(
                    [ident, wire.encode(wire.Shutdown(reason="bench over"))]
                )
            except zmq.ZMQError:
                pass


class RecordedVersions:
    """Real versions replayed (``--versions-dir``, written by ``benchmarks/delta_real.py
    --record``): each file's full payload goes through the learner's ``VersionEncoder``."""

    def __init__(self, p: BenchParams, key: RunKey):
        folder = Path(p.versions_dir)
        self.layout = json.loads((folder / "layout.json").read_text())
        self.files = sorted(folder.glob("v[0-9][0-9][0-9].bin"))
        if not self.files:
            raise SystemExit(
                f"--versions-dir {folder}: no v000.bin ... (record some with "
                f"benchmarks/delta_real.py --record {folder})"
            )
        self.encoder = VersionEncoder(
            run_id="bench",
            key=key,
            chunk_size=p.chunk_kib * 1024,
            dtype="bfloat16",
            delta=p.delta,
            keyframe_every=p.keyframe_every,
        )
        self.full_bytes = self.files[0].stat().st_size

    def prepare(self, root: Root, version: int) -> tuple[Manifest, bytes]:
        """The publication of ``version`` (1-based) in the root's store; its full digest."""
        full = self.files[version - 1].read_bytes()
        pub = self.encoder.build(version, self.layout, full)
        root.store.add(SnapshotBuffer(pub.manifest, pub.payload))
        return pub.manifest, blake3.blake3(full).digest()
