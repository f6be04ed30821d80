"""The learner's own probe of a relay that a child reported (docs/security.md, "Relay reports").

A worker that says "relay R sent me a corrupt chunk" or "R timed out" may be right, or may be
lying to get an honest relay removed. The learner looks itself: it fetches from R as a child
resuming at the reported chunk would (a fresh key; a ticket minted for it with the children's
lifetime, ``security.ticket_ttl_s``; ``broadcast.window`` requests from that chunk on, with
request ids drawn as a child process draws them) and checks what comes back against the
manifest. The verdict goes to a callback: ``corrupt`` (the learner saw it: R is banned and
never relays again), ``intact`` (no verdict on anyone: R may serve probes well and children
badly, so the reporter is not punished either), ``answered`` (R replied with an error, e.g.
it no longer holds that version: no verdict) or ``unreachable`` (R is taken out of the plan
for a while, then probed again).

Reports wait in a bounded queue (``QUEUE`` entries; when full, a report is dropped and counted:
the reporter was already routed around R, so nothing is lost but the verdict).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

import zmq
import zmq.asyncio

from broadcast.fetch import REQUEST_BYTES, _rids
from broadcast.manifest import ChunkLayout, SnapshotError
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
    layout: ChunkLayout  # of the payload probed: a version's, a keyframe's or a base model's
    chunk: int


class Verifier:
    def __init__(self, ctx: zmq.asyncio.Context, mint: Mint, max_bytes: int, window: int = 4):
        self.window = window
        self.ctx = ctx
        self.mint = mint
        self.max_bytes = max_bytes
        self.queue: asyncio.Queue[Report] = asyncio.Queue(QUEUE)
        self.outcomes: dict[str, int] = {}

    def submit(
        self, endpoint: str, accused: str, accuser: str, layout: ChunkLayout, chunk: int
    ) -> bool:
        try:
            self.queue.put_nowait(Report(endpoint, accused, accuser, layout, chunk))
            return True
        except asyncio.QueueFull:
            return False

    async def serve_forever(self, verdict: Verdict) -> None:
        while True:
            r = await self.queue.get()
            try:
                outcome = await self.check(r)
            except Exception:  # a bug here must not end the learner server: no verdict
                log.exception("probe of %s failed", r.endpoint)
                outcome = "answered"
            self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1
            verdict(r.endpoint, r.accused, r.accuser, outcome)

    async def check(self, r: Report) -> str:
        keys = KeyPair.generate()
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, r.layout.chunk_size + REQUEST_BYTES)
        curve_client(sock, keys, r.accused.encode())
        sock.connect(r.endpoint)
        total = r.layout.num_chunks
        indices = list(range(r.chunk, min(total, r.chunk + self.window)))
        ticket = self.mint(keys.text, r.endpoint)
        replies: list[list[bytes]] = []
        try:
            for index in indices:  # a window of requests, as a child resuming there sends
                await sock.send(
                    wire.encode(
                        wire.ChunkRequest(
                            version=r.layout.version,
                            index=index,
                            rid=next(_rids),
                            ticket=ticket,
                            form=r.layout.form,
                        )
                    )
                )
            async with asyncio.timeout(TIMEOUT_S):
                for _ in indices:
                    replies.append(await sock.recv_multipart())
        except (TimeoutError, zmq.ZMQError):
            if not replies:
                return "unreachable"
        finally:
            sock.close(linger=0)
        verdicts = [self._judge(r, frames) for frames in replies]
        return "corrupt" if "corrupt" in verdicts else verdicts[0]

    def _judge(self, r: Report, frames: list[bytes]) -> str:
        try:
            head = wire.decode(frames[0], self.max_bytes)
        except Exception:  # any bytes the relay sends are evidence, not a crash
            return "corrupt"
        if isinstance(head, wire.Error):
            return "answered"  # it answered without the chunk (e.g. a superseded version)
        index = getattr(head, "index", -1)
        if not isinstance(head, wire.Chunk) or not 0 <= index < r.layout.num_chunks:
            return "corrupt"
        start, end = r.layout.chunk_range(index)
        if len(frames) != 2 or len(frames[1]) != end - start:
            return "corrupt"
        try:
            r.layout.verify_chunk(index, frames[1])
        except SnapshotError:
            return "corrupt"
        return "intact"
