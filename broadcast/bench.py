"""``echo-rl bench broadcast``: real processes moving a real snapshot over loopback.

The root (this process) plays the learner's broadcast side with the same code the learner
uses (``Coordinator`` + ``ChunkServer``, uplink shaped at U); each of N relay processes
(``python -m broadcast.bench relay``) is what a worker runs (``Relay``: download and upload
shaped at b). Optionally a fraction of relays is SIGKILLed at random moments and K relays
corrupt every chunk they forward. Reports per-worker install times, ``T_bcast`` (q = 1), the
lower bound of docs/design.md §5, bytes the root sent, and corrupt installs (payload digests that differ
from the root's).

``--publications P`` publishes P versions in a row (the coordinator re-plans at each, on the
link rates the relays measured for the previous ones: ``broadcast.links``). ``--liar-up-mbit X``
shapes relay r00's uplink at X but has it declare 10x X; ``--trust-declared`` plans on the
declarations alone (the old behaviour). ``--liar-json FILE`` runs the honest fleet, the fleet
with the liar, and (as a baseline) the liar with declarations trusted, and writes T_bcast per
publication and whether the liar headed a chain.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import blake3
import numpy as np
import zmq
import zmq.asyncio

from broadcast import netns
from broadcast.coordinator import Coordinator
from broadcast.fetch import SOCKET_BUFFER
from broadcast import natlab
from broadcast.nat.links import Tunnels
from broadcast.nat.reflect import Reflector, pick_punch_port, probe_all
from broadcast.planner import lower_bound_s, star_limited_s, star_unlimited_s
from broadcast.relay import Relay, RelayConfig, bucket
from broadcast.snapshot import RunKey, SnapshotError, build_manifest
from broadcast.versions import VersionEncoder, rebuild
from broadcast.source import ChunkServer
from broadcast.store import SnapshotBuffer, SnapshotStore
from broadcast.tickets import Source, TicketCheck, mint
from broadcast.topology import TOPOLOGIES, make_topology
from echo import wire
from echo.client import Client
from echo.machine import machine_info
from echo.security import KeyPair, ZapHandler, curve_server, key_from_hex, key_hex, peer_key

MAX_BYTES = 64 * 2**20


# ----------------------------------------------------------------------------- relay process


async def relay_process(args: argparse.Namespace) -> int:
    ctx = zmq.asyncio.Context()
    # With --root-key: the relay a worker runs, CURVE and pull tickets (docs/security.md).
    server_key = key_from_hex(args.root_key) if args.root_key else None
    keys = KeyPair.generate() if server_key else None
    run_key = b""
    relay = Relay(ctx, RelayConfig(bind_host=args.bind_host, serve=not args.no_serve,
                                   window=args.window, timeout_s=args.timeout,
                                   down_mbit=args.down_mbit, up_mbit=args.real_up_mbit or args.up_mbit,
                                   shape=not args.kernel_shaped, chunk_bytes=args.chunk_kib * 1024,
                                   corrupt=args.corrupt), keys=keys, run_key=lambda: run_key)
    if args.reserve_mib:
        relay.store.reserve(int(args.reserve_mib * 2**20), args.reserve_count)
    tunnels = Tunnels(args.bind_host, pick_punch_port(args.bind_host), endpoint=relay.endpoint)
    relay.resolve = tunnels.resolve
    client = Client(ctx, args.root, MAX_BYTES, keys=keys, server_key=server_key)
    join = wire.Join(worker_id=args.id, relay_endpoint=relay.endpoint, down_mbit=args.down_mbit,
                     up_mbit=args.up_mbit, can_relay=not args.no_serve)
    async with asyncio.TaskGroup() as tg:
        inbox: asyncio.Queue[wire.Message] = asyncio.Queue()
        tasks = [tg.create_task(client.receive_forever()), tg.create_task(relay.serve_forever()),
                 tg.create_task(tunnels.serve_forever()),
                 tg.create_task(_punches_first(client, tunnels, inbox))]
        ack = await client.request(join, 60)
        assert isinstance(ack, wire.JoinAck)
        run_key = ack.public_key
        if ack.reflectors:  # the root classifies our NAT (docs/nat.md)
            port = int(relay.endpoint.rpartition(":")[2]) if relay.endpoint else 0
            nonces = await probe_all(ack.reflectors, tunnels.host, tunnels.port, port)
            status = await client.request(wire.NatReport(worker_id=args.id, nonces=nonces), 30)
            assert isinstance(status, wire.NatStatus), status
        held, base = None, None
        trace: dict[str, Any] = {"id": args.id, "endpoint": relay.endpoint, "joined": time.time(),
                                 "versions": []}
        while True:
            msg = await inbox.get()
            if isinstance(msg, wire.Shutdown) and msg.reason == "audit" and held is not None:
                base = await _audit(client, args.id, held, base)
                continue
            if isinstance(msg, wire.Shutdown):
                break
            assert isinstance(msg, wire.SnapshotNotice)
            entry: dict[str, Any] = {"version": msg.version, "noticed": time.time(),
                                     "source": msg.source, "reattaches": []}
            trace["versions"].append(entry)

            async def reattach(bad: Source, fail: Any, version: int = msg.version,
                               entry: dict[str, Any] = entry) -> Source:
                grant = await client.request(wire.SourceRequest(
                    worker_id=args.id, version=version, bad_source=bad.endpoint,
                    reason=fail.reason), 30)
                assert isinstance(grant, wire.SourceGrant)
                entry["reattaches"].append({"at": time.time(), "bad": bad.endpoint,
                                            "reason": fail.reason, "detail": fail.detail[:200],
                                            "granted": grant.source})
                return Source(grant.source, grant.source_key, grant.ticket)

            held, stats = await relay.receive(msg.manifest, ack.public_key,
                                          Source(msg.source, msg.source_key, msg.ticket), reattach)
            entry.update(installed=time.time(), attempts=stats.attempts)
            if args.trace:
                Path(args.trace).write_text(json.dumps(trace, indent=1))
            # Installed the moment the last chunk verified against the signed manifest: that is
            # what a worker relies on before it installs.
            await client.send(wire.Installed(worker_id=args.id, version=held.version,
                                             **relay.measured(held.version, stats)))
        for t in tasks:
            t.cancel()
    relay.close()
    client.close(linger_ms=5000)  # let the audit digest leave before the socket closes
    ctx.term()
    return 0


async def _punches_first(client: Client, tunnels: Tunnels, inbox: asyncio.Queue) -> None:
    """A punch is acted on the moment it arrives, even while this relay is fetching (its
    peer is punching now); everything else waits its turn in ``inbox``."""
    while True:
        msg = await client.notices.get()
        if isinstance(msg, wire.Punch):
            tunnels.open(msg)
        else:
            inbox.put_nowait(msg)


async def _audit(client: Client, wid: str, held: SnapshotBuffer, base: Any) -> Any:
    """The audit of one publication, when the root asks (after every relay installed it, so its
    CPU slows no hop still relaying): rebuild the version as a worker does (a delta applied to
    the previous version's full payload) and send the BLAKE3 of the whole result, which the
    root compares with the learner's full payload: every install checked bit for bit,
    independently of the per-chunk checks. Returns the result: the next delta's base."""
    try:
        result = await asyncio.to_thread(rebuild, held.manifest, held.payload, base)
        digest = await asyncio.to_thread(lambda: blake3.blake3(result, max_threads=blake3.blake3.AUTO).digest())
    except SnapshotError:
        result, digest = None, bytes(32)  # counted as a corrupt install
    await client.send(wire.Installed(worker_id=wid, version=held.version, digest=digest))
    return result


# ----------------------------------------------------------------------------- root


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
        uplink = (None if p.topology == "star-unlimited" or p.netns
                  else bucket(p.uplink_mbit, p.chunk_kib * 1024))
        self.key = RunKey.generate()
        tickets = (TicketCheck(lambda: self.key.public_bytes, snap.getsockopt_string(zmq.LAST_ENDPOINT)).check
                   if self.keys is not None else None)
        self.server = ChunkServer(snap, self.store, MAX_BYTES, upload=uplink, authorize=tickets)
        self.peer_keys: dict[str, str] = {}  # worker -> its CURVE key
        self.relay_keys: dict[str, str] = {}  # relay endpoint -> its CURVE key
        topo = make_topology(p.topology, uplink_mbit=p.uplink_mbit or None,
                             link_mbit=p.link_mbit or None, chunk_bytes=p.chunk_kib * 1024)
        if p.chains and hasattr(topo, "params"):
            from dataclasses import replace
            topo.params = replace(topo.params, chains=p.chains)  # type: ignore[attr-defined]
        self.coord = Coordinator(topo, snap.getsockopt_string(zmq.LAST_ENDPOINT),
                                 trust_declared=p.trust_declared)
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
        server = self.keys.text if endpoint == self.coord.source else self.relay_keys.get(endpoint, "")
        return Source(endpoint, server.encode(),
                      mint(self.key, self.peer_keys[wid], endpoint, "bench", 3600))

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
                self.coord.join(msg.worker_id, msg.relay_endpoint, msg.down_mbit, msg.up_mbit,
                                nat="unknown" if self.reflector else "reachable")
                reply = wire.JoinAck(run_id="bench", instance_id="bench", public_key=self.key.public_bytes,
                                     version=-1, config={}, snapshot_endpoint=self.coord.source,
                                     reflectors=self.reflector.endpoints if self.reflector else [])
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
                    msg.worker_id, self.coord.reattach(msg.worker_id, msg.bad_source, msg.reason))
                self.events.append({"at": time.time(), "event": "reattach", "worker": msg.worker_id,
                                    "bad": msg.bad_source, "reason": msg.reason,
                                    "granted": src.endpoint})
                reply = wire.SourceGrant(version=msg.version, source=src.endpoint,
                                         source_key=src.key, ticket=src.ticket)
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
                self.reflector is None or len(self.classified) == self.p.workers):
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

    def prepare(self, payload: bytes, version: int = 1) -> dict[str, Any]:
        manifest = build_manifest(run_id="bench", version=version, tensors=[], payload=payload,
                                  chunk_size=self.p.chunk_kib * 1024, dtype="uint8", key=self.key)
        self.store.add(SnapshotBuffer(manifest, payload))
        return manifest


    async def publish(self, manifest: dict[str, Any]) -> dict[str, str]:
        self.version = manifest["version"]
        self.all_installed.clear()
        sources = self.coord.publish(self.version)
        notices = {}  # minted before the first goes out: signing is not broadcast time
        for wid, endpoint in sources.items():
            src = await self.source_routed(wid, endpoint)
            notices[wid] = wire.encode(wire.SnapshotNotice(version=self.version, manifest=manifest,
                                                           source=src.endpoint, source_key=src.key,
                                                           ticket=src.ticket))
        self.events.append({"at": time.time(), "event": "publish", "version": self.version,
                            "sources": sources})
        for wid, frame in notices.items():
            await self.ctrl.send_multipart([self.idents[wid], frame])
        self.events.append({"at": time.time(), "event": "notices_sent", "version": self.version})
        return sources

    async def shutdown(self) -> None:
        for ident in self.idents.values():
            try:
                await self.ctrl.send_multipart([ident, wire.encode(wire.Shutdown(reason="bench over"))])
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
            raise SystemExit(f"--versions-dir {folder}: no v000.bin ... (record some with "
                             f"benchmarks/delta_real.py --record {folder})")
        self.encoder = VersionEncoder(run_id="bench", key=key, chunk_size=p.chunk_kib * 1024,
                                      dtype="bfloat16", delta=p.delta,
                                      keyframe_every=p.keyframe_every)
        self.full_bytes = self.files[0].stat().st_size

    def prepare(self, root: "Root", version: int) -> tuple[dict[str, Any], bytes]:
        """The publication of ``version`` (1-based) in the root's store; its full digest."""
        full = self.files[version - 1].read_bytes()
        pub = self.encoder.build(version, self.layout, full)
        root.store.add(SnapshotBuffer(pub.manifest, pub.payload))
        return pub.manifest, blake3.blake3(full).digest()


