"""A peer relay's reply of any shape fails that source with a reason; the fetch goes on.

A junk source (a ROUTER on loopback) answers every chunk request with one kind of bad reply;
the fetch must report the failure to ``reattach`` (which names the real root) and finish with
the exact payload, never raise out of ``fetch_into``.
"""

import asyncio

import msgpack
import numpy as np
import pytest
import zmq
import zmq.asyncio

from echo_rl.broadcast.fetch import fetch_into
from echo_rl.broadcast.snapshot import RunKey, build_manifest, chunk_hash
from echo_rl.broadcast.source import ChunkServer
from echo_rl.broadcast.store import SnapshotBuffer, SnapshotStore
from echo_rl.core import wire

CHUNK = 4096
MAX_BYTES = 1 << 16


def _chunk(version, index, rid, **kw):
    return wire.encode(wire.Chunk(version=version, index=index, rid=rid, **kw))


# (name, reply frames for a request, expected failure reason)
BAD_REPLIES = [
    ("junk_header", lambda r: [b"\xc1\xff junk", b"x"], "corrupt"),
    ("unhashable_type", lambda r: [msgpack.packb({"v": 1, "type": ["x"]})], "corrupt"),
    (
        "bool_version",
        lambda r: [
            msgpack.packb(
                {"v": True, "type": "chunk", "version": 1, "index": r.index, "rid": r.rid}
            ),
            b"x",
        ],
        "corrupt",
    ),
    ("wrong_index", lambda r: [_chunk(r.version, r.index + 1, r.rid), b"\0" * CHUNK], "corrupt"),
    ("wrong_version", lambda r: [_chunk(r.version + 1, r.index, r.rid), b"\0" * CHUNK], "corrupt"),
    ("no_bytes_frame", lambda r: [_chunk(r.version, r.index, r.rid)], "corrupt"),
    ("short_bytes", lambda r: [_chunk(r.version, r.index, r.rid), b"\0" * 10], "corrupt"),
    ("wrong_bytes", lambda r: [_chunk(r.version, r.index, r.rid), b"\0" * CHUNK], "corrupt"),
    ("not_a_chunk", lambda r: [wire.encode(wire.Leave(worker_id="w", rid=r.rid))], "corrupt"),
    (
        "error",
        lambda r: [wire.encode(wire.Error(reason="nope", detail="x" * 1000, rid=r.rid))],
        "refused",
    ),
    # Larger than any header or chunk: zmq cuts the peer off (MAXMSGSIZE) before buffering it.
    (
        "huge_frame",
        lambda r: [_chunk(r.version, r.index, r.rid), b"\0" * (4 * MAX_BYTES)],
        "disconnected",
    ),
]


async def _junk_source(sock, make_reply):
    while True:
        ident, frame = await sock.recv_multipart()
        req = wire.decode(frame, MAX_BYTES)
        await sock.send_multipart([ident, *make_reply(req)])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name,make_reply,reason", BAD_REPLIES, ids=[b[0] for b in BAD_REPLIES])
def test_bad_reply_fails_the_source_and_the_fetch_resumes_elsewhere(name, make_reply, reason):
    key = RunKey.generate()
    payload = np.random.default_rng(1).bytes(10 * CHUNK + 7)
    manifest = build_manifest(
        run_id="t", version=1, tensors=[], payload=payload, chunk_size=CHUNK, dtype="uint8", key=key
    )

    async def body(ctx):
        root_store = SnapshotStore()
        root_store.add(SnapshotBuffer(manifest, payload))
        root_sock, junk_sock = ctx.socket(zmq.ROUTER), ctx.socket(zmq.ROUTER)
        for s in (root_sock, junk_sock):
            s.bind("tcp://127.0.0.1:*")
        root = root_sock.getsockopt_string(zmq.LAST_ENDPOINT)
        junk = junk_sock.getsockopt_string(zmq.LAST_ENDPOINT)
        store = SnapshotStore()
        store.add(SnapshotBuffer(manifest))
        failures = []

        async def reattach(bad, fail):
            failures.append((bad.endpoint, fail.reason))
            return root

        async with asyncio.TaskGroup() as tg:
            tasks = [
                tg.create_task(ChunkServer(root_sock, root_store, MAX_BYTES).serve_forever()),
                tg.create_task(_junk_source(junk_sock, make_reply)),
            ]
            stats = await fetch_into(
                ctx, store, 1, junk, window=3, timeout_s=10, max_bytes=MAX_BYTES, reattach=reattach
            )
            for t in tasks:
                t.cancel()
        return store.get(1), stats, failures

    ctx = zmq.asyncio.Context()
    try:
        buf, stats, failures = asyncio.run(asyncio.wait_for(body(ctx), 50))
    finally:
        ctx.destroy(linger=0)
    assert failures[0][1] == reason
    assert stats.failures[0] == (stats.sources[0], reason)
    assert buf.digest() == chunk_hash(payload)


BIG = (
    512 << 10
)  # above echo_rl.broadcast.chunk_checks.THREAD_MIN_BYTES: checked on the hashing thread


async def _scripted_source(sock, payload, good: set[int], bad_header: bool = False):
    """Serves chunk i's true bytes when i is in ``good``; otherwise zeros of the right size
    (found out by the hash), or with ``bad_header`` a reply for another chunk (found out at
    once)."""
    while True:
        ident, frame = await sock.recv_multipart()
        req = wire.decode(frame, MAX_BYTES)
        start = req.index * BIG
        index = req.index + (bad_header and req.index not in good)
        data = payload[start : start + BIG] if req.index in good else bytes(BIG)
        await sock.send_multipart([ident, _chunk(req.version, index, req.rid), data])


