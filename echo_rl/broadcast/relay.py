"""A relay node: receives snapshots chunk by chunk and serves them onward at once.

Every worker runs one (and so does each process of the broadcast benchmark). It binds a
ROUTER for its child, holds the newest snapshots in a ``SnapshotStore`` and pulls from the
parent the coordinator assigned, with a bounded window. A chunk is verified before it is
stored, and the chunk server answers the child's parked request the moment it is stored:
store-and-forward per chunk, one inbound and at most one outbound stream.

With ``keys`` (the worker's CURVE key pair) the relay's socket is a CURVE server: it serves only
the peers holding a pull ticket for this relay signed by the run's key (``echo_rl.broadcast.tickets``),
and its fetches pin their source's key. Its ZAP handler bounds new connections per second.

Delta snapshots (docs/broadcast.md): the relay moves a delta's bytes like any payload. The
worker around it rebuilds the version (``echo_rl.broadcast.versions.rebuild``) and hands the result
back (``hold_result``): the relay keeps the full payload of the installed version, the base of
the next delta, and serves it as a keyframe (chunk requests of form "full") to a worker that
lacks the base; ``receive_keyframe`` is the other end of that.
"""

from __future__ import annotations

import asyncio
import mmap
from collections.abc import Callable
from dataclasses import dataclass

import zmq
import zmq.asyncio

from echo_rl.broadcast.base_manifest import BaseManifest
from echo_rl.broadcast.dialer import SOCKET_BUFFER, Dialer
from echo_rl.broadcast.fetch import (
    REQUEST_BYTES,
    FetchStats,
    Reattach,
    Resolve,
    fetch_into,
    stall_bound,
)
from echo_rl.broadcast.manifest import ChunkLayout, Manifest
from echo_rl.broadcast.memory import keep_chunk_buffers
from echo_rl.broadcast.shaping import TokenBucket
from echo_rl.broadcast.source import ChunkServer, ServeLimits
from echo_rl.broadcast.store import SnapshotBuffer, SnapshotStore
from echo_rl.broadcast.tickets import Source, TicketCheck
from echo_rl.core import rates
from echo_rl.core.errors import EchoError
from echo_rl.core.layout import Payload
from echo_rl.core.security import KeyPair, PeerLimits, ZapHandler, curve_server

MBIT = 125_000.0  # bytes per second in one Mbit/s


def bucket(mbit: float, chunk_bytes: int) -> TokenBucket | None:
    """A link shaped at ``mbit`` (0 = not shaped) holding two chunks of burst."""
    return TokenBucket(mbit * MBIT, 2 * chunk_bytes) if mbit > 0 else None


@dataclass
class RelayConfig:
    bind_host: str = "127.0.0.1"
    port: int = 0  # the relay's listening port (echo-worker join --relay-port; 0: the OS picks)
    punch_host: str = ""  # the address probes and punched links leave from ("" = bind_host)
    punch_port: int = 0  # their port (--punch-port; 0: the OS picks)
    serve: bool = True  # False: behind NAT, cannot accept a child
    window: int = 4
    timeout_s: float = 10.0
    max_bytes: int = 64 * 2**20
    down_mbit: float = 0.0  # declared link rates (the planner uses them), 0 = unknown
    up_mbit: float = 0.0
    shape: bool = False  # also throttle the links to those rates (tests and benchmarks)
    chunk_bytes: int = 1 << 20
    max_parked_per_peer: int = 64  # security.max_parked_per_peer (from the learner's config)
    max_parked_total: int = 4096
    handshakes_per_s: float = 50.0  # new connections accepted per second (burst 2x)
    requests_per_s: float = 1000.0  # chunk requests per second per peer (burst 2x)
    # Where whole versions kept for later (the installed version's full payload, the base
    # model) are spilled to files read through maps (echo_rl.core.spill, docs/memory.md); "": in RAM.
    spill_dir: str = ""


class RelayPortTaken(EchoError, RuntimeError):
    default_reason = "relay_port_taken"


