"""Serves snapshot chunks from a ROUTER socket: the learner, and every relaying worker.

Request: ``chunk_request{version, index, rid}``; reply: two frames, ``chunk{version, index,
rid}`` then the chunk bytes (a zero-copy slice), or ``error``. A request for a chunk this node
does not hold *yet* (it is still arriving from upstream, or the version's notice has not
reached this node) is parked and answered the moment the chunk verifies here: that is the
per-chunk store-and-forward of a chain. Parked requests expire after ``park_timeout_s``.

Replies leave through one sender task, paced by an optional token bucket (the node's upload
rate). Its queue holds at most one entry per outstanding request, i.e. window x children.
``corrupt=True`` flips a byte in every chunk sent (for integrity tests and benchmarks only).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict

import zmq
import zmq.asyncio

from broadcast.shaping import TokenBucket
from broadcast.store import SnapshotStore
from echo import wire

log = logging.getLogger(__name__)


class ChunkServer:
    def __init__(self, sock: zmq.asyncio.Socket, store: SnapshotStore, max_bytes: int, *,
                 upload: TokenBucket | None = None, park_timeout_s: float = 30.0,
                 corrupt: bool = False):
        self.sock = sock
        self.store = store
        self.max_bytes = max_bytes
        self.upload = upload
        self.park_timeout_s = park_timeout_s
        self.corrupt = corrupt
        self.rejected: dict[str, int] = defaultdict(int)
        self._parked: dict[tuple[int, int], list[tuple[bytes, int, float]]] = defaultdict(list)
        self._outbox: asyncio.Queue[tuple[bytes, int, int, int]] = asyncio.Queue()
        store.listeners.append(self._released)

    async def serve_forever(self) -> None:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self._receive())
            tg.create_task(self._send_loop())
            tg.create_task(self._expire_loop())

    async def _receive(self) -> None:
        while True:
            ident, *frames = await self.sock.recv_multipart()
            await self.handle(ident, frames)

    async def handle(self, ident: bytes, frames: list[bytes]) -> None:
        try:
            if len(frames) != 1:
                raise wire.WireError("malformed", f"{len(frames)} frames, expected 1")
            msg = wire.decode(frames[0], self.max_bytes)
            if not isinstance(msg, wire.ChunkRequest):
                raise wire.WireError("unknown_type", f"{msg.type} sent to the snapshot socket")
        except wire.WireError as err:
            self.rejected[err.reason] += 1
            log.warning("snapshot socket: rejected message from %s: %s", ident.hex(), err)
            await self._reply_error(ident, 0, err.reason, err.detail)
            return
        buf = self.store.get(msg.version)
        if buf is not None and msg.index >= buf.total:
            await self._reply_error(ident, msg.rid, "bad_index", f"version {msg.version} has "
                                    f"{buf.total} chunks, asked for {msg.index}")
        elif buf is not None and buf.have[msg.index]:
            self._outbox.put_nowait((ident, msg.rid, msg.version, msg.index))
        elif buf is not None or msg.version > self.store.newest_version:
            self._parked[(msg.version, msg.index)].append((ident, msg.rid, time.monotonic()))
        else:
            await self._reply_error(ident, msg.rid, "unknown_version",
                                    f"version {msg.version} is no longer held here")

    def _released(self, version: int, index: int) -> None:
        for ident, rid, _ in self._parked.pop((version, index), ()):
            self._outbox.put_nowait((ident, rid, version, index))

    async def _send_loop(self) -> None:
        while True:
            ident, rid, version, index = await self._outbox.get()
            buf = self.store.get(version)
            if buf is None:
                await self._reply_error(ident, rid, "unknown_version", f"version {version} dropped")
                continue
            data = buf.chunk(index)
            if self.upload is not None:
                await self.upload.consume(len(data))
            if self.corrupt:
                data = bytearray(data)
                data[len(data) // 2] ^= 0xFF
            header = wire.encode(wire.Chunk(version=version, index=index, rid=rid))
            try:
                await self.sock.send_multipart([ident, header, data], copy=False)
                self.store.bytes_sent += len(data)
            except zmq.ZMQError as exc:
                # EHOSTUNREACH: the requester went away (left, died, gave up on us).
                self.rejected["peer_gone"] += 1
                log.info("snapshot socket: could not reply to %s: %s", ident.hex(), exc)

    async def _expire_loop(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.park_timeout_s / 4))
            cutoff = time.monotonic() - self.park_timeout_s
            for key in [k for k, v in self._parked.items() if v and v[0][2] < cutoff]:
                for ident, rid, _ in self._parked.pop(key):
                    await self._reply_error(ident, rid, "unknown_version",
                                            f"version {key[0]} chunk {key[1]} never arrived here")

    async def _reply_error(self, ident: bytes, rid: int, reason: str, detail: str) -> None:
        try:
            await self.sock.send_multipart(
                [ident, wire.encode(wire.Error(reason=reason, detail=detail, rid=rid))])
        except zmq.ZMQError:
            self.rejected["peer_gone"] += 1

    @property
    def parked(self) -> int:
        return sum(len(v) for v in self._parked.values())
