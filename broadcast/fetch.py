"""Pulls a whole snapshot from one source, a window of chunk requests in flight.

Every chunk is checked against the manifest's BLAKE3 hash before it is written into the
pre-allocated payload; a bad chunk aborts the fetch with ``SnapshotError`` (nothing corrupt
is ever installed). Replies to earlier, abandoned requests are recognised by ``rid`` and ignored.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import zmq.asyncio

from broadcast.snapshot import SnapshotError, chunk_range, num_chunks, verify_chunk
from echo import wire

_rids = itertools.count(1)


async def fetch_snapshot(sock: zmq.asyncio.Socket, manifest: dict[str, Any], *, window: int,
                         timeout_s: float, max_bytes: int) -> bytearray:
    total = num_chunks(manifest)
    payload = bytearray(manifest["payload_size"])
    pending: dict[int, int] = {}  # rid -> chunk index
    next_index = 0
    done = 0

    async def request(index: int) -> None:
        rid = next(_rids)
        pending[rid] = index
        await sock.send(wire.encode(wire.ChunkRequest(version=manifest["version"], index=index, rid=rid)))

    while next_index < min(window, total):
        await request(next_index)
        next_index += 1
    while done < total:
        try:
            frames = await asyncio.wait_for(sock.recv_multipart(), timeout_s)
        except TimeoutError:
            raise SnapshotError(f"no chunk within {timeout_s}s fetching version "
                                f"{manifest['version']} ({done}/{total} chunks)") from None
        msg = wire.decode(frames[0], max_bytes)
        index = pending.pop(msg.rid, None)
        if index is None:
            continue  # a late reply to an abandoned request
        if isinstance(msg, wire.Error):
            raise SnapshotError(f"source refused chunk {index}: {msg.reason} ({msg.detail})")
        if len(frames) != 2 or not isinstance(msg, wire.Chunk) or msg.index != index:
            raise SnapshotError(f"bad chunk reply for chunk {index}")
        verify_chunk(manifest, index, frames[1])
        start, end = chunk_range(manifest, index)
        payload[start:end] = frames[1]
        done += 1
        if next_index < total:
            await request(next_index)
            next_index += 1
    return payload