class Relay:
    server_class = ChunkServer  # what serves children; a test double swaps it (labs/doubles.py)

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        cfg: RelayConfig,
        *,
        keys: KeyPair | None = None,
        run_key: Callable[[], bytes] | None = None,
        resolve: Resolve | None = None,
    ):
        """``keys``: serve and fetch over CURVE; ``run_key``: the run's Ed25519 public key
        (it checks pull tickets; it changes when the worker joins another run); ``resolve``:
        where a fetch connects for a source, through punched links
        (``echo_rl.broadcast.nat.links.Tunnels.resolve``), if any."""
        keep_chunk_buffers()  # every relaying process receives chunk after chunk
        self.ctx = ctx
        self.cfg = cfg
        self.keys = keys
        self._handshakes = rates.TokenBucket(cfg.handshakes_per_s, 2 * cfg.handshakes_per_s)
        self._per_ip = PeerLimits(cfg.handshakes_per_s / 5, cfg.handshakes_per_s / 2.5)
        self.store = SnapshotStore(keep=2)
        # The installed version's full payload (a keyframe source, the next delta's base).
        self.results = SnapshotStore(keep=1, recycle=False)
        # The run's base model (a LoRA run), once this node holds all of it, verified.
        self.bases = SnapshotStore(keep=1, recycle=False)
        self.endpoint = ""
        self.down_mbit_measured = 0.0  # this node's fetches, EWMA (the stall bound: _stall)
        self.resolve = resolve
        # Connections to sources kept between fetches: one handshake per source, not per
        # version (echo_rl.broadcast.dialer).
        self.dialer = Dialer(ctx, keys)
        self.server: ChunkServer | None = None
        self.zap: ZapHandler | None = None
        self.download = bucket(cfg.down_mbit, cfg.chunk_bytes) if cfg.shape else None
        if cfg.serve:
            sock = ctx.socket(zmq.ROUTER)
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDBUF, SOCKET_BUFFER)
            sock.setsockopt(zmq.MAXMSGSIZE, REQUEST_BYTES)  # children send only requests
            if keys is not None:
                self.zap = ZapHandler(
                    ctx, self._admit
                )  # before the bind: it judges every handshake
                curve_server(sock, keys)
            try:
                sock.bind(f"tcp://{cfg.bind_host}:{cfg.port or '*'}")
            except zmq.ZMQError as exc:
                sock.close(linger=0)
                raise RelayPortTaken(
                    f"cannot listen on {cfg.bind_host} port {cfg.port} for the relay: {exc}. "
                    f"Another process holds it (a second worker on this machine?): give each "
                    f"worker its own --relay-port, or --relay-port 0 to let the OS pick "
                    f"(docs/ports.md)"
                ) from None
            self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
            tickets = (
                TicketCheck(run_key, self.endpoint).check
                if keys is not None and run_key is not None
                else None
            )
            self.server = self.server_class(
                sock,
                self.store,
                cfg.max_bytes,
                upload=bucket(cfg.up_mbit, cfg.chunk_bytes) if cfg.shape else None,
                authorize=tickets,
                limits=ServeLimits(
                    max_parked_per_peer=cfg.max_parked_per_peer,
                    max_parked_total=cfg.max_parked_total,
                    requests_per_s=cfg.requests_per_s,
                ),
                results=self.results,
                bases=self.bases,
            )

    async def serve_forever(self) -> None:
        if self.server is None:
            return
        async with asyncio.TaskGroup() as tg:
            if self.zap is not None:
                tg.create_task(self.zap.serve())
            tg.create_task(self.server.serve_forever())

    def _admit(self, address: str, key: str) -> str:
        """Any key may connect (the ticket decides what it gets), at a bounded rate."""
        if not self._per_ip.take(address) or not self._handshakes.take():
            if self.server is not None:  # the ZAP handler runs only beside a server
                self.server.rejected["handshake_rate"] += 1
            return "rate_limited"
        return ""

    async def receive(
        self, manifest: Manifest, source: Source | str, reattach: Reattach | None
    ) -> tuple[SnapshotBuffer, FetchStats]:
        """Pull every missing chunk of a verified manifest's payload (resuming across
        sources; ``verify_manifest`` made ``manifest`` where it arrived)."""
        buf = self.store.get(manifest.version)
        if buf is None or buf.layout.chunk_hashes != manifest.chunk_hashes:
            # (a held buffer of this version with other chunks: a crashed learner's, whose
            # resumed instance published the version again; its chunks would never verify)
            storage = self.store.storage_for(manifest.layout)
            buf = self.store.add(SnapshotBuffer(manifest, storage=storage))
        stats = await fetch_into(
            self.ctx,
            self.store,
            buf.version,
            source,
            window=self.cfg.window,
            timeout_s=self.cfg.timeout_s,
            max_bytes=self.cfg.max_bytes,
            download=self.download,
            reattach=reattach,
            resolve=self.resolve,
            stall_s=self._stall(buf.layout),
            dialer=self.dialer,
        )
        self._measured(stats)
        return buf, stats

    async def receive_keyframe(
        self, manifest: Manifest, source: Source | str, reattach: Reattach | None
    ) -> tuple[bytearray, FetchStats]:
        """The full payload of a verified manifest's version, from a node that rebuilt it,
        every chunk checked against the signed result hashes."""
        return await self._fetch_whole(SnapshotBuffer(manifest.result_layout), source, reattach)

    async def receive_base(
        self, manifest: BaseManifest, source: Source | str, reattach: Reattach | None
    ) -> tuple[bytearray, FetchStats]:
        """The base model's payload of a verified base manifest (``echo_rl.broadcast.basemodel``),
        every chunk checked against its signed hashes; served onward once whole."""
        return await self._fetch_whole(SnapshotBuffer(manifest), source, reattach)

    async def _fetch_whole(
        self, buf: SnapshotBuffer, source: Source | str, reattach: Reattach | None
    ) -> tuple[bytearray, FetchStats]:
        """One whole payload (a keyframe or the base model) into a store of its own, with this
        relay's window, limits and keys; every chunk checked against ``buf``'s signed hashes."""
        store = SnapshotStore(keep=1, recycle=False)
        store.add(buf)
        stats = await fetch_into(
            self.ctx,
            store,
            buf.version,
            source,
            window=self.cfg.window,
            timeout_s=self.cfg.timeout_s,
            max_bytes=self.cfg.max_bytes,
            download=self.download,
            reattach=reattach,
            resolve=self.resolve,
            stall_s=self._stall(buf.layout),
            dialer=self.dialer,
        )
        self._measured(stats)
        assert isinstance(buf.payload, bytearray)  # received into a buffer of its own
        return buf.payload, stats

    def _stall(self, layout: ChunkLayout) -> float:
        """Silence taken for a stalled source: a few of this payload's chunks at the rate the
        last fetches measured."""
        chunk = min(layout.chunk_size, layout.payload_size)
        return stall_bound(self.down_mbit_measured, chunk, self.cfg.timeout_s)

    def _measured(self, stats: FetchStats) -> None:
        """Each fetch that received something measures this node's link (EWMA)."""
        if stats.chunks and stats.down_mbit > 0:
            old = self.down_mbit_measured
            self.down_mbit_measured = (
                stats.down_mbit if old <= 0 else 0.7 * old + 0.3 * stats.down_mbit
            )

    def hold_base(self, manifest: BaseManifest, payload: bytes | bytearray) -> None:
        """Serve the whole, verified base model to peers (chunk requests of form "base");
        a relay that serves nobody (behind NAT) keeps no copy."""
        if self.server is not None:
            self.bases.add(SnapshotBuffer(manifest, self._keep(payload)))

    def _keep(self, payload: Payload) -> Payload:
        """A whole version to keep: spilled to a file when the relay spills (echo_rl.core.spill), else
        its own copy when it is a receive buffer the snapshot store recycles."""
        if self.cfg.spill_dir:
            from echo_rl.core.spill import spill, spill_dir

            # a map (already spilled elsewhere) is copied through a view, like any buffer
            data = memoryview(payload) if isinstance(payload, mmap.mmap) else payload
            return spill(data, spill_dir(self.cfg.spill_dir))
        return bytearray(payload) if self.store.holds(payload) else payload

    @property
    def holds_base(self) -> bool:
        return self.bases.latest() is not None

    def base_for(self, manifest: Manifest) -> Payload | None:
        """The full payload of the base of a delta, if this node holds it."""
        held = self.results.get(manifest.base_version)
        return held.payload if held is not None and held.done else None

    def hold_result(self, manifest: Manifest, result: Payload) -> None:
        """Keep an installed version's full payload (``_keep``). When it is the receive buffer
        of a full version and the relay spills, the snapshot store serves the spilled copy from
        now on and the buffer is freed once its last send is done (docs/memory.md)."""
        kept = self._keep(result)
        self.results.add(SnapshotBuffer(manifest.result_layout, kept))
        if self.cfg.spill_dir:
            self.store.swap_payload(result, kept)

    def measured(self, version: int, stats: FetchStats) -> dict[str, float]:
        """The ``wire.Installed`` fields for ``version``: measured download and upload."""
        up = self.server.upload_mbit(version) if self.server is not None else 0.0
        return {"down_mbit": stats.down_mbit, "up_mbit": up}

    def reset(self) -> None:
        """Forget every snapshot held (the learner's run changed)."""
        self.store.clear()
        self.results.clear()
        self.bases.clear()  # another run's base manifest may differ (its chunks would not verify)
        self.dialer.close()  # the learner's connection (a new run may have a new key)

    def close(self) -> None:
        self.dialer.close()
        if self.server is not None:
            self.server.sock.close(linger=0)
        if self.zap is not None:
            self.zap.close()
