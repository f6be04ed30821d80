"""A fetch keeps its connection to a source for the next version (echo_rl/broadcast/dialer.py).

Before, every version's fetch opened a fresh encrypted connection: a handshake and a ZAP
decision at the source per version. Workers sharing one address then ran into the source's
handshake limit per IP, heard nothing back ("try later") and failed over after the stall bound
with their batches going stale (issue 52, the quiet drill). The source here is a CURVE
``ChunkServer`` whose ZAP handler admits two handshakes and answers "rate_limited" after.
"""

import asyncio

import numpy as np
import pytest
import zmq
import zmq.asyncio

from echo_rl.broadcast.dialer import Dialer
from echo_rl.broadcast.fetch import fetch_into
from echo_rl.broadcast.snapshot import RunKey, build_manifest
from echo_rl.broadcast.source import ChunkServer
from echo_rl.broadcast.store import SnapshotBuffer, SnapshotStore
from echo_rl.broadcast.tickets import Source
from echo_rl.core.security import KeyPair, ZapHandler, curve_server

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

CHUNK = 16 * 1024
VERSIONS = 12


class LimitedSource:
    """A CURVE chunk server holding ``VERSIONS`` versions; its ZAP handler admits
    ``admit`` handshakes, then refuses each one as ``rate_limited`` (counted)."""

    def __init__(self, ctx, key, admit=2):
        self.keys = KeyPair.generate()
        self.handshakes = 0
        self.admit = admit
        self.zap = ZapHandler(ctx, self._decide)
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        curve_server(sock, self.keys)
        sock.bind("tcp://127.0.0.1:*")
        self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.store = SnapshotStore(keep=VERSIONS)
        self.manifests = {}
        for v in range(1, VERSIONS + 1):
            payload = np.random.default_rng(v).bytes(3 * CHUNK + 11)
            m = build_manifest(
                run_id="t",
                version=v,
                tensors=[],
                payload=payload,
                chunk_size=CHUNK,
                dtype="uint8",
                key=key,
            )
            self.manifests[v] = (m, payload)
            self.store.add(SnapshotBuffer(m, payload))
        self.server = ChunkServer(sock, self.store, 1 << 20)

    def _decide(self, address, key):
        self.handshakes += 1
        return "" if self.handshakes <= self.admit else "rate_limited"

    async def serve(self):
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self.zap.serve())
            tg.create_task(self.server.serve_forever())


async def _fetch_all(dialer, source, client_ctx, keys):
    """Every version in turn into a child's store, as a worker follows the versions."""
    store = SnapshotStore(keep=2)
    got = []
    for v in range(1, VERSIONS + 1):
        manifest, payload = source.manifests[v]
        buf = store.add(SnapshotBuffer(manifest))
        await fetch_into(
            client_ctx,
            store,
            v,
            Source(source.endpoint, source.keys.public),
            window=2,
            timeout_s=1.0,
            stall_s=1.0,
            max_bytes=1 << 20,
            keys=keys,
            dialer=dialer,
        )
        got.append(bytes(buf.payload) == payload)
    return got


async def _with_source(body):
    server_ctx, client_ctx = zmq.asyncio.Context(), zmq.asyncio.Context()
    source = LimitedSource(server_ctx, RunKey.generate())
    serving = asyncio.create_task(source.serve())
    try:
        return await body(source, client_ctx)
    finally:
        serving.cancel()
        await asyncio.gather(serving, return_exceptions=True)
        client_ctx.destroy(linger=0)
        server_ctx.destroy(linger=0)


def test_versions_fetched_in_a_row_cost_one_handshake_and_pass_a_tight_handshake_limit():
    async def body(source, client_ctx):
        dialer = Dialer(client_ctx, KeyPair.generate())
        got = await _fetch_all(dialer, source, client_ctx, None)
        return got, dialer.opened, dialer.reused, dialer.idle, source.handshakes

    got, opened, reused, idle, handshakes = asyncio.run(_with_source(body))
    assert got == [True] * VERSIONS  # every version's exact bytes
    assert (opened, reused, idle) == (1, VERSIONS - 1, 1)
    assert handshakes == 1  # the source decided once, not once per version


def test_without_a_kept_connection_the_handshake_limit_stalls_the_fetch():
    """The old way (a fresh connection per fetch) against the same source: the third fetch's
    handshake is refused "try later" and the fetch fails: it hears nothing until its stall
    bound, or, when libzmq drops the refused connection first (a loaded machine, one run in
    six with six at once, before and after issue 53), it is told the source disconnected."""
    from echo_rl.broadcast.manifest import SnapshotError

    async def body(source, client_ctx):
        with pytest.raises(SnapshotError, match="timeout|disconnected"):
            await _fetch_all(None, source, client_ctx, KeyPair.generate())
        return source.handshakes

    assert asyncio.run(_with_source(body)) >= 3