@pytest.mark.timeout(60)
def test_a_chunk_checked_on_the_thread_is_never_held_with_bytes_a_later_source_wrote(
    monkeypatch,
):
    """Source A sends chunk 0 intact, then a reply for the wrong chunk: A fails at once, while
    chunk 0's check still runs (slowed here). Source B sends zeros for everything. The fetch must not ask B
    for chunk 0 before its check is settled: a check that passed on A's bytes, finishing after
    B overwrote them, would mark B's zeros held (and never fetch them again)."""
    import time as _time

    from echo_rl.broadcast import chunk_checks

    real_hash = chunk_checks.chunk_hash

    def slow_hash(data):
        digest = real_hash(data)  # on the bytes as they are now...
        _time.sleep(0.3)  # ...and known only later
        return digest

    monkeypatch.setattr(chunk_checks, "chunk_hash", slow_hash)
    monkeypatch.setattr(chunk_checks, "THREADED", True)  # as on a host of more than two cores
    key = RunKey.generate()
    payload = np.random.default_rng(2).bytes(6 * BIG)
    manifest = build_manifest(
        run_id="t", version=1, tensors=[], payload=payload, chunk_size=BIG, dtype="uint8", key=key
    )
    max_bytes = 2 * BIG

    async def body(ctx):
        root_store = SnapshotStore()
        root_store.add(SnapshotBuffer(manifest, payload))
        socks = [ctx.socket(zmq.ROUTER) for _ in range(3)]
        for s in socks:
            s.bind("tcp://127.0.0.1:*")
        root, a, b = (s.getsockopt_string(zmq.LAST_ENDPOINT) for s in socks)
        store = SnapshotStore()
        store.add(SnapshotBuffer(manifest))
        failures = []

        async def reattach(bad, fail):
            failures.append((bad.endpoint, fail.reason))
            return b if bad.endpoint == a else root

        async with asyncio.TaskGroup() as tg:
            tasks = [
                tg.create_task(ChunkServer(socks[0], root_store, max_bytes).serve_forever()),
                tg.create_task(_scripted_source(socks[1], payload, good={0}, bad_header=True)),
                tg.create_task(_scripted_source(socks[2], payload, good=set())),
            ]
            await fetch_into(
                ctx, store, 1, a, window=2, timeout_s=10, max_bytes=max_bytes, reattach=reattach
            )
            for t in tasks:
                t.cancel()
        return store.get(1), failures, (a, b)

    ctx = zmq.asyncio.Context()
    try:
        buf, failures, (a, b) = asyncio.run(asyncio.wait_for(body(ctx), 50))
    finally:
        ctx.destroy(linger=0)
    assert failures == [(a, "corrupt"), (b, "corrupt")]
    assert buf.digest() == chunk_hash(payload)


def test_the_stall_bound_follows_the_measured_link():
    from echo_rl.broadcast.fetch import STALL_FLOOR_S, stall_bound

    mib = 1 << 20
    assert stall_bound(0.0, mib, 10.0) == 10.0  # nothing measured yet: the configured bound
    assert stall_bound(10_000.0, mib, 10.0) == STALL_FLOOR_S  # loopback: the floor
    assert stall_bound(50.0, mib, 10.0) == STALL_FLOOR_S  # 8 chunk times: 1.34 s, floored
    assert stall_bound(20.0, mib, 10.0) == pytest.approx(8 * 8 * mib / 1e6 / 20.0)  # 3.36 s
    assert stall_bound(1.0, mib, 10.0) == 10.0  # a slow link: never past the configured bound


def test_a_black_hole_source_is_left_after_the_stall_bound_not_the_timeout():
    """Issue 52, item 4: a relay that takes requests and never answers cost its child the
    flat 10 s; with the bound the link measured (here 1.5 s) the child is gone in that."""
    key = RunKey.generate()
    payload = np.random.default_rng(3).bytes(8 * CHUNK)
    manifest = build_manifest(
        run_id="t", version=1, tensors=[], payload=payload, chunk_size=CHUNK, dtype="uint8", key=key
    )

    async def body(ctx):
        root_store = SnapshotStore()
        root_store.add(SnapshotBuffer(manifest, payload))
        root_sock, hole = ctx.socket(zmq.ROUTER), ctx.socket(zmq.ROUTER)
        root_sock.bind("tcp://127.0.0.1:*")
        hole.bind("tcp://127.0.0.1:*")  # accepts, reads nothing, answers nothing
        root = root_sock.getsockopt_string(zmq.LAST_ENDPOINT)
        black = hole.getsockopt_string(zmq.LAST_ENDPOINT)
        store = SnapshotStore()
        store.add(SnapshotBuffer(manifest))

        async def reattach(bad, fail):
            return root

        async with asyncio.TaskGroup() as tg:
            server = tg.create_task(ChunkServer(root_sock, root_store, MAX_BYTES).serve_forever())
            stats = await fetch_into(
                ctx,
                store,
                1,
                black,
                window=2,
                timeout_s=10,
                stall_s=1.5,
                max_bytes=MAX_BYTES,
                reattach=reattach,
            )
            server.cancel()
        return store.get(1), stats

    ctx = zmq.asyncio.Context()
    try:
        buf, stats = asyncio.run(asyncio.wait_for(body(ctx), 30))
    finally:
        ctx.destroy(linger=0)
    assert buf.digest() == chunk_hash(payload)
    first = stats.attempts[0]
    assert first["reason"] == "timeout" and first["chunks"] == 0
    assert 1.4 <= first["end"] - first["start"] < 5.0  # the bound, not the 10 s timeout
