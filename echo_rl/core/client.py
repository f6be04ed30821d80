"""Request/response over one DEALER socket, plus a bounded queue of unsolicited notices.

Replies are matched to requests by ``rid``; a reply that arrives after its request timed out
is dropped. Notices (snapshot_notice, shutdown, punch) go to ``notices``, bounded at 64; on
overflow the oldest is dropped, which loses nothing because only the newest snapshot matters and
the heartbeat acknowledgement repeats it (a dropped punch fails its link, and the child asks the
learner for another source: ``echo_rl.broadcast.nat.links``).

With ``keys`` and ``server_key`` the socket speaks CurveZMQ and pins the learner's key. A failed
handshake never reaches the application as an error by itself (libzmq retries quietly), so the
same monitor watches for it: ``handshake_error`` then says why in words (wrong learner key,
refused key, plaintext learner), and waiting requests fail with ``HandshakeFailed``.

When the connection drops (a zmq socket monitor sees it), every waiting request fails at once
with ``ConnectionLost`` rather than after its timeout: on a flapping link the replies of those
requests are gone, and waiting the full timeout for each would starve the learner.
"""

from __future__ import annotations

import asyncio
import itertools
import logging

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from echo_rl.core import wire
from echo_rl.core.errors import EchoError
from echo_rl.core.security import KeyPair, curve_client

log = logging.getLogger("echo_rl.core.client")

NOTICE_QUEUE = 64


class RequestTimeout(EchoError, TimeoutError):
    """No reply within the request's timeout."""

    default_reason = "timeout"


class ConnectionLost(RequestTimeout):
    """The connection dropped while a request waited: its reply, if any, is gone (the learner
    answers the old connection). Raised at once instead of after the timeout; the socket
    reconnects by itself and queues what is sent meanwhile, so the caller may retry now."""

    default_reason = "connection_lost"


class HandshakeFailed(ConnectionLost):
    """The encrypted handshake failed: retrying with the same keys will not help."""

    default_reason = "handshake_failed"


_HANDSHAKE_EVENTS = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_SUCCEEDED
)


WRONG_KEY_AFTER = 10  # failed handshakes in a row, never one accepted: the key is wrong


def explain_handshake(event: int, value: int, endpoint: str) -> str:
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        if value == 300:
            return f"{endpoint} is busy (too many new connections): retrying"
        return (
            f"{endpoint} refused this worker's key (banned, not on its allow-list, or the "
            f"learner is full): ask its operator, or use the key they registered (--identity)"
        )
    if event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
        return (
            f"{endpoint} does not hold the learner key in the join line: copy the line the "
            f"learner printed again (a wrong or stale key, or not the learner you think)"
        )
    return (
        f"{endpoint} does not speak Echo's encrypted protocol (a plaintext --insecure learner? "
        f"then join with tcp://HOST:PORT --insecure)"
    )


class Client:
    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        endpoint: str,
        max_bytes: int,
        *,
        keys: KeyPair | None = None,
        server_key: bytes | None = None,
    ):
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if server_key is not None:
            curve_client(self.sock, keys or KeyPair.generate(), server_key)
        self._monitor = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | _HANDSHAKE_EVENTS)
        self.sock.connect(endpoint)
        self.endpoint = endpoint
        self.handshake_error = ""  # why the last handshake failed; "" once one succeeded
        self.retryable = True  # False when the last failure needs the user, not a retry
        self.handshakes_ok = 0
        self._failed_in_row = 0
        self.disconnects = 0
        self.max_bytes = max_bytes
        self._rids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[wire.Message]] = {}
        self.notices: asyncio.Queue[wire.Message] = asyncio.Queue(NOTICE_QUEUE)

    async def receive_forever(self) -> None:
        """Replies and notices, and the connection's drops (until cancelled)."""
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self._receive())
            tg.create_task(self._watch())

    async def _watch(self) -> None:
        while True:
            ev = parse_monitor_message(await self._monitor.recv_multipart())
            if ev["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.handshake_error, self.retryable = "", True
                self.handshakes_ok += 1
                self._failed_in_row = 0
                continue
            if ev["event"] & _HANDSHAKE_EVENTS:
                self._handshake_failed(ev["event"], ev["value"])
                continue
            self.disconnects += 1
            lost = self._fail_pending(ConnectionLost("connection to the learner dropped"))
            if lost:
                log.info("connection to the learner dropped; %d request(s) will be retried", lost)

    def _handshake_failed(self, event: int, value: int) -> None:
        """A refused key (ZAP 400) is final. A wrong learner key and a connection reset in the
        middle of a handshake look the same to libzmq (no detail), so that is judged final only
        when this learner never accepted us and it failed ``WRONG_KEY_AFTER`` times in a row;
        on a flaky link the worker keeps retrying."""
        self._failed_in_row += 1
        self.handshake_error = explain_handshake(event, value, self.endpoint)
        if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            self.retryable = value == 300
        else:
            self.retryable = self.handshakes_ok > 0 or self._failed_in_row < WRONG_KEY_AFTER
        self._fail_pending(HandshakeFailed(self.handshake_error))

    def _fail_pending(self, exc: Exception) -> int:
        lost, self._pending = self._pending, {}
        for fut in lost.values():
            if not fut.done():
                fut.set_exception(exc)
        return len(lost)

    async def _receive(self) -> None:
        while True:
            frame = await self.sock.recv()
            try:
                msg = wire.decode(frame, self.max_bytes)
            except wire.WireError as err:
                log.warning("dropping bad message from the learner: %s", err)
                continue
            fut = self._pending.pop(msg.rid, None) if msg.rid else None
            if fut is not None:
                if not fut.done():
                    fut.set_result(msg)
            elif isinstance(msg, (wire.SnapshotNotice, wire.Shutdown, wire.Punch, wire.Farewell)):
                if self.notices.full():
                    self.notices.get_nowait()
                self.notices.put_nowait(msg)

    async def request(self, msg: wire.Message, timeout: float) -> wire.Message:
        msg.rid = next(self._rids)
        fut: asyncio.Future[wire.Message] = asyncio.get_running_loop().create_future()
        self._pending[msg.rid] = fut
        try:
            await self.sock.send(wire.encode(msg))
            return await asyncio.wait_for(fut, timeout)
        except ConnectionLost:
            raise
        except TimeoutError:
            raise RequestTimeout(f"no reply to {msg.type} within {timeout}s") from None
        finally:
            self._pending.pop(msg.rid, None)

    async def send(self, msg: wire.Message) -> None:
        await self.sock.send(wire.encode(msg))

    def close(self, linger_ms: int = 0) -> None:
        """``linger_ms``: how long queued messages may still leave (0: drop them)."""
        self.sock.disable_monitor()
        self._monitor.close(linger=0)
        self.sock.close(linger=linger_ms)
