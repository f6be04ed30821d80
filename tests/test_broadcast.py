"""Relays on real loopback sockets inside one event loop: chains, resume, churn, integrity."""

import asyncio

import numpy as np
import pytest
import zmq
import zmq.asyncio

from echo_rl.broadcast.coordinator import Coordinator
from echo_rl.broadcast.relay import Relay, RelayConfig
from echo_rl.broadcast.snapshot import (
    RunKey,
    SnapshotError,
    build_manifest,
    chunk_hash,
    verify_manifest,
)
from echo_rl.broadcast.source import ChunkServer
from echo_rl.broadcast.store import SnapshotBuffer, SnapshotStore
from echo_rl.broadcast.topology import Peer, make_topology
from echo_rl.core import wire
from labs import child_env
from labs.doubles import CorruptingChunkServer, CorruptingRelay

CHUNK = 64 * 1024


def snapshot(key, version=1, size=40 * CHUNK + 123):
    payload = np.random.default_rng(version).bytes(size)
    return build_manifest(
        run_id="t",
        version=version,
        tensors=[],
        payload=payload,
        chunk_size=CHUNK,
        dtype="uint8",
        key=key,
    ), payload


class Root:
    def __init__(self, ctx, key, corrupt=False):
        self.store = SnapshotStore()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.bind("tcp://127.0.0.1:*")
        self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        server = CorruptingChunkServer if corrupt else ChunkServer
        self.server = server(sock, self.store, 1 << 24)
        self.key = key


def relay(ctx, corrupt=False, **kw):
    kind = CorruptingRelay if corrupt else Relay
    return kind(
        ctx, RelayConfig(window=3, timeout_s=kw.pop("timeout_s", 5.0), chunk_bytes=CHUNK, **kw)
    )


async def run(coro_fn, timeout=30):
    ctx = zmq.asyncio.Context()
    try:
        return await asyncio.wait_for(coro_fn(ctx), timeout)
    finally:
        ctx.destroy(linger=0)


def test_chain_forwards_chunks_as_they_arrive_and_installs_exact_bytes():
    key = RunKey.generate()
    manifest, payload = snapshot(key)

    async def body(ctx):
        root = Root(ctx, key)
        root.store.add(SnapshotBuffer(manifest, payload))
        chain = [relay(ctx) for _ in range(3)]
        async with asyncio.TaskGroup() as tg:
            servers = [tg.create_task(root.server.serve_forever())]
            servers += [tg.create_task(r.serve_forever()) for r in chain]
            # every relay starts at once; each parent's requests park until chunks arrive
            sources = [root.endpoint] + [r.endpoint for r in chain[:-1]]
            results = await asyncio.gather(
                *(r.receive(manifest, s, None) for r, s in zip(chain, sources))
            )
            for t in servers:
                t.cancel()
        return root, results

    root, results = asyncio.run(run(body))
    for buf, stats in results:
        assert bytes(buf.payload) == payload and stats.failures == []
    assert root.store.bytes_sent == len(payload)  # the root fed only the chain head


def test_resume_fetches_only_missing_chunks():
    key = RunKey.generate()
    manifest, payload = snapshot(key)

    async def body(ctx):
        root = Root(ctx, key)
        root.store.add(SnapshotBuffer(manifest, payload))
        r = relay(ctx)
        buf = r.store.add(SnapshotBuffer(manifest))
        for i in range(0, buf.total, 2):  # half the chunks arrived before an interruption
            buf.put(i, bytes(SnapshotBuffer(manifest, payload).chunk(i)))
        held = buf.count
        async with asyncio.TaskGroup() as tg:
            t = tg.create_task(root.server.serve_forever())
            got, stats = await r.receive(manifest, root.endpoint, None)
            t.cancel()
        return held, got, stats, root

    held, got, stats, root = asyncio.run(run(body))
    assert stats.chunks == got.total - held
    assert bytes(got.payload) == payload
    assert root.store.bytes_sent < len(payload) * 0.6


