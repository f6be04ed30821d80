"""Per-link transport: which links need a punched connection, and the worker's tunnels.

``PunchBook`` (wherever the broadcast is rooted: the learner, the broadcast benchmark) turns
"child C pulls from endpoint E" into the source C is sent. When E's owner is reachable, E
itself: zmq TCP as always. When it is only punchable, ``punch/<id>/E`` plus two ``wire.Punch``
messages, one to each end, sent before C's source so both start at once. A link is punched once
per pair of workers and reused while it lives, in either direction (a re-plan that swaps two
neighbours pulls through the connection they have). A punch that fails (reason ``unpunchable``) makes the child a tail
fed only by reachable sources; a parent whose punches fail with two different children is no
longer used as a punched relay. ``tunnel_lost`` (a link that worked and closed) only forgets
the link: the next assignment punches again.

``Tunnels`` (every worker) opens the links it is told to and resolves ``punch/<id>/E`` to the
child end's local address for a fetch.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from echo_rl.broadcast.nat.punch import MAGIC, read_greeting, simultaneous_open
from echo_rl.broadcast.nat.reflect import NatError, reuse_socket
from echo_rl.broadcast.nat.tunnel import Tunnel
from echo_rl.core import wire
from echo_rl.core.errors import ReasonError

log = logging.getLogger(__name__)

PREFIX = "punch/"


def via(punch_id: bytes, endpoint: str) -> str:
    return f"{PREFIX}{punch_id.hex()}/{endpoint}"


def split_via(source: str) -> tuple[bytes, str]:
    """("punch id" or b"", endpoint) of a source string."""
    if not source.startswith(PREFIX):
        return b"", source
    pid, _, endpoint = source[len(PREFIX) :].partition("/")
    try:
        return bytes.fromhex(pid), endpoint
    except ValueError:
        return b"", endpoint


def plain(source: str) -> str:
    return split_via(source)[1]


@dataclass
class _Link:
    punch_id: bytes
    at: float


@dataclass
class PunchBook:
    timeout_s: float = 10.0
    ttl_s: float = 3600.0
    links: dict[frozenset[str], _Link] = field(default_factory=dict)  # {child, parent} -> link
    strikes: dict[str, set[str]] = field(default_factory=dict)  # parent -> children it failed
    punched: int = 0
    failed: int = 0

    def route(
        self, child: str, parent: str, endpoint: str, child_addr: str, parent_addr: str
    ) -> tuple[str, list[tuple[str, wire.Punch]]]:
        """The source string for ``child`` and the punch messages to send (to whom)."""
        link = self.links.get(frozenset((child, parent)))
        if link is not None and time.monotonic() - link.at < self.ttl_s:
            return via(link.punch_id, endpoint), []
        pid = os.urandom(16)
        self.links[frozenset((child, parent))] = _Link(pid, time.monotonic())
        self.punched += 1
        return via(pid, endpoint), [
            (
                parent,
                wire.Punch(
                    punch_id=pid,
                    role="parent",
                    address=child_addr,
                    endpoint=endpoint,
                    timeout_s=self.timeout_s,
                ),
            ),
            (
                child,
                wire.Punch(
                    punch_id=pid,
                    role="child",
                    address=parent_addr,
                    endpoint=endpoint,
                    timeout_s=self.timeout_s,
                ),
            ),
        ]

    def failed_link(self, child: str, parent: str, reason: str) -> tuple[bool, bool]:
        """A child reported its punched link failed: (demote the child, demote the parent)."""
        self.links.pop(frozenset((child, parent)), None)
        if reason != "unpunchable":
            return False, False
        self.failed += 1
        struck = self.strikes.setdefault(parent, set())
        struck.add(child)
        return True, len(struck) >= 2

    def forget(self, worker: str) -> None:
        self.links = {k: v for k, v in self.links.items() if worker not in k}
        self.strikes.pop(worker, None)


class Tunnels:
    """A worker's punched links: opened when told (``open``), served in ``serve_forever``."""

    def __init__(self, host: str, port: int, *, endpoint: str = "", max_links: int = 8):
        self.host, self.port = host, port
        self.endpoint = endpoint  # our relay socket: where sessions the peer opens go ("" none)
        self.max_links = max_links
        self.links: OrderedDict[bytes, asyncio.Future[Tunnel]] = OrderedDict()
        # peer's public address -> its link: one connection per pair of punch ports, so a
        # punch to a peer we have a live link with reuses it (the learner forgot it, or a TTL)
        self.peers: dict[str, asyncio.Future[Tunnel]] = {}
        # greeted connections our listener accepted, per punch still opening
        self.accepted: dict[bytes, asyncio.Queue[socket.socket]] = {}
        self.strays = 0  # accepted connections that did not greet with a punch we expect
        self.opened = 0
        self.failed = 0
        self._todo: asyncio.Queue[wire.Punch] = asyncio.Queue(maxsize=32)
        self._arrived = asyncio.Event()  # set (and replaced) whenever a punch arrives
        self.listening = asyncio.Event()  # the punch port accepts (serve_forever has started)

    def open(self, msg: wire.Punch) -> bool:
        """Queue a punch (False: 32 are already waiting; the learner re-plans on failure)."""
        if msg.punch_id in self.links:
            return True
        live = self.peers.get(msg.address)
        if (
            live is not None
            and live.done()
            and not live.exception()
            and not isinstance(live.result(), _Lost)
        ):
            self.links[msg.punch_id] = live
            return True
        fut: asyncio.Future[Tunnel] = asyncio.get_running_loop().create_future()
        self.links[msg.punch_id] = fut
        self.peers[msg.address] = fut
        self.accepted[msg.punch_id] = asyncio.Queue(maxsize=4)
        self._arrived.set()
        self._arrived = asyncio.Event()
        while len(self.links) > self.max_links:
            _, old = self.links.popitem(last=False)
            if any(f is old for f in self.links.values()):
                continue  # another punch id still names that connection
            self.peers = {a: f for a, f in self.peers.items() if f is not old}
            if old.done() and not old.exception():
                old.result().close()
            elif not old.done():
                old.set_exception(NatError("link evicted (too many links)"))
        try:
            self._todo.put_nowait(msg)
        except asyncio.QueueFull:
            fut.set_exception(NatError("too many punches waiting"))
            return False
        return True

    async def serve_forever(self) -> None:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self._listen(tg))
            while True:
                msg = await self._todo.get()
                tg.create_task(self._link(msg))

    async def _listen(self, tg: asyncio.TaskGroup) -> None:
        """Accept on the punch port too (where nothing drops the early SYN, the peer's connect
        lands here); at most 16 greetings checked at once, 5 s each."""
        loop = asyncio.get_running_loop()
        lsock = reuse_socket(self.host, self.port)
        lsock.listen(16)
        self.listening.set()
        slots = asyncio.Semaphore(16)
        try:
            while True:
                conn, _ = await loop.sock_accept(lsock)
                conn.setblocking(False)
                if slots.locked():
                    conn.close()
                    self.strays += 1
                    continue
                await slots.acquire()
                tg.create_task(self._admit(conn, slots))
        finally:
            lsock.close()

    async def _admit(self, conn: socket.socket, slots: asyncio.Semaphore) -> None:
        try:
            pid = await read_greeting(conn)
            queue = self.accepted.get(pid)
            if queue is None:
                raise NatError("greeting for no punch of ours")
            await asyncio.get_running_loop().sock_sendall(conn, MAGIC + pid)
            queue.put_nowait(conn)
        except (NatError, OSError, asyncio.QueueFull):
            self.strays += 1
            conn.close()
        finally:
            slots.release()

    async def _link(self, msg: wire.Punch) -> None:
        fut = self.links.get(msg.punch_id)
        if fut is None or fut.done():
            return
        try:
            sock = await simultaneous_open(
                self.host,
                self.port,
                msg.address,
                msg.punch_id,
                msg.role,
                self.accepted[msg.punch_id],
                msg.timeout_s,
            )
        except NatError as err:
            self.failed += 1
            log.warning("punch to %s (%s) failed: %s", msg.address, msg.role, err)
            if not fut.done():
                fut.set_exception(err)
            return
        finally:
            queue = self.accepted.pop(msg.punch_id, None)
            while queue is not None and not queue.empty():
                queue.get_nowait().close()
        tunnel = Tunnel(
            sock,
            target=msg.endpoint if msg.role == "parent" else self.endpoint,
            odd=msg.role == "child",
        )
        self.opened += 1
        log.info("punched link to %s open (%s of %s)", msg.address, msg.role, msg.endpoint)
        async with asyncio.TaskGroup() as tg:
            tg.create_task(tunnel.run())
            await tunnel.ready.wait()
            if not fut.done():
                fut.set_result(tunnel)
        # the link closed: a later fetch through it asks the learner again (tunnel_lost)
        lost = _lost()
        for pid in [k for k, f in self.links.items() if f is fut]:
            self.links[pid] = lost
        for peer in [k for k, f in self.peers.items() if f is fut]:
            self.peers[peer] = lost

    async def resolve(self, source: str, wait_s: float = 15.0) -> str:
        """The address a fetch connects to for ``source`` (its own, unless it is punched)."""
        pid, endpoint = split_via(source)
        if not pid:
            return source
        fut = self.links.get(pid)
        deadline = time.monotonic() + 3.0
        while fut is None and (left := deadline - time.monotonic()) > 0:
            # the punch travels just ahead of the source, but may still be queued: a moment
            try:
                await asyncio.wait_for(self._arrived.wait(), left)
            except TimeoutError:
                break
            fut = self.links.get(pid)
        if fut is None:
            raise LinkFailed("tunnel_lost", f"no punched link {pid.hex()[:8]} for {endpoint}")
        try:
            tunnel = await asyncio.wait_for(asyncio.shield(fut), wait_s)
        except NatError as err:
            raise LinkFailed("unpunchable", str(err)) from None
        except TimeoutError:
            raise LinkFailed(
                "unpunchable", f"punch to {endpoint} still open after {wait_s} s"
            ) from None
        if isinstance(tunnel, _Lost):
            raise LinkFailed("tunnel_lost", f"punched link to {endpoint} closed")
        return tunnel.local


class LinkFailed(ReasonError):
    """A punched link that could not be made or kept: ``reason`` says which step failed."""


class _Lost:
    local = ""


def _lost() -> asyncio.Future[Any]:
    fut = asyncio.get_running_loop().create_future()
    fut.set_result(_Lost())
    return fut
