"""Test doubles for the broadcast: a relay that alters every chunk it serves.

Production classes carry no test switches; integrity tests and the broadcast benchmark's
``--corrupt-relays`` use these subclasses instead, through the one seam each class shows
(``ChunkServer.outgoing``, ``Relay.server_class``).
"""

from __future__ import annotations

from broadcast.relay import Relay
from broadcast.source import ChunkServer
from broadcast.store import SnapshotBuffer


class CorruptingChunkServer(ChunkServer):
    """Flips one byte in the middle of every chunk it sends: the receiver's BLAKE3 check
    against the signed manifest must catch it."""

    def outgoing(self, buf: SnapshotBuffer, index: int) -> memoryview | bytes:
        data = bytearray(super().outgoing(buf, index))
        data[len(data) // 2] ^= 0xFF
        return bytes(data)


class CorruptingRelay(Relay):
    """A relay whose chunk server corrupts everything it forwards."""

    server_class = CorruptingChunkServer