def test_a_held_version_with_other_chunks_is_fetched_again_not_resumed():
    """A learner resumed after a crash publishes a version number again with other bytes:
    the chunks a relay held of the crashed instance's version are dropped, not resumed from
    (they would fail every hash: 'corrupt' from every source, found by tests/test_readme_real.py)."""
    key = RunKey.generate()
    old, old_payload = snapshot(key, version=7)
    new = build_manifest(
        run_id="t",
        version=7,
        tensors=[],
        payload=bytes(len(old_payload)),
        chunk_size=CHUNK,
        dtype="uint8",
        key=key,
    )

    async def body(ctx):
        root = Root(ctx, key)
        root.store.add(SnapshotBuffer(new, bytes(len(old_payload))))
        r = relay(ctx)
        buf = r.store.add(SnapshotBuffer(old))
        for i in range(0, buf.total, 2):  # half of the crashed instance's v7 arrived
            buf.put(i, bytes(SnapshotBuffer(old, old_payload).chunk(i)))
        async with asyncio.TaskGroup() as tg:
            t = tg.create_task(root.server.serve_forever())
            got, stats = await r.receive(new, root.endpoint, None)
            t.cancel()
        return got, stats

    got, stats = asyncio.run(run(body))
    assert bytes(got.payload) == bytes(len(old_payload)) and stats.failures == []
    assert stats.chunks == got.total


def test_dead_relay_child_reattaches_and_resumes():
    key = RunKey.generate()
    manifest, payload = snapshot(key, size=200 * CHUNK)

    async def body(ctx):
        root = Root(ctx, key)
        root.store.add(SnapshotBuffer(manifest, payload))
        parent = relay(ctx, down_mbit=40, shape=True)  # slow, so it dies mid-way
        child = relay(ctx)
        reasons = []

        async def reattach(bad, fail):
            reasons.append((bad, fail.reason))
            return root.endpoint

        async with asyncio.TaskGroup() as tg:
            servers = [
                tg.create_task(root.server.serve_forever()),
                tg.create_task(parent.serve_forever()),
            ]
            ptask = tg.create_task(parent.receive(manifest, root.endpoint, None))
            ctask = tg.create_task(child.receive(manifest, parent.endpoint, reattach))
            while child.store.get(1) is None or child.store.get(1).count < 20:
                await asyncio.sleep(0.01)
            ptask.cancel()
            servers[1].cancel()
            parent.close()  # the relay's process is gone: its socket closes
            buf, stats = await ctask
            servers[0].cancel()
        return buf, stats, reasons

    buf, stats, reasons = asyncio.run(run(body))
    assert bytes(buf.payload) == payload
    assert reasons and reasons[0][1] in ("disconnected", "timeout")
    assert stats.chunks == buf.total  # nothing fetched twice: it resumed where it stopped


def test_corrupting_relay_is_detected_and_routed_around():
    key = RunKey.generate()
    manifest, payload = snapshot(key)

    async def body(ctx):
        root = Root(ctx, key)
        root.store.add(SnapshotBuffer(manifest, payload))
        evil = relay(ctx, corrupt=True)
        child = relay(ctx)
        reasons = []

        async def reattach(bad, fail):
            reasons.append(fail.reason)
            return root.endpoint

        async with asyncio.TaskGroup() as tg:
            servers = [
                tg.create_task(root.server.serve_forever()),
                tg.create_task(evil.serve_forever()),
            ]
            await evil.receive(manifest, root.endpoint, None)
            buf, _ = await child.receive(manifest, evil.endpoint, reattach)
            for t in servers:
                t.cancel()
        return buf, reasons

    buf, reasons = asyncio.run(run(body))
    assert reasons == ["corrupt"]
    assert buf.digest() == chunk_hash(payload)


def test_manifest_from_another_key_is_refused():
    key = RunKey.generate()
    manifest, _ = snapshot(key)

    async def body(ctx):
        with pytest.raises(SnapshotError, match="signature"):  # where it arrives, before a fetch
            verify_manifest(manifest.to_wire(), RunKey.generate().public_bytes)

    asyncio.run(run(body))


def test_coordinator_routes_around_failures_and_measures():
    coord = Coordinator(make_topology("chains", uplink_mbit=100, link_mbit=100), "tcp://root")
    for i in range(4):
        coord.join(f"w{i}", f"tcp://w{i}", 100, 100, now=-1.0)
    plan = coord.publish(1, now=0.0)
    heads = [w for w, s in plan.items() if s == "tcp://root"]
    assert len(heads) == 1  # k = floor(U/b) = 1 chain
    parent_of_w = {w: s for w, s in plan.items()}
    child = next(w for w, s in parent_of_w.items() if s != "tcp://root")
    bad = parent_of_w[child]
    new = coord.reattach(child, bad, "disconnected")
    assert new != bad  # the reporter re-attaches upstream at once
    relay = next(p for p in coord.peers.values() if p.endpoint == bad)
    assert relay.alive  # one child's word is not a verdict (echo_rl/broadcast/reports.py) ...
    coord.confirm(bad, "unreachable")  # ... the learner's own probe is
    assert not relay.alive
    times = {w: 1.0 + i for i, w in enumerate(sorted(coord.peers))}
    for w, t in times.items():
        coord.installed(w, 1, now=t)
    live = sorted(t for w, t in times.items() if coord.peers[w].alive)
    assert len(live) == 3  # the dead relay no longer counts
    assert coord.t_bcast(1, q=1.0) == live[-1]
    assert coord.t_bcast(1, q=0.5) == live[1]
    # a late joiner pulls from a peer, not from the learner
    coord.join("late", "tcp://late", now=0.5)
    assert coord.source_for("late") != "tcp://root"
    # ... and its install (after loading its model, say) is its start-up, not the broadcast
    coord.installed("late", 1, now=29.0)
    assert coord.t_bcast(1, q=1.0) == live[-1]
    coord.publish(2, now=40.0)
    assert coord.t_bcast(2) is None  # nobody installed it yet


