"""Open connections to snapshot sources, kept from one fetch to the next.

A fetch used to open a fresh DEALER for every version: a TCP connect, a CURVE handshake (two
round trips) and a ZAP decision on the source's side, per version, per child. At ten versions
a second that is ten handshakes a second per worker; workers behind one address (a volunteer
with several GPUs, or every worker of a loopback drill) then ran into the source's handshake
limit per IP (``security.handshakes_per_s_per_ip``): the source answered "try later" (ZAP 300),
the fetch heard nothing and failed over after its stall bound, and the batches made meanwhile
went stale (issue 52, the quiet drill: 419 failovers of one honest worker in four minutes). On
a wide-area link the handshake alone is 2-3 round trips a version.

``Dialer`` keeps the connection a fetch ended cleanly on, for the next fetch from the same
source: one handshake per source, not per version. A connection is handed back only after a
fetch that received everything it asked for (no request of it still in flight, so no late
reply can reach the next fetch; ``fetch.check_reply`` would drop one anyway); a fetch that
failed closes its connection (a stalled, corrupt or refusing source gets a fresh one if it is
ever tried again). Bounded: at most ``size`` idle connections (least recently used closed
first); a connection whose source disconnected while it sat idle is closed, not reused.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple, cast

import zmq
import zmq.asyncio

from echo_rl.core.security import KeyPair, curve_client

SOCKET_BUFFER = 8 << 20  # large kernel buffers: fewer wake-ups per MiB on fast links


class Connection(NamedTuple):
    sock: zmq.asyncio.Socket
    monitor: zmq.asyncio.Socket  # EVENT_DISCONNECTED of ``sock``


Key = tuple[str, bytes, int]  # (address, server key, largest reply accepted)


class Dialer:
    """A bounded set of idle connections to sources, one per (address, server key, frame
    limit). Owned by one relay (``echo_rl.broadcast.relay.Relay``) and used from its event loop."""

    def __init__(self, ctx: zmq.asyncio.Context, keys: KeyPair | None, size: int = 4):
        self.ctx = ctx
        self.keys = keys
        self.size = size
        self._idle: OrderedDict[Key, Connection] = OrderedDict()
        self.opened = 0  # connections opened (each a handshake at the source)
        self.reused = 0  # fetches that started on a kept connection

    def open(self, address: str, server_key: bytes, max_reply: int) -> Connection:
        """A connection to ``address``: a kept one if it is still up, else a new one."""
        key: Key = (address, server_key, max_reply)
        conn = self._idle.pop(key, None)
        if conn is not None:
            if not _disconnected(conn):
                self.reused += 1
                return conn
            _close(conn)
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if server_key:
            curve_client(sock, self.keys or KeyPair.generate(), server_key)
        # A reply is one chunk and a small header: anything larger is a hostile peer, dropped
        # by libzmq before it is buffered (an unbounded frame could take gigabytes).
        sock.setsockopt(zmq.MAXMSGSIZE, max_reply)
        sock.setsockopt(zmq.RCVBUF, SOCKET_BUFFER)
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        sock.connect(address)
        self.opened += 1
        return Connection(sock, monitor)

    def keep(self, address: str, server_key: bytes, max_reply: int, conn: Connection) -> None:
        """Hand back the connection of a fetch that ended with nothing in flight."""
        key: Key = (address, server_key, max_reply)
        old = self._idle.pop(key, None)
        if old is not None:  # two fetches from one source at once: keep one connection
            _close(old)
        self._idle[key] = conn
        while len(self._idle) > self.size:
            _close(self._idle.popitem(last=False)[1])

    @property
    def idle(self) -> int:
        return len(self._idle)

    def close(self) -> None:
        while self._idle:
            _close(self._idle.popitem()[1])


def close(conn: Connection) -> None:
    """Close a connection that is not handed back (its fetch failed)."""
    _close(conn)


def _disconnected(conn: Connection) -> bool:
    """Did the source drop this connection while it sat idle? (Its monitor says so.)"""
    try:
        return bool(cast(int, conn.monitor.getsockopt(zmq.EVENTS)) & zmq.POLLIN)
    except zmq.ZMQError:
        return True


def _close(conn: Connection) -> None:
    conn.sock.disable_monitor()
    conn.monitor.close(linger=0)
    conn.sock.close(linger=0)