def _spawn_relays(root: Root, p: BenchParams) -> dict[str, Any]:
    from echo.procs import terminate_with_parent

    rng = random.Random(p.seed)
    corrupt = set(rng.sample(range(p.workers), p.corrupt_relays)) if p.corrupt_relays else set()
    procs = {}
    for i in range(p.workers):
        argv = [sys.executable, "-m", "broadcast.bench", "relay", "--root", root.endpoint,
                "--id", f"r{i:02d}", "--down-mbit", str(p.link_mbit), "--up-mbit", str(p.link_mbit),
                "--chunk-kib", str(p.chunk_kib), "--window", str(p.window), "--timeout", str(p.timeout_s),
                "--reserve-mib", str(p.snapshot_mib), "--reserve-count", str(min(2, p.publications))]
        if root.keys is not None:
            argv += ["--root-key", key_hex(root.keys.public)]
        if p.trace:
            argv += ["--trace", str(Path(p.trace) / f"r{i:02d}.json")]
        if i in corrupt:
            argv.append("--corrupt")
        if i == 0 and p.liar_up_mbit:  # declares 10x the uplink it is shaped at
            argv += ["--up-mbit", str(10 * p.liar_up_mbit), "--real-up-mbit", str(p.liar_up_mbit)]
        if p.netns and p.nat:
            node = natlab.fleet(p.workers, p.nat, p.symmetric)[i]
            argv = ["ip", "netns", "exec", node.ns, *argv, "--kernel-shaped",
                    "--bind-host", node.address]
            if node.nat != "public" and not p.punch:
                argv.append("--no-serve")  # today's way in: behind NAT, a tail
        elif p.netns:
            argv = ["ip", "netns", "exec", netns.node_name(i), *argv, "--kernel-shaped",
                    "--bind-host", netns.address(i)]
        procs[f"r{i:02d}"] = subprocess.Popen(argv, preexec_fn=terminate_with_parent,
                                              stdin=subprocess.DEVNULL)
    return procs


