"""Link shaping in user space, for tests and benchmarks (docs/design.md §5).

A link is a token bucket (rate, burst) followed by a delay line (fixed latency). The sender
spends its bucket's credit and hands the message to the delay line; the receiver gets it
``latency`` later. Latency therefore never blocks the sender's bucket: a link keeps
``rate * latency`` bytes in flight like a real pipe, instead of stalling per message.

The bucket holds two chunks by default: the prototype measured that a bucket holding a single
chunk loses ~3% of the rate (credit that accrues while the sender is busy elsewhere overflows
and is lost); two chunks keep that credit.

Clock and sleep are injectable so the arithmetic is tested in virtual time, without real sleeps.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from echo_rl.broadcast.planner import DEFAULT_CHUNK_BYTES, mbit_to_bytes_per_s
from echo_rl.core import rates

Clock = Callable[[], float]
Sleep = Callable[[float], Awaitable[None]]
T = TypeVar("T")


class TokenBucket(rates.TokenBucket):
    """Grants bytes at ``rate_bytes_per_s`` with bursts of at most ``burst_bytes``.

    ``consume(n)`` reserves n bytes at once (the credit may go negative: that is the queue of
    earlier reservations) and sleeps until the debt is repaid, so concurrent senders are served
    in call order and a message larger than the bucket still passes, at the bucket's rate. Over
    any interval T the bucket grants at most ``burst + rate * T`` bytes.
    """

    def __init__(
        self,
        rate_bytes_per_s: float,
        burst_bytes: int | None = None,
        *,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        clock: Clock = time.monotonic,
        sleep: Sleep = asyncio.sleep,
    ):
        if not rate_bytes_per_s > 0:
            raise ValueError(
                f"rate must be > 0 bytes/s (math.inf: unshaped), got {rate_bytes_per_s}"
            )
        burst = float(burst_bytes if burst_bytes is not None else 2 * chunk_bytes)
        if burst <= 0:
            raise ValueError(f"burst must be > 0 bytes, got {burst_bytes}")
        super().__init__(rate_bytes_per_s, burst, clock)
        self._sleep = sleep
        self.granted = 0  # bytes handed out, for benchmarks

    def try_consume(self, n: int) -> bool:
        """Take n bytes only if the credit is there now (never queues)."""
        if n < 0:
            raise ValueError(f"cannot consume {n} bytes")
        if not self.take(n):
            return False
        self.granted += n
        return True

    async def consume(self, n: int) -> float:
        """Wait until n bytes of credit are ours; returns the seconds waited. If cancelled while
        waiting, the reservation is given back (the bytes were never sent)."""
        if n < 0:
            raise ValueError(f"cannot consume {n} bytes")
        wait = self.reserve(n)
        if wait > 0:
            try:
                await self._sleep(wait)
            except asyncio.CancelledError:
                self.give_back(n)
                raise
        self.granted += n
        return wait


class DelayLine(Generic[T]):
    """FIFO whose items come out ``latency_s`` after they went in. ``put`` never blocks, so the
    sender is never held up by latency (only by its bucket)."""

    def __init__(
        self, latency_s: float, *, clock: Clock = time.monotonic, sleep: Sleep = asyncio.sleep
    ):
        if latency_s < 0:
            raise ValueError(f"latency must be >= 0, got {latency_s}")
        self.latency_s = latency_s
        self._clock = clock
        self._sleep = sleep
        self._items: deque[tuple[float, T]] = deque()
        self._arrived = asyncio.Event()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, item: T) -> None:
        self._items.append((self._clock() + self.latency_s, item))
        self._arrived.set()

    async def get(self) -> T:
        while not self._items:
            self._arrived.clear()
            await self._arrived.wait()
        due, _ = self._items[0]
        delay = due - self._clock()
        if delay > 0:
            await self._sleep(delay)
        return self._items.popleft()[1]


@dataclass(frozen=True)
class LinkShape:
    """One direction of a link: ``rate_mbit`` (decimal Mbit/s; math.inf: unshaped), a bucket of
    ``burst_bytes`` (None: two chunks) and ``latency_ms`` added per message."""

    rate_mbit: float
    burst_bytes: int | None = None
    latency_ms: float = 0.0

    @property
    def rate_bytes_per_s(self) -> float:
        return mbit_to_bytes_per_s(self.rate_mbit)

    @property
    def latency_s(self) -> float:
        return self.latency_ms / 1000.0

    def bucket(
        self,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        *,
        clock: Clock = time.monotonic,
        sleep: Sleep = asyncio.sleep,
    ) -> TokenBucket:
        return TokenBucket(
            self.rate_bytes_per_s,
            self.burst_bytes,
            chunk_bytes=chunk_bytes,
            clock=clock,
            sleep=sleep,
        )

    def link(
        self,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        *,
        clock: Clock = time.monotonic,
        sleep: Sleep = asyncio.sleep,
    ) -> ShapedLink:
        return ShapedLink(self, chunk_bytes, clock=clock, sleep=sleep)


Message = bytes | bytearray | memoryview | Sequence[bytes | bytearray | memoryview]


def message_size(msg: Message) -> int:
    """Bytes a message costs on the link: its length, or the sum over its frames."""
    if isinstance(msg, (bytes, bytearray, memoryview)):
        return memoryview(msg).nbytes
    return sum(memoryview(f).nbytes for f in msg)


class ShapedLink:
    """Bucket then delay line: ``await send(msg)`` returns once the bucket granted the bytes;
    ``await recv()`` returns the next message ``latency`` after it was sent."""

    def __init__(
        self,
        shape: LinkShape,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        *,
        clock: Clock = time.monotonic,
        sleep: Sleep = asyncio.sleep,
    ):
        self.shape = shape
        self.bucket = shape.bucket(chunk_bytes, clock=clock, sleep=sleep)
        self.line: DelayLine[Message] = DelayLine(shape.latency_s, clock=clock, sleep=sleep)

    async def send(self, msg: Message) -> None:
        await self.bucket.consume(message_size(msg))
        self.line.put(msg)

    async def recv(self) -> Message:
        return await self.line.get()
