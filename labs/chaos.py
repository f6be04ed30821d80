"""A misbehaving wide-area link: a TCP proxy that delays, stalls and cuts connections.

    python -m labs.chaos --target HOST:PORT [--listen 127.0.0.1:0] [--latency-ms 40]
        [--reset-every-s 2] [--stall-every-s 5 --stall-s 1.5] [--seed 0] [--stats FILE]

Put it between workers and the learner (workers join the proxy's address) to see what the
system does when the wide area misbehaves; the integration tests do exactly that. This machine's
``tc`` has no netem, so the faults are made here, in the application:

* **latency**: every byte is forwarded ``latency`` after it arrived, in order, in both
  directions (a delay line per direction; the sender is not blocked, as on a real long pipe);
* **resets**: at exponentially distributed intervals (mean ``reset_every_s``) one live
  connection, chosen at random, is aborted with a TCP RST on both sides: whatever was in
  flight is lost, as when a NAT forgets a mapping or a route flaps;
* **stalls**: at exponentially distributed intervals (mean ``stall_every_s``) all forwarding
  stops for ``stall_s`` (a black hole; connections stay open, bytes queue up).

Each direction's delay line holds at most ``QUEUE_CHUNKS`` reads; when it is full the proxy
stops reading that side, so TCP flow control pushes back on the sender (nothing is dropped
except by a reset). Prints ``ECHO_CHAOS_READY <port>`` once listening; on SIGTERM or SIGINT it
writes its counters (connections, resets, stalls, bytes each way) to ``--stats`` and exits.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import signal
import socket
import struct
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

READY_PREFIX = "ECHO_CHAOS_READY "
READ_BYTES = 64 * 1024
QUEUE_CHUNKS = 64  # per direction: 4 MiB at most in a delay line


@dataclass
class ChaosConfig:
    latency_s: float = 0.0
    reset_every_s: float = 0.0  # mean interval between resets; 0 = never
    stall_every_s: float = 0.0  # mean interval between stalls; 0 = never
    stall_s: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("latency_s", "reset_every_s", "stall_every_s", "stall_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} = {getattr(self, name)} is negative: use 0 or more")


@dataclass
class ChaosStats:
    connections: int = 0
    resets: int = 0
    stalls: int = 0
    broken: int = 0  # links that ended in a connection error (our resets, or a peer's)
    bytes: dict[str, int] = field(default_factory=lambda: {"up": 0, "down": 0})


class _Link:
    """One proxied connection: client <-> proxy <-> target."""

    def __init__(self, client: asyncio.StreamWriter, target: asyncio.StreamWriter):
        self.writers = (client, target)

    def abort(self) -> None:
        """Both sides cut with an RST. A side already closed (the link ended a moment ago and
        its handler has not yet taken it off the list) is left alone: setting SO_LINGER on its
        closed socket raised EBADF, which ended the whole proxy (a CI run's exit 1)."""
        for w in self.writers:
            if w.transport.is_closing():
                continue
            sock = w.get_extra_info("socket")
            if sock is not None:  # SO_LINGER 0: close() sends RST instead of FIN
                try:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                except OSError:  # closed under us: nothing left to reset
                    pass
            w.transport.abort()


class ChaosProxy:
    def __init__(self, target_host: str, target_port: int, cfg: ChaosConfig):
        self.target = (target_host, target_port)
        self.cfg = cfg
        self.stats = ChaosStats()
        self.rng = random.Random(cfg.seed)
        self.links: set[_Link] = set()
        self.flowing = asyncio.Event()
        self.flowing.set()
        self._server: asyncio.base_events.Server | None = None

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        self._server = await asyncio.start_server(self._handle, host, port)
        return self._server.sockets[0].getsockname()[1]

    async def run_faults(self) -> None:
        """The reset and stall schedules (until cancelled)."""
        async with asyncio.TaskGroup() as tg:
            if self.cfg.reset_every_s > 0:
                tg.create_task(self._resets())
            if self.cfg.stall_every_s > 0:
                tg.create_task(self._stalls())

    def reset_one(self) -> bool:
        if not self.links:
            return False
        link = self.rng.choice(sorted(self.links, key=id))
        self.links.discard(link)
        link.abort()
        self.stats.resets += 1
        return True

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for link in list(self.links):
            link.abort()
        self.links.clear()

    async def _resets(self) -> None:
        while True:
            await asyncio.sleep(self.rng.expovariate(1 / self.cfg.reset_every_s))
            self.reset_one()

    async def _stalls(self) -> None:
        while True:
            await asyncio.sleep(self.rng.expovariate(1 / self.cfg.stall_every_s))
            self.stats.stalls += 1
            self.flowing.clear()
            await asyncio.sleep(self.cfg.stall_s)
            self.flowing.set()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            t_reader, t_writer = await asyncio.open_connection(*self.target)
        except OSError as exc:
            log.info("chaos: target %s:%d refused: %s", *self.target, exc)
            writer.transport.abort()
            return
        self.stats.connections += 1
        link = _Link(writer, t_writer)
        self.links.add(link)
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self._direction(reader, t_writer, "up", link))
                tg.create_task(self._direction(t_reader, writer, "down", link))
        except* (ConnectionError, OSError) as errors:
            # a reset (ours or a peer's): the link is gone and both sides see it; counted
            self.stats.broken += 1
            log.debug("chaos: link ended: %s", errors.exceptions[0])
        finally:
            self.links.discard(link)
            for w in link.writers:
                w.transport.abort()

    async def _direction(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, name: str, link: _Link
    ) -> None:
        line: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(QUEUE_CHUNKS)

        async def receive() -> None:
            while data := await reader.read(READ_BYTES):
                await line.put((time.monotonic() + self.cfg.latency_s, data))
            await line.put((0.0, b""))  # EOF travels through the line too

        async def deliver() -> None:
            while True:
                due, data = await line.get()
                await asyncio.sleep(max(0.0, due - time.monotonic()))
                await self.flowing.wait()
                if not data:
                    if writer.can_write_eof():
                        writer.write_eof()
                    return
                writer.write(data)
                await writer.drain()
                self.stats.bytes[name] += len(data)

        async with asyncio.TaskGroup() as tg:
            tg.create_task(receive())
            tg.create_task(deliver())