async def _killer(root: Root, procs: dict[str, Any], p: BenchParams, horizon_s: float) -> None:
    rng = random.Random(p.seed + 1)
    victims = rng.sample(sorted(procs), round(p.kill_fraction * p.workers))
    moments = sorted(rng.uniform(0.05, 0.8) * horizon_s for _ in victims)
    t0 = time.monotonic()
    for wid, at in zip(victims, moments):
        await asyncio.sleep(max(0.0, at - (time.monotonic() - t0)))
        procs[wid].send_signal(signal.SIGKILL)
        root.events.append({"at": time.time(), "event": "killed", "worker": wid})
        root.dead.add(wid)
        root._check_done()


async def run_one(p: BenchParams, progress: Any = None) -> dict[str, Any]:
    root = Root(p)
    recorded = RecordedVersions(p, root.key) if p.versions_dir else None
    if recorded is not None:
        p.snapshot_mib = recorded.full_bytes / 2**20  # relays reserve a keyframe's buffer
        p.publications = min(p.publications, len(recorded.files)) if p.publications > 1 \
            else len(recorded.files)
    procs = _spawn_relays(root, p)
    payload = b"" if recorded else np.random.default_rng(p.seed).bytes(int(p.snapshot_mib * 2**20))
    expected: dict[int, bytes] = {}  # version -> digest of its full payload
    try:
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(root.serve()), tg.create_task(root.server.serve_forever())]
            await asyncio.wait_for(root.joined.wait(), 120)
            m = recorded.full_bytes if recorded else len(payload)
            lb = _lower_bound(p, m)
            horizon = star_limited_s(m, p.link_mbit, p.uplink_mbit, p.workers) if p.topology == "star" and p.link_mbit else max(lb, 0.5)
            pubs = []
            for version in range(1, p.publications + 1):
                # encoding, hashing, signing: before the clock
                if recorded is not None:
                    manifest, expected[version] = recorded.prepare(root, version)
                else:
                    manifest, expected[version] = root.prepare(payload, version), blake3.blake3(payload).digest()
                t0 = time.monotonic()
                sources = await root.publish(manifest)
                if p.kill_fraction and version == 1:
                    tasks.append(tg.create_task(_killer(root, procs, p, horizon)))
                await asyncio.wait_for(root.all_installed.wait(), max(120.0, 10 * horizon))
                elapsed = time.monotonic() - t0
                await root.audit()  # each survivor rebuilds it and answers with its digest
                pubs.append(_publication(root, version, sources, manifest, expected[version]))
            await root.shutdown()
            for t in tasks:
                t.cancel()
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs.values():
            try:
                proc.wait(10)
            except Exception:
                proc.kill()
        root.ctx.destroy(linger=0)
        if p.trace:
            Path(p.trace, "root.json").write_text(json.dumps(
                {"endpoint": root.coord.source, "events": root.events,
                 "relays": {w: x.endpoint for w, x in root.coord.peers.items()},
                 "load": os.getloadavg()}, indent=1))
    survivors = sorted(set(procs) - root.dead)
    times = root.coord.install_times(p.publications)
    last = root.digests.get(p.publications, {})
    return {
        "params": p.__dict__, "t_bcast_s": max(times[w] for w in survivors), "elapsed_s": elapsed,
        "lower_bound_s": lb,
        "star_limited_s": star_limited_s(m, p.link_mbit, p.uplink_mbit, p.workers) if p.link_mbit and p.uplink_mbit else None,
        "star_unlimited_s": star_unlimited_s(m, p.link_mbit) if p.link_mbit else None,
        "learner_bytes_sent": root.store.bytes_sent, "snapshot_bytes": m,
        "installed": sum(1 for w in survivors if w in last), "survivors": len(survivors),
        "killed": sorted(root.dead),
        "corrupt_installs": sum(x["corrupt_installs"] for x in pubs),
        "reattaches": root.reattaches,
        "parents": _parents(sources, root.coord),
        "install_times_s": times,
        "publications": pubs,
    }


