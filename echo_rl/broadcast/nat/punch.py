"""A TCP connection through two NATs: simultaneous open from both punch ports.

Both ends, told by the learner at about the same moment (``wire.Punch``), connect from their
punch port to the other's public address (as the learner's reflector saw it), and also accept
on that port. Each SYN that leaves opens the sender's NAT for replies from that very address;
the first SYN to reach a NAT that has not sent its own yet is dropped, and the kernel resends
it (1 s, then 3 s), by which time the other side's SYN has gone out: the two SYNs meet as a TCP
simultaneous open (RFC 9293 3.5), with full kernel TCP speed. Where nothing drops the early SYN
(a public peer, loopback), it is refused at once or lands on the other side's listener; a
refused connect is retried from a fresh socket on the same port until the deadline. This is the
TCP path of libp2p's DCUtR (connect and listen on the same port), without libp2p.

Every connection that opens (connected or accepted) starts with ``MAGIC + punch id`` both ways
(the learner's random id for this link): a stray connection, or a peer punching for another
link, is closed before any byte is relayed. Several may open (one each way); the child picks
the first and sends ``KEEP`` on it, the parent keeps the one ``KEEP`` arrives on, and both close
the rest. The bytes then carried are zmq's, CURVE-encrypted end to end between the child's fetch
and the parent's relay: the link neither sees nor vouches for them.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import socket
import time

from echo_rl.broadcast.nat.reflect import NatError, reuse_socket, split_addr

MAGIC = b"ECHO-PUNCH-1\n"
ID_BYTES = 16
KEEP = b"K"


async def simultaneous_open(
    host: str,
    port: int,
    peer: str,
    punch_id: bytes,
    role: str,
    accepted: asyncio.Queue[socket.socket] | None = None,
    timeout_s: float = 10.0,
) -> socket.socket:
    """A connected, checked socket from (host, port) to ``peer`` ("ip:port"), or NatError.
    ``accepted``: greeted connections this side's listener accepted for this punch."""
    deadline = time.monotonic() + timeout_s
    found: asyncio.Queue[socket.socket] = asyncio.Queue()
    tried: dict[str, int] = {}  # what the attempts ended in (for the error)
    try:
        async with asyncio.timeout(timeout_s), asyncio.TaskGroup() as tg:
            tg.create_task(_connect_loop(host, port, peer, punch_id, deadline, found, tried))
            if accepted is not None:
                tg.create_task(_forward(accepted, found))
            chosen = await (_child_pick(found) if role == "child" else _parent_pick(found, tg))
            raise _Done(chosen)
    except* _Done as done:
        sock: socket.socket = done.exceptions[0].args[0]  # what _Done carried out
    except* TimeoutError:
        raise NatError(
            f"could not open a connection to {peer} in {timeout_s:.0f} s (attempts: {tried})"
        ) from None
    except* (OSError, NatError) as eg:
        raise NatError(f"punched link to {peer} broke while opening: {eg.exceptions[0]}") from None
    finally:
        while not found.empty():
            found.get_nowait().close()
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


class _Done(Exception):
    pass


async def _connect_loop(
    host: str,
    port: int,
    peer: str,
    punch_id: bytes,
    deadline: float,
    found: asyncio.Queue[socket.socket],
    tried: dict[str, int],
) -> None:
    loop = asyncio.get_running_loop()
    ip, pport = split_addr(peer)
    attempt_s = 0.25
    while (left := deadline - time.monotonic()) > 0:
        s = reuse_socket(host, port)
        try:
            # Short attempts, resent from a fresh socket: a SYN the far NAT dropped (it came
            # before that side's own SYN) is sent again in 0.25 s, not the kernel's 1 s.
            await asyncio.wait_for(loop.sock_connect(s, (ip, pport)), min(left, attempt_s))
            await greet(s, punch_id, max(0.5, deadline - time.monotonic()))
        except asyncio.CancelledError:
            s.close()
            raise
        except TimeoutError:
            s.close()
            tried["no answer"] = tried.get("no answer", 0) + 1
            attempt_s = min(2.0, attempt_s * 2)
            continue
        except (OSError, NatError) as exc:
            what = (
                errno.errorcode.get(exc.errno or 0, "?") if isinstance(exc, OSError) else "greeting"
            )
            tried[what] = tried.get(what, 0) + 1
            s.close()
            if isinstance(exc, OSError) and exc.errno in (errno.EADDRNOTAVAIL, errno.EADDRINUSE):
                return  # that very connection exists already: the peer's, accepted here
            # a RST (the other side is not connecting yet) or a stray: try again shortly
            await asyncio.sleep(0.05)
            continue
        await found.put(s)
        return


async def _forward(src: asyncio.Queue[socket.socket], dst: asyncio.Queue[socket.socket]) -> None:
    while True:
        await dst.put(await src.get())


async def _child_pick(found: asyncio.Queue[socket.socket]) -> socket.socket:
    s = await found.get()
    await asyncio.get_running_loop().sock_sendall(s, KEEP)
    return s


async def _parent_pick(found: asyncio.Queue[socket.socket], tg: asyncio.TaskGroup) -> socket.socket:
    """The connection the child sent KEEP on (each candidate read at once)."""
    chosen: asyncio.Future[socket.socket] = asyncio.get_running_loop().create_future()

    async def watch(s: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        try:
            with contextlib.suppress(OSError):
                if await loop.sock_recv(s, 1) == KEEP and not chosen.done():
                    chosen.set_result(s)
        finally:
            if not (chosen.done() and chosen.result() is s):
                s.close()

    async def collect() -> None:
        while True:
            tg.create_task(watch(await found.get()))

    tg.create_task(collect())
    return await chosen


async def greet(s: socket.socket, punch_id: bytes, timeout_s: float) -> None:
    """Send our greeting, check the peer's (same punch id): NatError if it is anything else."""
    loop = asyncio.get_running_loop()
    hello = MAGIC + punch_id
    await loop.sock_sendall(s, hello)
    got = b""
    try:
        while len(got) < len(hello):
            part = await asyncio.wait_for(loop.sock_recv(s, len(hello) - len(got)), timeout_s)
            if not part:
                break
            got += part
    except (OSError, TimeoutError) as exc:
        raise NatError(f"punched peer did not greet: {exc}") from exc
    if got != hello:
        raise NatError("punched peer sent the wrong greeting (another link's id, or not a peer)")


async def read_greeting(s: socket.socket, timeout_s: float = 5.0) -> bytes:
    """Listener side: the punch id an accepted connection greets with (NatError if none)."""
    loop = asyncio.get_running_loop()
    got = b""
    want = len(MAGIC) + ID_BYTES
    try:
        while len(got) < want:
            part = await asyncio.wait_for(loop.sock_recv(s, want - len(got)), timeout_s)
            if not part:
                break
            got += part
    except (OSError, TimeoutError) as exc:
        raise NatError(f"no greeting: {exc}") from exc
    if len(got) != want or not got.startswith(MAGIC):
        raise NatError("not a punch greeting")
    return got[len(MAGIC) :]
