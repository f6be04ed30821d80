"""Checks a corruption report before anyone is punished for it (docs/security.md).

A worker that says "relay R sent me a corrupt chunk" may be right, or may be lying to get an
honest relay banned. The learner finds out itself: it fetches that chunk from R, as a child
would (a fresh key each time, with a ticket minted for it, so R cannot tell the learner from a
child), and checks it against the manifest. The verdict goes to a callback: ``corrupt`` (R is
banned and never relays again), ``intact`` (the reporter gets a strike; ``security.false_reports``
strikes ban it) or ``unreachable`` (no verdict; R is routed around as a dead relay would be).

Reports wait in a bounded queue (``QUEUE`` entries; when full, a report is dropped and counted:
the reporter was already routed around R, so nothing is lost but the verdict).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.asyncio

from broadcast.fetch import REQUEST_BYTES
from broadcast.snapshot import SnapshotError, chunk_range, verify_chunk
from echo import wire
from echo.security import KeyPair, curve_client

log = logging.getLogger("echo.verify")

QUEUE = 16
TIMEOUT_S = 10.0

Verdict = Callable[[str, str, str, str], None]  # (endpoint, accused key, accuser key, outcome)
Mint = Callable[[str, str], bytes]  # (child key, parent endpoint) -> ticket


@dataclass
class Report:
    endpoint: str
    accused: str
    accuser: str
    manifest: dict[str, Any]
    chunk: int


class Verifier:
    def __init__(self, ctx: zmq.asyncio.Context, mint: Mint, max_bytes: int):
        self.ctx = ctx
        self.mint = mint
        self.max_bytes = max_bytes
        self.queue: asyncio.Queue[Report] = asyncio.Queue(QUEUE)
        self.outcomes: dict[str, int] = {}

    def submit(self, endpoint: str, accused: str, accuser: str, manifest: dict[str, Any],
               chunk: int) -> bool:
        try:
            self.queue.put_nowait(Report(endpoint, accused, accuser, manifest, chunk))
            return True
        except asyncio.QueueFull:
            return False

    async def serve_forever(self, verdict: Verdict) -> None:
        while True:
            r = await self.queue.get()
            outcome = await self.check(r)
            self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1
            verdict(r.endpoint, r.accused, r.accuser, outcome)

    async def check(self, r: Report) -> str:
        keys = KeyPair.generate()
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, int(r.manifest["chunk_size"]) + REQUEST_BYTES)
        curve_client(sock, keys, r.accused.encode())
        sock.connect(r.endpoint)
        try:
            req = wire.ChunkRequest(version=r.manifest["version"], index=r.chunk, rid=1,
                                    ticket=self.mint(keys.text, r.endpoint),
                                    form=r.manifest.get("form", "payload"))
            await sock.send(wire.encode(req))
            async with asyncio.timeout(TIMEOUT_S):
                frames = await sock.recv_multipart()
        except (TimeoutError, zmq.ZMQError):
            return "unreachable"
        finally:
            sock.close(linger=0)
        return self._judge(r, frames)

    def _judge(self, r: Report, frames: list[bytes]) -> str:
        try:
            head = wire.decode(frames[0], self.max_bytes)
        except Exception:  # any bytes the relay sends are evidence, not a crash
            return "corrupt"
        if isinstance(head, wire.Error):
            return "unreachable"  # it no longer holds that version: no verdict
        start, end = chunk_range(r.manifest, r.chunk)
        if not isinstance(head, wire.Chunk) or len(frames) != 2 or len(frames[1]) != end - start:
            return "corrupt"
        try:
            verify_chunk(r.manifest, r.chunk, frames[1])
        except SnapshotError:
            return "corrupt"
        return "intact"