def _lower_bound(p: BenchParams, m: int) -> float:
    return lower_bound_s(m, p.uplink_mbit or 1e9, [p.link_mbit or 1e9] * p.workers,
                         [p.link_mbit or 1e9] * p.workers)


def _publication(root: Root, version: int, sources: dict[str, str], manifest: dict[str, Any],
                 expected: bytes) -> dict[str, Any]:
    """One publication: T_bcast, what it sent, its audit, the plan and its rates."""
    parents = _parents(sources, root.coord)
    times = root.coord.install_times(version)
    alive = set(root.idents) - root.dead
    digests = root.digests.get(version, {})
    return {"version": version, "t_bcast_s": max(times[w] for w in alive if w in times),
            "encoding": manifest["encoding"], "payload_bytes": manifest["payload_size"],
            "full_bytes": manifest["result_size"],
            "lower_bound_s": _lower_bound(root.p, manifest["payload_size"]),
            "corrupt_installs": sum(1 for w in alive if digests.get(w) != expected),
            # the liar (r00) heads a chain that it feeds: it pulls from the root and uploads
            "install_times_s": {w: round(t, 3) for w, t in sorted(times.items())},
            "parents": parents, "liar_head": (parents.get("r00") == "root"
                                              and any(p == "r00" for p in parents.values()))
            if root.p.liar_up_mbit else None,
            # (down, up) the *next* plan gets, after this publication's measurements
            "next_plan_mbit": {w: [round(d, 1), round(u, 1)] for w, (d, u)
                             in sorted(root.coord.rates().items())}}


