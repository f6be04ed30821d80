"""Test doubles: a relay that alters every chunk it serves, a write-ahead log on a slow disk.

Production classes carry no test switches; integrity tests and the broadcast benchmark's
``--corrupt-relays`` use these subclasses instead, through the one seam each class shows
(``ChunkServer.outgoing``, ``Relay.server_class``, ``BufferLog._sync``).
"""

from __future__ import annotations

import time
from pathlib import Path

from echo_rl.broadcast.coordinator import Coordinator
from echo_rl.broadcast.relay import Relay
from echo_rl.broadcast.source import ChunkServer
from echo_rl.broadcast.store import SnapshotBuffer
from echo_rl.data.durable import BufferLog


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


class SlowDiskLog(BufferLog):
    """The learner's write-ahead log on a disk whose every fsync takes ``delay_s`` longer: what
    the control plane's load test and the group-commit tests run against."""

    def __init__(self, path: Path, fsync: bool = True, delay_s: float = 0.0):
        self.delay_s = delay_s  # before the writer thread starts in BufferLog.__init__
        super().__init__(path, fsync=fsync)

    def _sync(self) -> None:
        time.sleep(self.delay_s)
        super()._sync()


class DeclaredRatesCoordinator(Coordinator):
    """Plans on the rates workers declare, never on what they measured: the behaviour before
    link measurement, kept as the liar benchmark's baseline (one worker overstates its uplink)."""

    def rates(self) -> dict[str, tuple[float, float]]:
        return {p.worker_id: (p.down_mbit, p.up_mbit) for p in self.peers.values() if p.alive}
