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

from echo_rl.broadcast.fetch import REQUEST_BYTES, _rids
from echo_rl.broadcast.manifest import ChunkLayout, SnapshotError
from echo_rl.core import wire
from echo_rl.core.security import KeyPair, curve_client

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
    # Other versions asked for beside it, one chunk each (a timeout's probe): at ten versions
    # a second a relay holds two, and which two the learner cannot know. One it does not hold
    # is refused at once ("answered"); one it holds and never serves is a black hole.
    alternates: tuple[ChunkLayout, ...] = ()


class Verifier:
    def __init__(self, ctx: zmq.asyncio.Context, mint: Mint, max_bytes: int, window: int = 4):
        self.window = window
        self.ctx = ctx
        self.mint = mint
        self.max_bytes = max_bytes
        self.queue: asyncio.Queue[Report] = asyncio.Queue(QUEUE)
        self.outcomes: dict[str, int] = {}

    def submit(
        self,
        endpoint: str,
        accused: str,
        accuser: str,
        layout: ChunkLayout,
        chunk: int,
        alternates: tuple[ChunkLayout, ...] = (),
    ) -> bool:
        try:
            self.queue.put_nowait(Report(endpoint, accused, accuser, layout, chunk, alternates))
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
        """``corrupt`` if any reply fails its hash, else ``intact`` if any chunk came;
        ``unreachable`` if some request got no answer at all within ``TIMEOUT_S`` (silence, or a
        version it holds and never served: a relay refuses one it does not hold at once), else
        ``answered`` (every request refused)."""
        keys = KeyPair.generate()
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        largest = max(lay.chunk_size for lay in (r.layout, *r.alternates))
        sock.setsockopt(zmq.MAXMSGSIZE, largest + REQUEST_BYTES)
        curve_client(sock, keys, r.accused.encode())
        sock.connect(r.endpoint)
        total = r.layout.num_chunks
        asks = [(r.layout, i) for i in range(r.chunk, min(total, r.chunk + self.window))]
        asks += [(lay, min(r.chunk, lay.num_chunks - 1)) for lay in r.alternates]
        ticket = self.mint(keys.text, r.endpoint)
        asked: dict[int, tuple[ChunkLayout, int]] = {}
        replies: list[list[bytes]] = []
        try:
            for lay, index in asks:  # a window of requests, as a child resuming there sends
                rid = next(_rids)
                asked[rid] = (lay, index)
                await sock.send(
                    wire.encode(
                        wire.ChunkRequest(
                            version=lay.version, index=index, rid=rid, ticket=ticket, form=lay.form
                        )
                    )
                )
            async with asyncio.timeout(TIMEOUT_S):
                for _ in asks:
                    replies.append(await sock.recv_multipart())
        except (TimeoutError, zmq.ZMQError):
            pass
        finally:
            sock.close(linger=0)
        verdicts = [self._judge(asked, frames) for frames in replies]
        for outcome in ("corrupt", "intact"):
            if outcome in verdicts:
                return outcome
        return "unreachable" if len(replies) < len(asks) else "answered"

    def _judge(self, asked: dict[int, tuple[ChunkLayout, int]], frames: list[bytes]) -> str:
        try:
            head = wire.decode(frames[0], self.max_bytes)
        except Exception:  # any bytes the relay sends are evidence, not a crash
            return "corrupt"
        if isinstance(head, wire.Error):
            return "answered"  # it answered without the chunk (e.g. a superseded version)
        lay, index = asked.get(getattr(head, "rid", -1), (None, -1))
        if (
            lay is None
            or not isinstance(head, wire.Chunk)
            or (head.version, head.index) != (lay.version, index)
        ):
            return "corrupt"
        start, end = lay.chunk_range(index)
        if len(frames) != 2 or len(frames[1]) != end - start:
            return "corrupt"
        try:
            lay.verify_chunk(index, frames[1])
        except SnapshotError:
            return "corrupt"
        return "intact"