def _parents(sources: dict[str, str], coord: Coordinator) -> dict[str, str]:
    """worker -> the worker it pulled from ("root" for the learner side)."""
    by_ep = {p.endpoint: p.worker_id for p in coord.peers.values() if p.endpoint}
    return {w: by_ep.get(s, "root") for w, s in sorted(sources.items())}


# ----------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="echo-rl bench broadcast")
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--snapshot-mib", type=float, default=64)
    ap.add_argument("--uplink-mbit", type=float, default=400, help="learner uplink U (0 = unshaped)")
    ap.add_argument("--link-mbit", type=float, default=100, help="worker link b, both ways (0 = unshaped)")
    ap.add_argument("--topology", default="chains",
                    help=f"one or several of {sorted(TOPOLOGIES)}, comma-separated")
    ap.add_argument("--kill-fraction", type=float, default=0.0)
    ap.add_argument("--corrupt-relays", type=int, default=0)
    ap.add_argument("--chunk-kib", type=int, default=1024)
    ap.add_argument("--window", type=int, default=4)
    ap.add_argument("--chains", type=int, default=0, help="force the number of chains (0 = planner)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=1,
                    help="run each topology this many times (seeds seed, seed+1, ...): the spread")
    ap.add_argument("--json", default=None, help="write results here (e.g. benchmarks/results/broadcast.json)")
    ap.add_argument("--netns", action="store_true",
                    help="shape with the kernel: namespaces, veth, tc tbf (needs root)")
    ap.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--nat", type=int, default=0,
                    help="with --netns: this many workers behind home NAT routers (docs/nat.md)")
    ap.add_argument("--symmetric", type=int, default=0,
                    help="of the --nat workers, this many behind symmetric NATs (cannot punch)")
    ap.add_argument("--no-punch", action="store_true",
                    help="NAT'd workers join without a relay (tails), as before hole punching")
    ap.add_argument("--curve", action="store_true",
                    help="CurveZMQ on every socket with pull tickets, as a real run (docs/security.md)")
    ap.add_argument("--publications", type=int, default=1,
                    help="publish this many versions in a row, re-planned on measured rates")
    ap.add_argument("--liar-up-mbit", type=float, default=0.0,
                    help="relay r00's real uplink; it declares 10x this (0 = no liar)")
    ap.add_argument("--trust-declared", action="store_true",
                    help="plan on declared link rates only (the behaviour before measurement)")
    ap.add_argument("--versions-dir", default="",
                    help="replay recorded real versions (benchmarks/delta_real.py --record DIR) "
                         "instead of a random payload, one publication per file")
    ap.add_argument("--delta", choices=("on", "off", "both"), default="both",
                    help="with --versions-dir: deltas between keyframes, full snapshots, or both "
                         "runs and their T_bcast ratio")
    ap.add_argument("--keyframe-every", type=int, default=10)
    ap.add_argument("--trace", default="",
                    help="write per-node traces into this folder: root.json (publications, "
                         "re-attaches granted, kills) and rNN.json (each relay's sources per "
                         "version: chunks, first/last chunk time, why it left one)")
    ap.add_argument("--liar-json", default=None,
                    help="run honest / liar / liar-with-declarations-trusted (needs --liar-up-mbit) "
                         "and write T_bcast per publication here")
    return ap