def _hostport(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT (e.g. 127.0.0.1:5555)")
    return host.removeprefix("tcp://"), int(port)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m labs.chaos", description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", type=_hostport, required=True, help="HOST:PORT to forward to")
    ap.add_argument(
        "--listen",
        type=_hostport,
        default=("127.0.0.1", 0),
        help="HOST:PORT to listen on (port 0: the OS picks, printed when ready)",
    )
    ap.add_argument("--latency-ms", type=float, default=0.0)
    ap.add_argument("--reset-every-s", type=float, default=0.0, help="mean; 0 = never")
    ap.add_argument("--stall-every-s", type=float, default=0.0, help="mean; 0 = never")
    ap.add_argument("--stall-s", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stats", type=Path, default=None, help="write counters here on exit")
    return ap


async def _main(args: argparse.Namespace) -> int:
    try:
        cfg = ChaosConfig(
            args.latency_ms / 1000, args.reset_every_s, args.stall_every_s, args.stall_s, args.seed
        )
    except ValueError as exc:
        print(f"labs.chaos: {exc}", file=sys.stderr)
        return 2
    proxy = ChaosProxy(*args.target, cfg)
    port = await proxy.start(*args.listen)
    print(f"{READY_PREFIX}{port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with asyncio.TaskGroup() as tg:
        faults = tg.create_task(proxy.run_faults())
        await stop.wait()
        faults.cancel()
    await proxy.close()
    if args.stats is not None:
        args.stats.write_text(json.dumps(asdict(proxy.stats)))
    return 0


def main(argv: list[str] | None = None) -> int:
    return asyncio.run(_main(build_parser().parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
