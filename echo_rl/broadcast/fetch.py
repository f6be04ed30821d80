"""Pulls a snapshot into a ``SnapshotBuffer``, a window of chunk requests in flight.

Every chunk is checked against the manifest's BLAKE3 hash before it is stored (and so before
it can be forwarded or installed). When the source fails, the fetch asks ``reattach`` for a
new one and resumes with the chunks it still misses; nothing restarts from zero:

  * ``disconnected``: the source's connection closed (zmq socket monitor; immediate on a dead
    process);
  * ``timeout``: no reply for ``stall_s`` while chunks are asked for (a silent host, a black
    hole): a bound the caller sets from the link it measured (``stall_bound``: a few chunk
    times of the last fetch's rate, at least ``STALL_FLOOR_S``), ``timeout_s`` until it has
    measured one;
  * ``corrupt``: a chunk failed its hash (a relay that alters bytes is routed around);
  * ``refused``: the source answered with an error (it no longer holds that version).

"Not held yet" is no failure: a parent whose own notice of the version has not been read yet
(it holds nothing, at start-up, or only a version further back than the one before) answers
``future_version``. The request goes to the same source again after a short back-off
(``NOT_YET_S``, doubling to ``NOT_YET_MAX_S``, jittered: echo_rl.core.retry), in the same window slot, until the parent holds
the version and parks or serves it. A source that still answers so after ``timeout_s`` has
served nothing in that time and is reported as ``timeout``, like a silent one (before, the
child reported ``refused`` at once and was sent to the learner: one more stream off the
learner's uplink for the whole broadcast).

Encryption and admission: a ``Source`` carries the server's CURVE key and this worker's pull
ticket (``echo_rl.broadcast.tickets``); with ``keys`` the DEALER speaks CURVE and pins that key. Any
reply, however malformed, fails that source (``corrupt``), never the fetch or the process.

Download shaping: each received chunk first takes its size from the ``download`` bucket, so
the window of requests never outruns the link.
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import NotRequired, TypedDict, cast

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from echo_rl.broadcast.base_manifest import BaseManifest
from echo_rl.broadcast.chunk_checks import ChunkChecks, OnHeld
from echo_rl.broadcast.dialer import Dialer
from echo_rl.broadcast.dialer import close as close_connection
from echo_rl.broadcast.manifest import ChunkLayout, Manifest, SnapshotError
from echo_rl.broadcast.shaping import TokenBucket
from echo_rl.broadcast.store import SnapshotBuffer, SnapshotStore
from echo_rl.broadcast.tickets import Source
from echo_rl.core import wire
from echo_rl.core.errors import ReasonError
from echo_rl.core.retry import Backoff
from echo_rl.core.security import KeyPair


class Attempt(TypedDict):
    """One source tried by a fetch (``FetchStats.attempts``): where the chunks came from and
    when (wall-clock seconds), and, once it was left, why."""

    source: str
    start: float
    first: float | None  # the first chunk held from it
    last: float | None
    chunks: int
    not_yet: NotRequired[int]  # replies saying it did not hold a chunk yet
    end: NotRequired[float]
    reason: NotRequired[str]
    detail: NotRequired[str]


# Request ids start at a random point per process: a relay must not tell the learner's
# probe (echo_rl/control/verify.py, which draws its ids the same way) from a child by its ids.
_rids = itertools.count(random.SystemRandom().randrange(1, 1 << 31))
NOT_YET = ("future_version",)  # a source's answer for "I do not hold this version yet"
NOT_YET_S, NOT_YET_MAX_S = 0.02, 0.5  # first back-off before asking again, and its cap
REQUEST_BYTES = 4096  # bound on a chunk request or a reply header (a ticket is < 512 bytes)


class SourceFailed(ReasonError):
    """A snapshot source that failed this fetch; ``reason`` says how (timeout, corrupt,
    refused, disconnected), ``index`` the chunk when one was at fault."""

    def __init__(self, reason: str, detail: str, index: int = -1):
        super().__init__(reason, detail)
        self.index = index  # the chunk that failed, when one did (corrupt)


class NotYet(SourceFailed):
    """The source does not hold the version yet (``NOT_YET``): ask it again, later."""

    def __init__(self, detail: str, chunk: int):
        super().__init__("refused", detail)
        self.chunk = chunk  # the chunk to ask for again


Reattach = Callable[[Source, SourceFailed], Awaitable[Source | str]]  # failed source -> new one
Resolve = Callable[[str], Awaitable[str]]  # source endpoint -> address to connect to


@dataclass
class FetchStats:
    sources: list[str] = field(default_factory=list)
    failures: list[tuple[str, str]] = field(default_factory=list)  # (source, reason)
    chunks: int = 0
    bytes: int = 0  # received and verified
    seconds: float = 0.0  # from the start of the fetch to its last chunk (all sources)
    # One entry per source tried, in order: where the chunks came from and when (wall-clock
    # seconds, comparable across processes), and why the source was left (the trace a
    # benchmark writes per node: ``python -m labs.broadcast_bench --trace DIR``).
    attempts: list[Attempt] = field(default_factory=list)

    @property
    def down_mbit(self) -> float:
        """The download rate this fetch measured (0: nothing received)."""
        return self.bytes * 8 / 1e6 / self.seconds if self.bytes and self.seconds > 0 else 0.0


STALL_FLOOR_S = 1.5  # the shortest silence taken for a stall (a loaded host's pauses)
STALL_CHUNKS = 8.0  # a stall is this many chunk times of the measured link without a chunk


def stall_bound(down_mbit: float, chunk_bytes: int, timeout_s: float) -> float:
    """How long a fetch waits in silence for a source's next chunk before failing over: a few
    chunk times at the rate this node measured on its last fetch (``down_mbit``; 0: none
    yet), never under ``STALL_FLOOR_S`` nor over ``timeout_s``. A black-hole relay used to
    cost its child the flat 10 s (issue 52); on loopback it now costs ``STALL_FLOOR_S``."""
    if down_mbit <= 0:
        return timeout_s
    chunk_s = chunk_bytes * 8 / 1e6 / down_mbit
    return min(timeout_s, max(STALL_FLOOR_S, STALL_CHUNKS * chunk_s))


async def fetch_into(
    ctx: zmq.asyncio.Context,
    store: SnapshotStore,
    version: int,
    source: Source | str,
    *,
    window: int,
    timeout_s: float,
    max_bytes: int,
    download: TokenBucket | None = None,
    reattach: Reattach | None = None,
    max_attempts: int = 16,
    keys: KeyPair | None = None,
    resolve: Resolve | None = None,
    stall_s: float | None = None,
    dialer: Dialer | None = None,
) -> FetchStats:
    """``timeout_s``: how long a source may answer "not yet"; ``stall_s`` (default
    ``timeout_s``): how long it may be silent while chunks are asked for. ``dialer``: the
    connections kept from earlier fetches (``echo_rl.broadcast.dialer``; None: this fetch's own,
    closed when it ends); ``keys`` are used only without one (a dialer has its own)."""
    dialer = Dialer(ctx, keys, size=0) if dialer is None else dialer
    buf = store.get(version)
    assert buf is not None, "add the SnapshotBuffer to the store before fetching"
    stats = FetchStats()
    src = Source(source) if isinstance(source, str) else source
    t0 = time.monotonic()
    for _ in range(max_attempts):
        stats.sources.append(src.endpoint)
        attempt: Attempt = {
            "source": src.endpoint,
            "start": time.time(),
            "first": None,
            "last": None,
            "chunks": 0,
        }
        stats.attempts.append(attempt)
        try:
            address = await _address(src.endpoint, resolve)
            await _pull(
                ctx,
                store,
                version,
                src,
                address,
                window,
                timeout_s,
                max_bytes,
                download,
                stats,
                dialer,
                attempt,
                timeout_s if stall_s is None else stall_s,
            )
            stats.seconds = time.monotonic() - t0
            return stats
        except SourceFailed as fail:
            stats.failures.append((src.endpoint, fail.reason))
            attempt.update({"end": time.time(), "reason": fail.reason, "detail": fail.detail[:200]})
            if reattach is None:
                raise SnapshotError(f"fetching version {version} from {src}: {fail}") from None
            new = await reattach(src, fail)
            src = Source(new) if isinstance(new, str) else new
    raise SnapshotError(
        f"version {version}: gave up after {max_attempts} sources ({stats.failures})"
    )


async def _address(endpoint: str, resolve: Resolve | None) -> str:
    """Where to connect for ``endpoint``: itself, or the local end of a punched link
    (``echo_rl.broadcast.nat``); a link that cannot be had fails this source, not the fetch."""
    if resolve is None:
        if endpoint.startswith("punch/"):
            raise SourceFailed("unpunchable", f"{endpoint}: this node opens no punched links")
        return endpoint
    try:
        return await resolve(endpoint)
    except Exception as exc:  # LinkFailed (echo_rl.broadcast.nat.links) carries the reason
        raise SourceFailed(getattr(exc, "reason", "unpunchable"), str(exc)) from None


async def _pull(
    ctx: zmq.asyncio.Context,
    store: SnapshotStore,
    version: int,
    src: Source,
    address: str,
    window: int,
    timeout_s: float,
    max_bytes: int,
    download: TokenBucket | None,
    stats: FetchStats,
    dialer: Dialer,
    attempt: Attempt | None = None,
    stall_s: float | None = None,
) -> None:
    stall = timeout_s if stall_s is None else stall_s
    buf = store.get(version)
    if buf is None:  # dropped meanwhile (a restarted learner's versions are forgotten): no fetch
        raise SnapshotError(f"version {version} was dropped while it was being fetched")
    todo = iter(buf.missing())
    source = src.endpoint
    max_reply = buf.layout.chunk_size + REQUEST_BYTES
    conn = dialer.open(address, src.key, max_reply)
    sock, monitor = conn
    kept = False
    plain: zmq.Socket[bytes] = zmq.Socket.shadow(sock.underlying)
    poller = zmq.asyncio.Poller()
    poller.register(sock, zmq.POLLIN)
    poller.register(monitor, zmq.POLLIN)
    pending: dict[int, int] = {}  # rid -> chunk index
    form = buf.layout.form  # "full": a keyframe (Manifest.result_layout); "base": a base model
    checks = ChunkChecks(buf, store, _counter(stats, attempt))

    async def request_next() -> None:
        for index in todo:
            if not buf.have[index]:
                await request(index)
                return

    async def request(index: int) -> None:
        rid = next(_rids)
        pending[rid] = index
        await sock.send(
            wire.encode(
                wire.ChunkRequest(
                    version=version, index=index, rid=rid, ticket=src.ticket, form=form
                )
            )
        )

    # Chunks the source does not hold yet (``NotYet``): asked again at ``retry_at``; each keeps
    # its window slot meanwhile. ``not_yet_since``: when the source last had nothing for us.
    deferred: list[int] = []
    retry_at, backoff = 0.0, Backoff(NOT_YET_S, NOT_YET_MAX_S)  # jittered: siblings spread
    not_yet_since: float | None = None  # set with the first deferred chunk
    try:
        for _ in range(window):
            await request_next()
        while pending or deferred or checks.running:
            _raise_failed(checks)
            if not pending and not deferred:  # every chunk is here: their checks remain
                await checks.wait(timeout_s)
                continue
            now = time.monotonic()
            if deferred and now >= retry_at:
                if not_yet_since is not None and now - not_yet_since >= timeout_s:
                    raise SourceFailed(
                        "timeout",
                        f"{source} did not hold version {version} "
                        f"within {timeout_s}s (it answered 'not yet')",
                    )
                for index in deferred:
                    await request(index)
                deferred.clear()
            wait = stall if not deferred else max(0.0, retry_at - time.monotonic())
            events = dict(await poller.poll(wait * 1000))
            if not events:
                if deferred:
                    continue
                raise SourceFailed("timeout", f"no chunk from {source} within {stall:.1f}s")
            if monitor in events:
                parse_monitor_message(await monitor.recv_multipart())
                raise SourceFailed("disconnected", f"{source} closed the connection")
            # Drain every reply already queued before polling again: one poll per chunk costs
            # a round through the event loop that a fast link does not need.
            while True:
                try:
                    got = await _receive(plain, buf, checks, pending, max_bytes, download)
                except NotYet as ny:
                    if not deferred:
                        retry_at = time.monotonic() + backoff.next()
                    not_yet_since = not_yet_since or time.monotonic()
                    deferred.append(ny.chunk)
                    if attempt is not None:
                        attempt["not_yet"] = attempt.get("not_yet", 0) + 1
                else:
                    if got:  # the source holds the version now
                        backoff.reset()
                        not_yet_since = None
                    await request_next()
                if not (pending and cast(int, plain.getsockopt(zmq.EVENTS)) & zmq.POLLIN):
                    break
        _raise_failed(checks)
        kept = not pending  # nothing in flight: the next fetch from here may use it
    finally:
        try:
            # before any slot is asked for again (echo_rl.broadcast.chunk_checks)
            await checks.settle()
        finally:
            if kept:
                dialer.keep(address, src.key, max_reply, conn)
            else:
                close_connection(conn)


def _raise_failed(checks: ChunkChecks) -> None:
    if checks.failed is not None:
        index, why = checks.failed
        raise SourceFailed("corrupt", why, index)


def _counter(stats: FetchStats, attempt: Attempt | None) -> OnHeld:
    """What a verified chunk adds to the fetch's figures and its attempt's trace."""

    def held(index: int, nbytes: int) -> None:
        stats.chunks += 1
        stats.bytes += nbytes
        if attempt is not None:
            now = time.time()
            attempt["first"] = attempt["first"] or now
            attempt["last"] = now
            attempt["chunks"] += 1

    return held


def check_reply(
    header: bytes, more: bool, pending: dict[int, int], version: int, max_bytes: int
) -> int | None:
    """Which requested chunk's bytes follow this reply header; None for a late reply (to a
    request of an earlier attempt). A reply of any other shape fails the source with a reason
    (``SourceFailed``), never another exception: a relay is a peer, not a trusted party."""
    try:
        msg = wire.decode(header, max_bytes)
    except wire.WireError as err:
        raise SourceFailed("corrupt", f"unreadable reply ({err})") from None
    index = pending.pop(msg.rid, None)
    if index is None:
        return None
    if isinstance(msg, wire.Error):
        if msg.reason in NOT_YET:
            raise NotYet(f"chunk {index}: {msg.reason} ({msg.detail[:200]})", index)
        raise SourceFailed("refused", f"chunk {index}: {msg.reason} ({msg.detail[:200]})")
    if not isinstance(msg, wire.Chunk) or msg.index != index or msg.version != version or not more:
        raise SourceFailed(
            "corrupt", f"malformed reply for chunk {index} of version {version}", index
        )
    return index


def _drain(sock: zmq.Socket[bytes]) -> None:
    while sock.getsockopt(zmq.RCVMORE):
        sock.recv(zmq.NOBLOCK)  # the rest of this reply


async def _receive(
    sock: zmq.Socket[bytes],
    buf: SnapshotBuffer,
    checks: ChunkChecks,
    pending: dict[int, int],
    max_bytes: int,
    download: TokenBucket | None,
) -> bool:
    """Read one reply (the poller said one is waiting: all its frames are here); True if it
    was a chunk, now in place and handed to ``checks``.

    ``sock`` is a plain (non-asyncio) shadow of the DEALER so that the chunk bytes can be
    received straight into their place in the payload buffer (``recv_into``): no copy. They
    only count as held once their hash verified; a bad chunk is overwritten by the retry.
    """
    header = sock.recv(zmq.NOBLOCK)
    try:
        index = check_reply(
            header, bool(sock.getsockopt(zmq.RCVMORE)), pending, buf.version, max_bytes
        )
    except SourceFailed:
        _drain(sock)
        raise
    if index is None:
        _drain(sock)
        return False
    start, end = buf.layout.chunk_range(index)
    target = buf.view[start:end]
    n = sock.recv_into(target, flags=zmq.NOBLOCK)  # a longer frame is cut: n says its size
    _drain(sock)
    if n != end - start:
        raise SourceFailed("corrupt", f"chunk {index} has {n} bytes, expected {end - start}", index)
    if download is not None:
        await download.consume(n)
    checks.submit(index, target)
    _raise_failed(checks)  # a chunk checked inline fails its source at once
    return True


async def fetch_snapshot(
    sock_ctx: zmq.asyncio.Context,
    manifest: Manifest | BaseManifest | ChunkLayout,
    source: Source | str,
    *,
    window: int,
    timeout_s: float,
    max_bytes: int,
    keys: KeyPair | None = None,
) -> bytearray:
    """One-shot convenience: a whole snapshot from one source into a fresh buffer."""
    store = SnapshotStore()
    buf = store.add(SnapshotBuffer(manifest))
    await fetch_into(
        sock_ctx,
        store,
        buf.version,
        source,
        window=window,
        timeout_s=timeout_s,
        max_bytes=max_bytes,
        keys=keys,
    )
    assert isinstance(buf.payload, bytearray)  # received into a fresh buffer
    return buf.payload