def relay_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m broadcast.bench relay")
    ap.add_argument("--root", required=True)
    ap.add_argument("--id", required=True)
    ap.add_argument("--down-mbit", type=float, default=0.0)
    ap.add_argument("--up-mbit", type=float, default=0.0)
    ap.add_argument("--chunk-kib", type=int, default=1024)
    ap.add_argument("--window", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=10.0)
    ap.add_argument("--corrupt", action="store_true")
    ap.add_argument("--no-serve", action="store_true")
    ap.add_argument("--bind-host", default="127.0.0.1")
    ap.add_argument("--kernel-shaped", action="store_true", help="links are shaped by tc: no app shaping")
    ap.add_argument("--reserve-mib", type=float, default=0.0, help="pre-allocate a receive buffer")
    ap.add_argument("--reserve-count", type=int, default=1,
                    help="that many (2 = the steady state of a relay keeping two versions)")
    ap.add_argument("--root-key", default="", help="root's CURVE key (hex): encrypt, with tickets")
    ap.add_argument("--trace", default="", help="write this relay's per-version trace here (JSON)")
    ap.add_argument("--real-up-mbit", type=float, default=0.0,
                    help="shape the uplink at this rate, whatever --up-mbit declares (a liar)")
    return ap


def print_table(results: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="Snapshot broadcast (real processes, loopback)")
    for col in ("topology", "N", "M MiB", "U / b Mbit/s", "killed", "corrupt relays",
                "T_bcast s", "lower bound s", "ratio", "MB/s", "installed", "corrupt installs",
                "learner sent MiB"):
        t.add_column(col, justify="right")
    for r in results:
        p = r["params"]
        t.add_row(p["topology"], str(p["workers"]), f"{p['snapshot_mib']:g}",
                  f"{p['uplink_mbit']:g} / {p['link_mbit']:g}", str(len(r["killed"])),
                  str(p["corrupt_relays"]), f"{r['t_bcast_s']:.2f}", f"{r['lower_bound_s']:.2f}",
                  f"{r['t_bcast_s'] / r['lower_bound_s']:.3f}" if p["link_mbit"] else "unshaped",
                  f"{r['snapshot_bytes'] / r['t_bcast_s'] / 1e6:.0f}",
                  f"{r['installed']}/{r['survivors']}", str(r["corrupt_installs"]),
                  f"{r['learner_bytes_sent'] / 2**20:.0f}")
    Console(width=200).print(t)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    if args.netns and not args.inside:
        if os.geteuid() != 0:
            print("--netns needs root (it creates namespaces, veth and tc qdiscs)", file=sys.stderr)
            return 2
        if args.nat:
            if natlab.missing_tools():
                print(f"--nat: {natlab.missing_tools()}", file=sys.stderr)
                return 2
            with natlab.lab(natlab.fleet(args.workers, args.nat, args.symmetric),
                            args.uplink_mbit, args.link_mbit):
                return subprocess.run(["ip", "netns", "exec", natlab.ROOT_NS, sys.executable,
                                       "-m", "broadcast.bench", *argv, "--inside"]).returncode
        with netns.lab(args.workers, args.uplink_mbit, args.link_mbit):
            # The root runs inside its own namespace, behind its own shaped veth.
            return subprocess.run(["ip", "netns", "exec", netns.node_name(None), sys.executable,
                                   "-m", "broadcast.bench", *argv, "--inside"]).returncode
    if args.liar_json:
        return liar_main(args)
    if args.versions_dir:
        return versions_main(args)
    results = []
    for topo in args.topology.split(","):
        if topo not in TOPOLOGIES:
            print(f"unknown topology {topo!r}: choose from {sorted(TOPOLOGIES)}", file=sys.stderr)
            return 2
        for rep in range(args.repeat):
            p = BenchParams(args.workers, args.snapshot_mib, args.uplink_mbit, args.link_mbit, topo,
                            args.kill_fraction, args.corrupt_relays, args.chunk_kib, args.window,
                            args.chains, seed=args.seed + rep, netns=args.netns, curve=args.curve,
                            publications=args.publications, liar_up_mbit=args.liar_up_mbit,
                            trust_declared=args.trust_declared, nat=args.nat,
                            symmetric=args.symmetric, punch=not args.no_punch,
                            trace=str(Path(args.trace) / f"{topo}-{rep}") if args.trace else "")
            if p.trace:
                Path(p.trace).mkdir(parents=True, exist_ok=True)
            results.append(asyncio.run(run_one(p)))
    print_table(results)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"machine": machine_info(), "results": results}, indent=2))
    return 0


