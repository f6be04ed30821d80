"""Serves snapshot chunks from a ROUTER socket: the learner, and every relaying worker.

Request: ``chunk_request{version, index, rid}``; reply: two frames, ``chunk{version, index,
rid}`` then the chunk bytes (a zero-copy slice), or ``error``. A request for a chunk this node
does not hold *yet* (it is still arriving from upstream, or the version's notice has not
reached this node) is parked and answered the moment the chunk verifies here: that is the
per-chunk store-and-forward of a chain. Parked requests expire after ``park_timeout_s``.

Who is served (docs/security.md): on a CURVE socket every request carries its sender's key
(``User-Id``); ``authorize(key, ticket)`` says whether that key may pull here (the learner: a
joined worker; a relay: the holder of a ticket for this relay, see ``echo_rl.broadcast.tickets``).
Requests for chunks not held yet are parked only for the next version at most, and at most
``max_parked_per_peer`` per peer and ``max_parked_total`` in all; past that they are refused
with a counted reason. A peer's requests, however malformed, end that request at most.

Replies leave through one sender task, paced by an optional token bucket (the node's upload
rate). Its queues hold at most one entry per outstanding request, i.e. window x children, one
queue per peer, served in turn (one reply each): a child that arrives while others keep their
windows full here (a re-attach after its parent died) gets its first chunk after one reply,
not after every request already queued (first-come order cost it 0.3 s at the learner with
4 streams x 4 requests of 1 MiB at 400 Mbit/s, and its whole broadcast ended that much later).
It measures its upload per version (``upload_mbit``): bytes sent / seconds a reply was waiting
to go out, so time spent waiting for chunks from upstream (parked requests) does not count.
On an unshaped link a send only queues into the socket, so this end reads high: the child's
download report is then what binds (``echo_rl.broadcast.link_meter``).

Keyframes (docs/broadcast.md, "Delta snapshots"): a request with ``form`` "full" asks for a chunk
of a version's rebuilt payload, served from ``results`` (the full payload of what this node
installed) to a worker that lacks the base of a delta. Only complete versions are served in
that form (nothing is parked: what is not held is refused ``unknown_version``). Form "base"
is the same for the base model of a LoRA run, served from ``bases`` (``echo_rl.broadcast.basemodel``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass

import zmq
import zmq.asyncio

from echo_rl.broadcast.shaping import TokenBucket
from echo_rl.broadcast.store import SnapshotBuffer, SnapshotStore
from echo_rl.core import wire
from echo_rl.core.security import LogThrottle, PeerLimits, sender_key

Authorize = Callable[[str, bytes], str]  # (peer key, ticket) -> "" or the refusal reason

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServeLimits:
    """What one peer, and all of them, may ask of a chunk server (see the module docstring):
    requests parked at most ``park_timeout_s``, ``max_parked_per_peer`` per peer and
    ``max_parked_total`` in all; ``requests_per_s`` per peer (burst 2x)."""

    park_timeout_s: float = 30.0
    max_parked_per_peer: int = 64
    max_parked_total: int = 4096
    requests_per_s: float = 1000.0


class ChunkServer:
    def __init__(
        self,
        sock: zmq.asyncio.Socket,
        store: SnapshotStore,
        max_bytes: int,
        *,
        upload: TokenBucket | None = None,
        authorize: Authorize | None = None,
        limits: ServeLimits = ServeLimits(),
        results: SnapshotStore | None = None,
        bases: SnapshotStore | None = None,
    ):
        self.sock = sock
        self.store = store
        self.results = results
        self.bases = bases
        # What a request's form is served from: only complete payloads, never parked.
        self._held = {"full": results, "base": bases}
        self.max_bytes = max_bytes
        self.upload = upload
        self.park_timeout_s = limits.park_timeout_s
        self.authorize = authorize
        # Attributes of their own: a relay tunes them to the learner's config once joined.
        self.max_parked_per_peer = limits.max_parked_per_peer
        self.max_parked_total = limits.max_parked_total
        self.rejected: dict[str, int] = defaultdict(int)
        # Requests per second per peer (burst 2x); past it requests are dropped unanswered
        # and counted: a flood costs a recv and a bucket look-up, not a reply or a log line.
        self._rate = PeerLimits(limits.requests_per_s, 2 * limits.requests_per_s)
        self._log = LogThrottle()
        # Parked requests: (version, index) -> [(ident, rid, since, peer)]. Bounded as above.
        self._parked: dict[tuple[int, int], list[tuple[bytes, int, float, str]]] = defaultdict(list)
        self._parked_by: Counter[str] = Counter()
        # Replies to send, one queue per peer, served in turn (``_turns``: the peers with
        # replies waiting). Unbounded as queues, bounded by what feeds them: one entry per
        # authorised request, and a peer's requests in flight here are capped like parked ones.
        self._outbox: dict[str, deque[tuple[bytes, int, int, int, float, str]]] = {}
        self._turns: deque[str] = deque()
        self._waiting = asyncio.Event()  # set while some reply waits
        self._queued_by: Counter[str] = Counter()
        self.served: dict[int, list[float]] = {}  # version -> [bytes sent, seconds busy sending]
        self._last_sent = 0.0
        store.listeners.append(self._released)

    async def serve_forever(self) -> None:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self._receive())
            tg.create_task(self._send_loop())
            tg.create_task(self._expire_loop())

    async def _receive(self) -> None:
        while True:
            ident, *frames = await self.sock.recv_multipart(copy=False)
            try:
                # The key from whichever frame carries the connection's metadata.
                await self.handle(
                    ident.bytes, [f.bytes for f in frames], sender_key([ident, *frames])
                )
            except Exception:  # a bug here must cost one request, not every child's stream
                self.rejected["internal_error"] += 1
                log.exception("snapshot socket: internal error on a request")

    async def handle(self, ident: bytes, frames: list[bytes], peer: str = "") -> None:
        """One request from one peer; whatever it holds ends at most this request."""
        who = peer or ident.hex()
        if not self._rate.take(who):
            self.rejected["rate_limited"] += 1
            return
        try:
            msg = self._parse(frames, peer)
        except wire.WireError as err:
            self.rejected[err.reason] += 1
            if self._log.ok(who):
                log.warning("snapshot socket: refused a request from %s: %s", who, err)
            await self._reply_error(ident, 0, err.reason, err.detail)
            return
        if msg.form != "payload":
            await self._handle_held(ident, msg, who)
            return
        buf = self.store.get(msg.version)
        if buf is not None and msg.index >= buf.total:
            await self._refuse(
                ident,
                msg.rid,
                "bad_index",
                f"version {msg.version} has {buf.total} chunks, asked for {msg.index}",
            )
        elif self._parked_by[who] + self._queued_by[who] >= self.max_parked_per_peer:
            await self._refuse(
                ident,
                msg.rid,
                "too_many_requests",
                f"more than {self.max_parked_per_peer} requests waiting; keep a smaller window",
            )
        elif buf is not None and buf.have[msg.index]:
            self._enqueue(ident, msg.rid, msg.version, msg.index, who)
        elif buf is None and msg.version > self.store.newest_version + 1:
            await self._refuse(
                ident,
                msg.rid,
                "future_version",
                f"version {msg.version} is beyond the next one ({self.store.newest_version + 1})",
            )
        elif buf is not None or msg.version > self.store.newest_version:
            if self.parked >= self.max_parked_total:
                await self._refuse(ident, msg.rid, "parking_full", "too many waiting requests")
                return
            self._parked[(msg.version, msg.index)].append((ident, msg.rid, time.monotonic(), who))
            self._parked_by[who] += 1
        else:
            await self._reply_error(
                ident, msg.rid, "unknown_version", f"version {msg.version} is no longer held here"
            )

    async def _handle_held(self, ident: bytes, msg: wire.ChunkRequest, who: str) -> None:
        """A chunk of a complete payload: a keyframe ("full") or the base model ("base")."""
        store = self._held[msg.form]
        buf = store.get(msg.version) if store is not None else None
        what = (
            "the base model" if msg.form == "base" else f"the full payload of version {msg.version}"
        )
        if buf is None or not buf.done:
            await self._refuse(
                ident,
                msg.rid,
                "unknown_version",
                f"{what} is not held here: ask the learner for another source",
            )
        elif msg.index >= buf.total:
            await self._refuse(
                ident, msg.rid, "bad_index", f"{what} has {buf.total} chunks, asked for {msg.index}"
            )
        elif self._parked_by[who] + self._queued_by[who] >= self.max_parked_per_peer:
            await self._refuse(
                ident,
                msg.rid,
                "too_many_requests",
                f"more than {self.max_parked_per_peer} requests waiting; keep a smaller window",
            )
        else:
            self._enqueue(ident, msg.rid, msg.version, msg.index, who, msg.form)

    def _parse(self, frames: list[bytes], peer: str) -> wire.ChunkRequest:
        if len(frames) != 1:
            raise wire.WireError("malformed", f"{len(frames)} frames, expected 1")
        try:
            msg = wire.decode(frames[0], self.max_bytes)
        except wire.WireError:
            raise
        except Exception as exc:  # a decoder bug must cost one request, not the process
            raise wire.WireError("malformed", f"undecodable ({type(exc).__name__})") from None
        if not isinstance(msg, wire.ChunkRequest):
            raise wire.WireError("unknown_type", f"{msg.type} sent to the snapshot socket")
        if self.authorize is not None:
            reason = self.authorize(peer, msg.ticket)
            if reason:
                raise wire.WireError(
                    reason,
                    "this peer is not assigned to pull from here: ask "
                    "the learner for a source (source_request)",
                )
        return msg

    async def _refuse(self, ident: bytes, rid: int, reason: str, detail: str) -> None:
        self.rejected[reason] += 1
        await self._reply_error(ident, rid, reason, detail)

    def _enqueue(
        self, ident: bytes, rid: int, version: int, index: int, who: str, form: str = "payload"
    ) -> None:
        self._queued_by[who] += 1
        queue = self._outbox.get(who)
        if queue is None:
            queue = self._outbox[who] = deque()
            self._turns.append(who)
        queue.append((ident, rid, version, index, time.monotonic(), form))
        self._waiting.set()

    async def _next_reply(self) -> tuple[bytes, int, int, int, str, float, str]:
        """The next reply to send: the head of the queue of the peer whose turn it is."""
        while not self._turns:
            self._waiting.clear()
            await self._waiting.wait()
        who = self._turns.popleft()
        queue = self._outbox[who]
        ident, rid, version, index, queued_at, form = queue.popleft()
        if queue:
            self._turns.append(who)
        else:
            del self._outbox[who]
        return ident, rid, version, index, who, queued_at, form

    def _released(self, version: int, index: int) -> None:
        for ident, rid, _, who in self._parked.pop((version, index), ()):
            self._unpark(who)
            self._enqueue(ident, rid, version, index, who)

    def _unpark(self, who: str) -> None:
        self._parked_by[who] -= 1
        if self._parked_by[who] <= 0:
            del self._parked_by[who]

    def outgoing(self, buf: SnapshotBuffer, index: int) -> memoryview | bytes:
        """The bytes sent for chunk ``index`` of ``buf``: the chunk itself. The one seam a test
        double overrides to play a relay that alters what it forwards (labs/doubles.py)."""
        return buf.chunk(index)

    async def _send_loop(self) -> None:
        while True:
            ident, rid, version, index, who, queued_at, form = await self._next_reply()
            self._queued_by[who] -= 1
            if self._queued_by[who] <= 0:
                del self._queued_by[who]
            store = self._held[form] if form != "payload" else self.store
            buf = store.get(version) if store is not None else None
            if buf is None:
                await self._reply_error(ident, rid, "unknown_version", f"version {version} dropped")
                continue
            data = self.outgoing(buf, index)
            if self.upload is not None:
                await self.upload.consume(len(data))
            header = wire.encode(wire.Chunk(version=version, index=index, rid=rid))
            try:
                # NOBLOCK: a peer that requests but never reads fills its queue; its replies
                # are then dropped (it times out) instead of stalling every other child.
                await self.sock.send_multipart([ident, header, data], copy=False, flags=zmq.NOBLOCK)
                buf.sent(index)  # zmq may still read it: a dropped page faults back in
                self.store.bytes_sent += len(data)
                self._count_sent(version, len(data), queued_at)
            except zmq.ZMQError as exc:
                # EHOSTUNREACH: the requester went away (left, died, gave up on us).
                self.rejected["peer_gone"] += 1
                log.info("snapshot socket: could not reply to %s: %s", ident.hex(), exc)

    def _count_sent(self, version: int, n: int, queued_at: float) -> None:
        """Charge this reply the time since it, or the reply before it, was ready to go:
        the sum is the time the server had something to send (its busy time)."""
        now = time.monotonic()
        start = max(queued_at, self._last_sent)
        self._last_sent = now
        entry = self.served.setdefault(version, [0.0, 0.0])
        entry[0] += n
        entry[1] += now - start
        for old in sorted(self.served)[:-4]:
            del self.served[old]

    def upload_mbit(self, version: int) -> float:
        """What this server measured uploading ``version`` so far (0: served nothing)."""
        sent, busy = self.served.get(version, (0.0, 0.0))
        return sent * 8 / 1e6 / busy if sent and busy > 0 else 0.0

    async def _expire_loop(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.park_timeout_s / 4))
            cutoff = time.monotonic() - self.park_timeout_s
            for key in [k for k, v in self._parked.items() if v and v[0][2] < cutoff]:
                for ident, rid, _, who in self._parked.pop(key):
                    self._unpark(who)
                    await self._reply_error(
                        ident,
                        rid,
                        "unknown_version",
                        f"version {key[0]} chunk {key[1]} never arrived here",
                    )

    async def _reply_error(self, ident: bytes, rid: int, reason: str, detail: str) -> None:
        try:
            await self.sock.send_multipart(
                [ident, wire.encode(wire.Error(reason=reason, detail=detail, rid=rid))],
                flags=zmq.NOBLOCK,
            )
        except zmq.ZMQError:
            self.rejected["peer_gone"] += 1

    @property
    def parked(self) -> int:
        return sum(len(v) for v in self._parked.values())