def test_corrupt_reports_keep_a_relay_out_of_parent_positions():
    coord = Coordinator(make_topology("chains", uplink_mbit=100, link_mbit=100), "tcp://root")
    for i in range(3):
        coord.join(f"w{i}", f"tcp://w{i}", 100, 100)
    plan = coord.publish(1)
    victim = next(w for w, s in plan.items() if s != "tcp://root")
    coord.reattach(victim, plan[victim], "corrupt")
    bad = plan[victim]
    assert coord.publish(2)[victim] != bad  # the reporter is kept off it
    coord.confirm(bad, "corrupt")  # the learner's probe got a corrupt chunk: no parent at all
    assert bad not in coord.publish(3).values()
    assert isinstance(Peer("x"), Peer)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_bench_broadcast_with_processes_kill_and_corruption(tmp_path):
    """The benchmark's machinery end to end: kills land mid-broadcast (links shaped so it lasts
    about a second), a corrupting relay is routed around. No timing is asserted here."""
    import json
    import subprocess
    import sys

    out = tmp_path / "b.json"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "labs.broadcast_bench",
            "--workers",
            "6",
            "--snapshot-mib",
            "4",
            "--chunk-kib",
            "256",
            "--uplink-mbit",
            "80",
            "--link-mbit",
            "40",
            "--topology",
            "chains,star",
            "--kill-fraction",
            "0.34",
            "--corrupt-relays",
            "1",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=170,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    assert [x["params"]["topology"] for x in results] == ["chains", "star"]
    for x in results:
        assert len(x["killed"]) == 2 and x["installed"] == x["survivors"] == 4
        assert x["corrupt_installs"] == 0
        for key in ("t_bcast_s", "lower_bound_s", "learner_bytes_sent"):
            assert key in x