def versions_main(args: argparse.Namespace) -> int:
    """Recorded real versions broadcast as deltas and as full snapshots: T_bcast per version."""
    arms = {"on": [True], "off": [False], "both": [True, False]}[args.delta]
    out: dict[str, Any] = {}
    for delta in arms:
        p = BenchParams(args.workers, 0.0, args.uplink_mbit, args.link_mbit, args.topology,
                        corrupt_relays=args.corrupt_relays, chunk_kib=args.chunk_kib, window=args.window, chains=args.chains,
                        seed=args.seed, curve=args.curve, publications=args.publications,
                        versions_dir=args.versions_dir, delta=delta,
                        keyframe_every=args.keyframe_every)
        out["delta" if delta else "full"] = asyncio.run(run_one(p))
    if len(out) == 2:
        out["t_bcast_ratio_delta_full"] = [
            d["t_bcast_s"] / f["t_bcast_s"] for d, f in
            zip(out["delta"]["publications"], out["full"]["publications"])]
    print_versions(out)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"machine": machine_info(), "load": os.getloadavg(),
                                               "argv": sys.argv[1:], **out}, indent=2))
    return 0


def print_versions(out: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="Recorded real versions: T_bcast per publication (real processes, loopback)")
    for col in ("arm", "version", "encoding", "MiB sent", "T_bcast s", "lower bound s",
                "corrupt installs", "learner sent MiB"):
        t.add_column(col, justify="right")
    for arm in ("delta", "full"):
        if arm not in out:
            continue
        for x in out[arm]["publications"]:
            t.add_row(arm, str(x["version"]), x["encoding"], f"{x['payload_bytes'] / 2**20:.2f}",
                      f"{x['t_bcast_s']:.2f}", f"{x['lower_bound_s']:.2f}",
                      str(x["corrupt_installs"]), "")
        t.add_row(arm, "all", "", "", f"{sum(x['t_bcast_s'] for x in out[arm]['publications']):.2f}",
                  "", str(out[arm]["corrupt_installs"]),
                  f"{out[arm]['learner_bytes_sent'] / 2**20:.0f}")
    Console(width=200).print(t)
    if "t_bcast_ratio_delta_full" in out:
        print("T_bcast delta / full per version:",
              " ".join(f"{r:.3f}" for r in out["t_bcast_ratio_delta_full"]))


