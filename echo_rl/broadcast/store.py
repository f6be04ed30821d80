"""Snapshots held by a node, complete (the learner) or arriving chunk by chunk (a relay).

A relay serves a chunk the moment it has verified it: ``put`` marks the chunk held and calls
the listeners (the chunk server releases requests it parked for that chunk). The payload
buffer is allocated once per version and received into; chunks are served as slices of it,
never copied. Only the newest ``keep`` versions are held.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable

import blake3

from echo_rl.broadcast.base_manifest import BaseManifest
from echo_rl.broadcast.manifest import ChunkLayout, Manifest
from echo_rl.core.layout import Payload
from echo_rl.core.spill import drop_pages

Listener = Callable[[int, int], None]  # (version, chunk index)


class SnapshotBuffer:
    def __init__(
        self,
        what: Manifest | BaseManifest | ChunkLayout,
        payload: Payload | None = None,
        *,
        storage: bytearray | None = None,
    ):
        """``what``: a version's manifest (its payload), a base model's, or a layout (a
        keyframe's rebuilt payload). ``payload``: a complete snapshot (the learner, or bytes
        kept whole: bytes, a bytearray or a spilled map); else chunks arrive into ``storage``
        (a recycled buffer of the right size) or a fresh one."""
        self.layout = what if isinstance(what, ChunkLayout) else what.layout
        # the signed manifest a learner sends for this version (None: a base or a keyframe)
        self.manifest = what if isinstance(what, Manifest) else None
        self.version = self.layout.version
        self.total = self.layout.num_chunks
        self.payload: Payload
        if payload is None:
            size = self.layout.payload_size
            self.payload = (
                storage if storage is not None and len(storage) == size else bytearray(size)
            )
            self.have = bytearray(self.total)
            self.count = 0
        else:
            self.payload = payload
            self.have = bytearray(b"\x01" * self.total)
            self.count = self.total
        self.view = memoryview(self.payload)
        self.complete = asyncio.Event() if self.count < self.total else None

    @property
    def done(self) -> bool:
        return self.count == self.total

    def chunk(self, index: int) -> memoryview:
        start, end = self.layout.chunk_range(index)
        return self.view[start:end]

    def sent(self, index: int) -> None:
        """Chunk ``index`` went out: a spilled payload's pages of it leave the resident set
        (echo_rl.core.spill.drop_pages), so serving a version does not pull the whole file in."""
        if not isinstance(self.payload, (bytes, bytearray)):
            start, end = self.layout.chunk_range(index)
            drop_pages(self.payload, start, end)

    def put(self, index: int, data: bytes | memoryview) -> bool:
        """Store a verified chunk; False if it was already held."""
        if self.have[index]:
            return False
        start, end = self.layout.chunk_range(index)
        self.view[start:end] = data
        return self.mark(index)

    def mark(self, index: int) -> bool:
        """The chunk's bytes are already in place (received into the buffer) and verified."""
        if self.have[index]:
            return False
        self.have[index] = 1
        self.count += 1
        if self.done and self.complete is not None:
            self.complete.set()
        return True

    def missing(self) -> list[int]:
        return [i for i in range(self.total) if not self.have[i]]

    def digest(self) -> bytes:
        """BLAKE3 of the whole payload (all cores): the end-to-end check of an install."""
        digest: bytes = blake3.blake3(self.view, max_threads=blake3.blake3.AUTO).digest()
        return digest


class SnapshotStore:
    def __init__(self, keep: int = 2, recycle: bool = True):
        """``recycle``: reuse an evicted version's buffer for a later one (False where the
        payloads are not receive buffers)."""
        self.keep = keep
        self.recycle = recycle
        self._bufs: OrderedDict[int, SnapshotBuffer] = OrderedDict()
        self.listeners: list[Listener] = []
        self.bytes_sent = 0
        self._free: list[bytearray] = []  # recycled receive buffers

    def reserve(self, nbytes: int, count: int = 1) -> None:
        """Allocate and touch ``count`` receive buffers ahead of time: allocating (and faulting
        in) hundreds of MiB when a notice arrives would delay the first chunk request (16
        relays on 2 cores: 1 s for 64 MiB each)."""
        while sum(len(b) == nbytes for b in self._free) < count:
            self._free.append(bytearray(nbytes))

    def storage_for(self, layout: ChunkLayout) -> bytearray | None:
        """A recycled buffer for the version about to be added. The version that add would
        evict goes first, so its buffer takes the new chunks (evicted after the allocation,
        each publication allocated and faulted in a fresh buffer)."""
        size = layout.payload_size
        if layout.version not in self._bufs:
            while len(self._bufs) >= self.keep:
                self._evict()
        for i, b in enumerate(self._free):
            if len(b) == size:
                return self._free.pop(i)
        return None

    def add(self, buf: SnapshotBuffer) -> SnapshotBuffer:
        self._bufs[buf.version] = buf
        self._bufs.move_to_end(buf.version)
        while len(self._bufs) > self.keep:
            self._evict()
        if buf.done:
            for i in range(buf.total):
                self._notify(buf.version, i)
        return buf

    def _evict(self) -> None:
        # An evicted version is ``keep`` publications old: no send of it is still in flight,
        # so its buffer can take the next version's chunks.
        old = self._bufs.popitem(last=False)[1]
        if self.recycle and isinstance(old.payload, bytearray) and len(self._free) < 2:
            self._free.append(old.payload)

    def holds(self, payload: object) -> bool:
        """Is this object one of this store's payload buffers (held or recyclable)?"""
        return any(b.payload is payload for b in self._bufs.values()) or any(
            f is payload for f in self._free
        )

    def clear(self) -> None:
        self._bufs.clear()

    def swap_payload(self, old: Payload, new: Payload) -> bool:
        """A complete version's payload ``old`` replaced by ``new`` (the same bytes: a
        spilled copy); its chunks are served from ``new``. False when no held version has it."""
        for buf in self._bufs.values():
            if buf.payload is old and buf.done and len(new) == len(old):
                buf.payload, buf.view = new, memoryview(new)
                return True
        return False

    def buffers(self) -> list[SnapshotBuffer]:
        """The versions held, oldest first."""
        return list(self._bufs.values())

    def get(self, version: int) -> SnapshotBuffer | None:
        return self._bufs.get(version)

    def latest(self) -> SnapshotBuffer | None:
        return next(reversed(self._bufs.values()), None)

    @property
    def newest_version(self) -> int:
        return max(self._bufs, default=-1)

    def put(self, version: int, index: int, data: bytes | memoryview) -> None:
        buf = self._bufs.get(version)
        if buf is not None and buf.put(index, data):
            self._notify(version, index)

    def mark(self, version: int, index: int) -> None:
        buf = self._bufs.get(version)
        if buf is not None and buf.mark(index):
            self._notify(version, index)

    def _notify(self, version: int, index: int) -> None:
        for listener in self.listeners:
            listener(version, index)
