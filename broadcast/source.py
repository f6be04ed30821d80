"""Serves snapshot chunks from a ROUTER socket (the learner, or any relay that holds them).

Request: ``chunk_request{version, index, rid}``; reply: two frames, ``chunk{version, index,
rid}`` then the chunk bytes (a zero-copy slice of the payload), or ``error``. Only the latest
``keep`` versions are held; a request for another version gets ``error{reason=unknown_version}``
so the worker asks for the newer one.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import zmq
import zmq.asyncio

from broadcast.snapshot import Snapshot
from echo import wire

log = logging.getLogger(__name__)


class SnapshotStore:
    def __init__(self, keep: int = 2):
        self.keep = keep
        self._snaps: OrderedDict[int, Snapshot] = OrderedDict()
        self.bytes_sent = 0

    def add(self, snap: Snapshot) -> None:
        self._snaps[snap.version] = snap
        while len(self._snaps) > self.keep:
            self._snaps.popitem(last=False)

    def latest(self) -> Snapshot | None:
        return next(reversed(self._snaps.values()), None)

    def get(self, version: int) -> Snapshot | None:
        return self._snaps.get(version)


class ChunkServer:
    def __init__(self, sock: zmq.asyncio.Socket, store: SnapshotStore, max_bytes: int):
        self.sock = sock
        self.store = store
        self.max_bytes = max_bytes
        self.rejected: dict[str, int] = {}

    async def serve_forever(self) -> None:
        while True:
            ident, *frames = await self.sock.recv_multipart(copy=True)
            try:
                await self.handle(ident, frames)
            except zmq.ZMQError as exc:
                # EHOSTUNREACH: the requester closed its socket (left, restarted, gave up on
                # this fetch). Its loss, not ours: keep serving everyone else.
                self.rejected["peer_gone"] = self.rejected.get("peer_gone", 0) + 1
                log.info("snapshot socket: could not reply to %s: %s", ident.hex(), exc)

    async def handle(self, ident: bytes, frames: list[bytes]) -> None:
        try:
            if len(frames) != 1:
                raise wire.WireError("malformed", f"{len(frames)} frames, expected 1")
            msg = wire.decode(frames[0], self.max_bytes)
            if not isinstance(msg, wire.ChunkRequest):
                raise wire.WireError("unknown_type", f"{msg.type} sent to the snapshot socket")
        except wire.WireError as err:
            self.rejected[err.reason] = self.rejected.get(err.reason, 0) + 1
            log.warning("snapshot socket: rejected message from %s: %s", ident.hex(), err)
            await self.sock.send_multipart(
                [ident, wire.encode(wire.Error(reason=err.reason, detail=err.detail))])
            return
        snap = self.store.get(msg.version)
        if snap is None or msg.index >= len(snap.manifest["chunk_hashes"]):
            detail = f"version {msg.version} chunk {msg.index} is not held here"
            await self.sock.send_multipart([ident, wire.encode(
                wire.Error(reason="unknown_version", detail=detail, rid=msg.rid))])
            return
        data = snap.chunk(msg.index)
        self.store.bytes_sent += len(data)
        header = wire.encode(wire.Chunk(version=msg.version, index=msg.index, rid=msg.rid))
        await self.sock.send_multipart([ident, header, data], copy=False)