def test_a_failed_fetch_closes_its_connection_and_the_idle_set_is_bounded():
    async def body(source, client_ctx):
        dialer = Dialer(client_ctx, KeyPair.generate(), size=2)
        store = SnapshotStore(keep=2)
        manifest, _ = source.manifests[1]
        store.add(SnapshotBuffer(manifest))
        # a version the source does not hold: it refuses, the connection is not kept
        missing = build_manifest(
            run_id="t",
            version=VERSIONS + 5,
            tensors=[],
            payload=b"x" * CHUNK,
            chunk_size=CHUNK,
            dtype="uint8",
            key=RunKey.generate(),
        )
        store.add(SnapshotBuffer(missing))
        with pytest.raises(SnapshotError, match="refused|timeout"):
            await fetch_into(
                client_ctx,
                store,
                VERSIONS + 5,
                Source(source.endpoint, source.keys.public),
                window=2,
                timeout_s=0.5,
                stall_s=0.5,
                max_bytes=1 << 20,
                dialer=dialer,
            )
        after_failure = dialer.idle
        # three other sources' connections: only the two most recent stay open
        for port in (1, 2, 3):
            conn = dialer.open(f"tcp://127.0.0.1:{port}", b"", 1024)
            dialer.keep(f"tcp://127.0.0.1:{port}", b"", 1024, conn)
        return after_failure, dialer.idle, dialer.opened

    from echo_rl.broadcast.manifest import SnapshotError

    after_failure, idle, opened = asyncio.run(_with_source(body))
    assert after_failure == 0
    assert idle == 2 and opened == 4


def test_a_connection_the_source_dropped_while_idle_is_not_reused():
    async def body(source, client_ctx):
        dialer = Dialer(client_ctx, KeyPair.generate())
        store = SnapshotStore(keep=2)
        manifest, _ = source.manifests[1]
        store.add(SnapshotBuffer(manifest))
        src = Source(source.endpoint, source.keys.public)
        await fetch_into(
            client_ctx, store, 1, src, window=2, timeout_s=5.0, max_bytes=1 << 20, dialer=dialer
        )
        (conn,) = dialer._idle.values()  # the fetch's connection, kept
        source.server.sock.close(linger=0)  # the source went away
        assert await conn.monitor.poll(10_000)  # its disconnect reached the monitor
        again = dialer.open(source.endpoint, source.keys.public, next(iter(dialer._idle))[2])
        return again is conn, dialer.opened, dialer.reused

    reused_it, opened, reused = asyncio.run(_with_source(body))
    assert not reused_it and (opened, reused) == (2, 0)


def test_junk_a_source_pushes_down_a_kept_connection_fails_that_source_not_the_process():
    """A kept connection outlives the fetch that opened it: a hostile source can push bytes
    down it between fetches. The next fetch reads them as a reply: the source fails with a
    reason (corrupt), the connection is closed, and nothing else is touched."""
    from echo_rl.broadcast.manifest import SnapshotError
    from echo_rl.core import wire

    key = RunKey.generate()
    payloads = {v: np.random.default_rng(v).bytes(CHUNK) for v in (1, 2)}
    manifests = {
        v: build_manifest(
            run_id="t", version=v, tensors=[], payload=p, chunk_size=CHUNK, dtype="uint8", key=key
        )
        for v, p in payloads.items()
    }

    async def body():
        ctx = zmq.asyncio.Context()
        server = ctx.socket(zmq.ROUTER)
        port = server.bind_to_random_port("tcp://127.0.0.1")
        endpoint = f"tcp://127.0.0.1:{port}"

        async def serve():
            while True:
                ident, frame = await server.recv_multipart()
                req = wire.decode(frame, 1 << 20)
                head = wire.Chunk(version=req.version, index=req.index, rid=req.rid)
                await server.send_multipart([ident, wire.encode(head), payloads[req.version]])
                # then, unasked, junk down the same connection
                await server.send_multipart([ident, b"\xc1\xff not a reply", b"x" * 100])

        dialer = Dialer(ctx, None)
        store = SnapshotStore(keep=2)
        task = asyncio.ensure_future(serve())
        try:
            store.add(SnapshotBuffer(manifests[1]))
            await fetch_into(
                ctx, store, 1, endpoint, window=1, timeout_s=5.0, max_bytes=1 << 20, dialer=dialer
            )
            kept = dialer.idle
            (conn,) = dialer._idle.values()
            assert await conn.sock.poll(5000)  # the junk has arrived on the idle connection
            store.add(SnapshotBuffer(manifests[2]))
            with pytest.raises(SnapshotError, match="corrupt"):
                await fetch_into(
                    ctx,
                    store,
                    2,
                    endpoint,
                    window=1,
                    timeout_s=5.0,
                    max_bytes=1 << 20,
                    dialer=dialer,
                )
            return kept, dialer.idle
        finally:
            task.cancel()
            dialer.close()
            server.close(linger=0)
            ctx.destroy(linger=0)

    kept, idle = asyncio.run(body())
    assert (kept, idle) == (1, 0)  # kept after the clean fetch, closed after the junk