@pytest.mark.slow
@pytest.mark.timeout(170)
def test_bench_replays_recorded_versions_as_deltas_and_audits_every_install(tmp_path):
    """Recorded versions (a keyframe, then 1% of elements changed per version) go out as deltas
    and as full snapshots; every relay rebuilds every version and its digest matches the full
    payload's, and one relay that corrupts what it forwards changes nothing installed."""
    import json
    import subprocess
    import sys

    folder = tmp_path / "versions"
    folder.mkdir()
    rng = np.random.default_rng(0)
    n = 300_000
    (folder / "layout.json").write_text(
        json.dumps([{"name": "w", "dtype": "bfloat16", "shape": [n], "offset": 0, "nbytes": 2 * n}])
    )
    a = rng.integers(0, 2**16, n, dtype=np.uint16)
    for v in range(4):
        (folder / f"v{v:03d}.bin").write_bytes(a.tobytes())
        a = a.copy()
        a[rng.choice(n, n // 100, replace=False)] ^= 1
    out = tmp_path / "v.json"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "labs.broadcast_bench",
            "--workers",
            "4",
            "--chunk-kib",
            "64",
            "--uplink-mbit",
            "0",
            "--link-mbit",
            "0",
            "--versions-dir",
            str(folder),
            "--corrupt-relays",
            "1",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=150,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(out.read_text())
    for arm, kinds in (("delta", ["full", "delta", "delta", "delta"]), ("full", ["full"] * 4)):
        pubs = got[arm]["publications"]
        assert [x["encoding"] for x in pubs] == kinds
        assert all(x["corrupt_installs"] == 0 for x in pubs) and got[arm]["installed"] == 4
    sizes = [x["payload_bytes"] for x in got["delta"]["publications"]]
    assert all(s < 0.1 * sizes[0] for s in sizes[1:])  # 1% of elements: a few % of the bytes
    assert len(got["t_bcast_ratio_delta_full"]) == 4


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_bare_chain_yardstick_delivers_every_byte_to_every_hop():
    from labs import bare_chain

    assert bare_chain.run(3, 4 * 2**20 + 5, 256 * 1024) > 0  # it raises if a hop got less


@pytest.mark.netns
@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.skipif(
    __import__("os").geteuid() != 0, reason="needs root to create namespaces and qdiscs"
)
def test_bench_broadcast_in_network_namespaces(tmp_path):
    import json
    import subprocess
    import sys

    out = tmp_path / "n.json"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "labs.broadcast_bench",
            "--workers",
            "4",
            "--snapshot-mib",
            "2",
            "--chunk-kib",
            "256",
            "--uplink-mbit",
            "100",
            "--link-mbit",
            "50",
            "--netns",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=170,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    [x] = json.loads(out.read_text())["results"]
    assert x["params"]["netns"] is True
    assert x["installed"] == 4 and x["corrupt_installs"] == 0
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "echo-" not in listed  # the lab is torn down


@pytest.mark.skipif(not __import__("platform").libc_ver()[0] == "glibc", reason="glibc's mallopt")
def test_relay_malloc_tuning_is_accepted_by_glibc():
    """glibc silently keeps its defaults when a threshold is out of range (mallopt returns 0):
    an mmap threshold above 32 MiB would undo the tuning the loopback figure relies on."""
    from echo_rl.broadcast import memory

    memory._done = False
    assert memory.keep_chunk_buffers()


@pytest.mark.netns
@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.skipif(
    __import__("os").geteuid() != 0, reason="needs root to create namespaces and qdiscs"
)
def test_bench_broadcast_through_real_nat_routers(tmp_path):
    """One chain of 4 in network namespaces: r00 public, r01 and r02 behind endpoint-independent
    MASQUERADE routers, r03 behind a symmetric one (--random-fully). The learner sends each
    version once: the NAT'd workers relay to each other through punched links, and the
    symmetric one is a tail fed by the public worker (docs/nat.md)."""
    import json
    import subprocess
    import sys

    from labs import natlab

    if natlab.missing_tools():
        pytest.skip(f"NAT lab: {natlab.missing_tools()}")
    out = tmp_path / "nat.json"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "labs.broadcast_bench",
            "--workers",
            "4",
            "--snapshot-mib",
            "4",
            "--chunk-kib",
            "256",
            "--uplink-mbit",
            "200",
            "--link-mbit",
            "100",
            "--netns",
            "--nat",
            "3",
            "--symmetric",
            "1",
            "--chains",
            "1",
            "--curve",
            "--publications",
            "2",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=230,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    [x] = json.loads(out.read_text())["results"]
    assert x["params"]["nat"] == 3 and x["params"]["punch"] is True
    assert x["installed"] == 4 and x["corrupt_installs"] == 0
    for pub in x["publications"]:
        parents = pub["parents"]
        assert parents["r03"] == "r00"  # the symmetric NAT hangs from the reachable worker
        assert sorted(parents.values()).count("root") == 1  # one chain: punched hops relayed
    assert x["learner_bytes_sent"] == 2 * x["snapshot_bytes"]  # once per version
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "echo-" not in listed  # the lab is torn down


def _refusing_first(relay_, reason="future_version"):
    """An event set when ``relay_``'s chunk server first refuses a request with ``reason``."""
    refused = asyncio.Event()
    server = relay_.server
    original = server._refuse

    async def spy(ident, rid, why, detail):
        await original(ident, rid, why, detail)
        if why == reason:
            refused.set()

    server._refuse = spy
    return refused


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "parent_holds", [None, 1], ids=["fresh_parent", "parent_skipped_a_version"]
)
def test_child_whose_request_beats_its_parents_notice_stays_on_its_parent(parent_holds):
    """Start-up in the multi-process benchmark (and a worker after kappa > 1 steps): the child's
    first request reaches the parent before the parent has read its own notice, so the parent
    answers future_version (it holds nothing, or only a version more than one back). That is
    'not yet', not a failed source: the child must not report it and be sent to the learner
    (one more stream off the learner's uplink for the whole broadcast: T_bcast 5.4 s -> 6.8 s
    per such child in the benchmark). It asks its parent again and gets every chunk there."""
    key = RunKey.generate()
    manifest, payload = snapshot(key, version=3)
    old, old_payload = snapshot(key, version=1, size=4 * CHUNK)

    async def body(ctx):
        root = Root(ctx, key)
        root.store.add(SnapshotBuffer(manifest, payload))
        parent, child = relay(ctx), relay(ctx)
        if parent_holds is not None:
            parent.store.add(SnapshotBuffer(old, old_payload))
        refused = _refusing_first(parent)
        reports = []

        async def reattach(bad, fail):  # what the coordinator did: the learner
            reports.append((bad.endpoint, fail.reason))
            return root.endpoint

        async def parent_gets_its_notice_late():
            await refused.wait()  # only after it has turned the child away once
            return await parent.receive(manifest, root.endpoint, None)

        async with asyncio.TaskGroup() as tg:
            servers = [tg.create_task(s.serve_forever()) for s in (root.server, parent, child)]
            ptask = tg.create_task(parent_gets_its_notice_late())
            buf, stats = await child.receive(manifest, parent.endpoint, reattach)
            await ptask
            for t in servers:
                t.cancel()
        return root, parent, buf, stats, reports

    root, parent, buf, stats, reports = asyncio.run(run(body))
    assert parent.server.rejected["future_version"] >= 1  # the race did happen
    assert bytes(buf.payload) == payload
    assert reports == [] and stats.failures == [] and stats.sources == [parent.endpoint]
    assert root.store.bytes_sent == len(payload)  # the learner fed the parent only


@pytest.mark.timeout(30)
def test_a_parent_that_never_gets_the_version_is_reported_as_timed_out():
    """A source that keeps answering 'not held yet' is one that serves nothing: after the
    fetch's timeout the child reports it (``timeout``, evidence against it), as it would a
    silent relay, and goes on elsewhere; it does not wait forever or ask it without end."""
    key = RunKey.generate()
    manifest, payload = snapshot(key, version=3)

    async def body(ctx):
        root = Root(ctx, key)
        root.store.add(SnapshotBuffer(manifest, payload))
        stuck, child = relay(ctx), relay(ctx, timeout_s=0.5)
        reports = []

        async def reattach(bad, fail):
            reports.append((bad.endpoint, fail.reason))
            return root.endpoint

        async with asyncio.TaskGroup() as tg:
            servers = [tg.create_task(s.serve_forever()) for s in (root.server, stuck, child)]
            buf, stats = await child.receive(manifest, stuck.endpoint, reattach)
            for t in servers:
                t.cancel()
        return stuck, buf, reports

    stuck, buf, reports = asyncio.run(run(body))
    assert bytes(buf.payload) == payload
    assert reports == [(stuck.endpoint, "timeout")]
    # backed off (20 ms doubling): a handful of rounds of the window of 3 in 0.5 s, not a flood
    assert stuck.server.rejected["future_version"] <= 3 * 6


class _RecordingSocket:
    """Just enough of a ROUTER for a ChunkServer: it records who each reply went to."""

    def __init__(self, replies: int):
        self.sent: list[bytes] = []
        self.done = asyncio.Event()
        self.replies = replies

    async def recv_multipart(self, copy=True):
        await asyncio.Event().wait()  # no requests on the wire: the test hands them in

    async def send_multipart(self, frames, copy=True, flags=0):
        self.sent.append(bytes(frames[0]))
        if len(self.sent) == self.replies:
            self.done.set()


@pytest.mark.timeout(30)
def test_a_newly_attached_child_is_served_in_turn_not_after_every_queued_request():
    """The learner feeds 3 chains, each head with its window of requests queued; a child
    whose parent died re-attaches to the learner and asks for a chunk. Its reply goes out
    after one reply to each peer already waiting (in turn), not after all their queued
    requests: first-come order made it wait 12-16 chunk times (0.3 s at 400 Mbit/s), and its
    broadcast ended that much later than the fault-free one."""
    key = RunKey.generate()
    manifest, payload = snapshot(key)
    heads, window = [b"head0", b"head1", b"head2"], 4

    async def body():
        store = SnapshotStore()
        store.add(SnapshotBuffer(manifest, payload))
        sock = _RecordingSocket(replies=len(heads) * window + 1)
        server = ChunkServer(sock, store, 1 << 24)
        rid = 0
        for i in range(window):
            for head in heads:
                rid += 1
                await server.handle(
                    head, [wire.encode(wire.ChunkRequest(version=1, index=i, rid=rid))]
                )
        await server.handle(
            b"orphan", [wire.encode(wire.ChunkRequest(version=1, index=20, rid=99))]
        )
        task = asyncio.create_task(server.serve_forever())
        await sock.done.wait()
        task.cancel()
        return sock.sent

    sent = asyncio.run(asyncio.wait_for(body(), 20))
    assert sorted(set(sent)) == sorted([*heads, b"orphan"])
    assert sent.index(b"orphan") <= len(heads)  # one turn of the peers already waiting
    for head in heads:  # and the heads still get their share, in turn
        assert sent.count(head) == window
