"""Many zmq sessions over one punched TCP connection.

A fetch opens a new zmq connection per version; a punched connection costs a round of
signalling and up to seconds of SYN retries. So a link is punched once and then carries
sessions, in either direction: each end listens on 127.0.0.1 (its fetches connect there, CURVE
and tickets unchanged) and, for each session the other end opens, connects to its own relay
socket and copies bytes both ways. Either way matters: when a re-plan swaps two neighbours,
the new child pulls through the connection that already exists (a second connection between
the same two punch ports cannot be opened: same address pair).

Frame (both directions): ``kind (u8) | session (u32) | length (u32) | bytes``, kind 1 = open,
2 = data, 3 = close; at most ``MAX_FRAME`` bytes each. The end that punched as child numbers
its sessions odd, the other even. A frame of an unknown kind, an oversize frame or an open with
our own parity ends the tunnel (a hostile or broken peer); a session beyond ``max_sessions``, or
an open to an end that relays nothing, is closed at once. Back-pressure: a session's bytes are
written to its local connection before the next frame is read (``drain``), so a slow reader
slows the TCP connection instead of filling memory; at most one frame per session is buffered.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import socket
import struct

from echo_rl.core.errors import EchoError

log = logging.getLogger(__name__)

HEADER = struct.Struct("!BII")
OPEN, DATA, CLOSE = 1, 2, 3
MAX_FRAME = 256 * 1024
READ = 256 * 1024


class TunnelError(EchoError):
    default_reason = "tunnel"


class Tunnel:
    """One end of a punched link. ``target`` ("tcp://host:port"): this end's own relay socket,
    where sessions the other end opens go ("" = it relays nothing). ``odd``: this end punched
    as the child (session numbering). ``local``: where this end's fetches connect."""

    def __init__(
        self, sock: socket.socket, *, target: str = "", odd: bool = True, max_sessions: int = 8
    ):
        self.sock = sock
        self.target = target
        self.odd = odd
        self.max_sessions = max_sessions
        self.sessions: dict[int, asyncio.StreamWriter] = {}
        self.local = ""  # "tcp://127.0.0.1:port" for this end's fetches
        self.bytes_in = 0
        self.bytes_out = 0
        self._ids = itertools.count(1 if odd else 2, 2)
        self._writer: asyncio.StreamWriter | None = None
        self._tg: asyncio.TaskGroup | None = None
        self.ready = asyncio.Event()

    async def run(self) -> None:
        """Serve until the punched connection ends (then every session ends with it)."""
        reader, self._writer = await asyncio.open_connection(sock=self.sock, limit=2 * MAX_FRAME)
        server = None
        try:
            async with asyncio.TaskGroup() as tg:
                self._tg = tg
                server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
                self.local = f"tcp://127.0.0.1:{server.sockets[0].getsockname()[1]}"
                self.ready.set()
                await self._read(reader)
                raise _Ended()
        except* _Ended:
            pass
        except* (ConnectionError, asyncio.IncompleteReadError, TunnelError) as eg:
            log.info("tunnel ended: %s", eg.exceptions[0])
        finally:
            if server is not None:
                server.close()
            for w in self.sessions.values():
                w.close()
            self.sessions.clear()
            self._writer.close()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()

    async def _read(self, reader: asyncio.StreamReader) -> None:
        while True:
            try:
                kind, sid, n = HEADER.unpack(await reader.readexactly(HEADER.size))
            except asyncio.IncompleteReadError:
                return  # the peer closed the link
            if (
                n > MAX_FRAME
                or kind not in (OPEN, DATA, CLOSE)
                or (kind == OPEN and sid % 2 == self.odd)
            ):
                raise TunnelError(f"bad frame (kind {kind}, {n} bytes): closing the tunnel")
            data = await reader.readexactly(n) if n else b""
            self.bytes_in += n
            if kind == OPEN:
                await self._open(sid)
            elif kind == DATA:
                w = self.sessions.get(sid)
                if w is not None:
                    try:
                        w.write(data)
                        await w.drain()
                    except ConnectionError:  # that fetch went away: only its session ends
                        self.sessions.pop(sid, None)
                        await self._send(CLOSE, sid)
            else:
                w = self.sessions.pop(sid, None)
                if w is not None:
                    w.close()

    async def _open(self, sid: int) -> None:
        """The other end opened a session: connect it to our relay socket."""
        if not self.target or sid in self.sessions or len(self.sessions) >= self.max_sessions:
            await self._send(CLOSE, sid)
            return
        host, _, port = self.target.removeprefix("tcp://").rpartition(":")
        try:
            r, w = await asyncio.open_connection(host, int(port))
        except OSError:
            await self._send(CLOSE, sid)
            return
        self.sessions[sid] = w
        assert self._tg is not None
        self._tg.create_task(self._pump(sid, r, w))

    async def _accept(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        """A fetch of ours connected locally: open a session for it."""
        if len(self.sessions) >= self.max_sessions:
            w.close()
            return
        sid = next(self._ids)
        self.sessions[sid] = w
        await self._send(OPEN, sid)
        await self._pump(sid, r, w)

    async def _pump(self, sid: int, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        """Local connection -> tunnel, until it closes (then the session closes at both ends)."""
        try:
            while data := await r.read(READ):
                await self._send(DATA, sid, data)
        except ConnectionError:
            pass
        finally:
            if self.sessions.pop(sid, None) is not None:
                try:
                    await self._send(CLOSE, sid)
                except ConnectionError:
                    pass
            w.close()

    async def _send(self, kind: int, sid: int, data: bytes = b"") -> None:
        assert self._writer is not None
        self._writer.write(HEADER.pack(kind, sid, len(data)) + data)
        self.bytes_out += len(data)
        await self._writer.drain()


class _Ended(Exception):
    pass