def liar_main(args: argparse.Namespace) -> int:
    """Honest fleet vs the same fleet with one liar (measured rates, then declared ones)."""
    if not args.liar_up_mbit or args.publications < 2:
        print("--liar-json needs --liar-up-mbit X and --publications >= 2", file=sys.stderr)
        return 2
    arms = {"honest": {}, "liar_measured": {"liar_up_mbit": args.liar_up_mbit},
            "liar_declared_trusted": {"liar_up_mbit": args.liar_up_mbit, "trust_declared": True}}
    out: dict[str, Any] = {}
    for name, extra in arms.items():
        p = BenchParams(args.workers, args.snapshot_mib, args.uplink_mbit, args.link_mbit,
                        args.topology, chunk_kib=args.chunk_kib, window=args.window,
                        seed=args.seed, curve=args.curve, publications=args.publications, **extra)
        r = asyncio.run(run_one(p))
        out[name] = {"params": r["params"], "publications": r["publications"],
                     "corrupt_installs": r["corrupt_installs"], "lower_bound_s": r["lower_bound_s"]}
        print(name, [(x["version"], round(x["t_bcast_s"], 3), x["liar_head"])
                     for x in r["publications"]], flush=True)
    honest = [x["t_bcast_s"] for x in out["honest"]["publications"]]
    ratios = {arm: [round(x["t_bcast_s"] / h, 3) for x, h in zip(out[arm]["publications"], honest)]
              for arm in ("liar_measured", "liar_declared_trusted")}
    summary = {"t_bcast_ratio_vs_honest": ratios,
               "liar_head": {arm: [x["liar_head"] for x in out[arm]["publications"]]
                             for arm in ("liar_measured", "liar_declared_trusted")}}
    print(json.dumps(summary))
    Path(args.liar_json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.liar_json).write_text(json.dumps({"machine": machine_info(), "load": os.getloadavg(),
                                                "argv": sys.argv[1:], "summary": summary,
                                                "arms": out}, indent=2))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "relay":
        import logging  # relays log warnings (a failed punch, a lost link) to stderr
        logging.basicConfig(level=os.environ.get("ECHO_BENCH_LOG", "WARNING"),
                            format=f"%(asctime)s {sys.argv[sys.argv.index('--id') + 1]} %(name)s: %(message)s")
        sys.exit(asyncio.run(relay_process(relay_parser().parse_args(sys.argv[2:]))))
    sys.exit(main())
