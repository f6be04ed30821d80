"""A fetch's chunk checks, hashed on a thread of their own while the next chunks arrive.

A relay's event loop receives a chunk into its place in the payload, hands its BLAKE3 to the
hashing thread (BLAKE3 releases the GIL) and goes back to the socket; the chunk counts as held,
and so is served on or installed, only once its hash matched the signed manifest
(``SnapshotStore.mark`` runs on the loop when the check completes). On a host with a core for
each, receiving and hashing no longer wait on each other: before, the loop's thread did both and
was a relay's busiest stage (docs/broadcast.md, "A relay's CPU"; ``benchmarks/relay_cpu.py``).

Chunks under ``THREAD_MIN_BYTES`` are checked inline: handing one to the thread costs tens of
microseconds, as much as hashing it. So is every chunk on a host of two cores or fewer
(``THREADED``): there the relay's threads already share the cores, the hand-offs only add
work, and a 4-hop chain on this repository's 2-core VM moved 3-6 % fewer MB/s with the thread
(``benchmarks/relay_cpu.py``, two alternating pairs against the inline check). One thread per process, in order: checks of several
fetches queue behind each other, bounded by their request windows.

A slot is never re-requested while its check runs: ``settle`` waits for every running check
before a fetch returns or fails over (a check finishing on bytes a new source is overwriting
could otherwise mark a chunk held whose bytes then changed).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from echo_rl.broadcast.manifest import SnapshotError, chunk_hash
from echo_rl.broadcast.store import SnapshotBuffer, SnapshotStore

OnHeld = Callable[[int, int], None]  # (chunk index, its bytes): the chunk verified and is held
THREAD_MIN_BYTES = 256 << 10
THREADED = (os.cpu_count() or 1) > 2
_hasher = ThreadPoolExecutor(1, thread_name_prefix="echo-blake3")


class ChunkChecks:
    def __init__(self, buf: SnapshotBuffer, store: SnapshotStore, on_held: OnHeld):
        """``on_held(index, nbytes)``: called on the loop for each chunk that verified, after
        it is marked held in ``store``."""
        self.buf, self.store, self.on_held = buf, store, on_held
        self.running: set[asyncio.Future[bytes]] = set()
        self.failed: tuple[int, str] | None = None  # the first chunk that failed, and why

    def submit(self, index: int, data: memoryview) -> None:
        """Check chunk ``index`` (its bytes are in place in the payload, ``data``)."""
        if not THREADED or len(data) < THREAD_MIN_BYTES:
            self._finish(index, len(data), chunk_hash(data))
            return
        fut = asyncio.get_running_loop().run_in_executor(_hasher, chunk_hash, data)
        self.running.add(fut)
        fut.add_done_callback(lambda f: self._completed(f, index, len(data)))

    def _completed(self, fut: asyncio.Future[bytes], index: int, nbytes: int) -> None:
        self.running.discard(fut)
        if fut.cancelled():
            return
        exc = fut.exception()
        if exc is not None:  # not a peer's doing (the payload buffer changed under it): said
            self._fail(index, f"chunk {index} could not be hashed: {exc!r}")
            return
        self._finish(index, nbytes, fut.result())

    def _finish(self, index: int, nbytes: int, digest: bytes) -> None:
        try:
            self.buf.layout.check_digest(index, digest)
        except SnapshotError as err:
            self._fail(index, str(err))
            return
        self.store.mark(self.buf.version, index)
        self.on_held(index, nbytes)

    def _fail(self, index: int, why: str) -> None:
        if self.failed is None:
            self.failed = (index, why)

    async def wait(self, timeout_s: float) -> None:
        """Until at least one running check completes (or ``timeout_s``)."""
        if self.running:
            await asyncio.wait(set(self.running), timeout=timeout_s)

    async def settle(self) -> None:
        """Until no check is running (each marks its chunk, or records its failure)."""
        while self.running:
            await asyncio.wait(set(self.running))
