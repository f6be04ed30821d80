"""What a worker's NAT does, judged by the learner: reachable, punchable, or neither.

The learner runs a ``Reflector``: two TCP listeners (two ports of the control plane's host),
playing the part STUN's binding test and AutoNAT's dial-back play. A worker connects to each
from its one *punch port* and sends a probe; the reflector notes the address it saw the
connection come from (the NAT's mapping of the punch port) and, on the first listener, dials
the worker's relay port back on that same address. The worker then reports the two probes'
nonces at join (``wire.NatReport``); the learner classifies from its *own* records, never from
what the worker says it saw (docs/nat.md):

* ``reachable``: the dial-back connected, and the relay endpoint the worker joined with is that
  observed address: any peer can connect to it (zmq TCP, as before).
* ``punchable``: both probes left from the same public ip:port (endpoint-independent mapping):
  a peer that connects to that address while this worker connects to the peer's opens a TCP
  connection through both NATs (``echo_rl.broadcast.nat.punch``).
* ``none``: the mappings differ per destination (symmetric NAT). Only a reachable parent (or the
  learner) can feed it, and it never relays.

Wire form of a probe (worker -> reflector), one msgpack map, at most 256 bytes:
``{"v": 1, "nonce": 16 random bytes, "dial": relay port or 0}``; the reply is
``{"v": 1, "ip": str, "port": int, "dialed": bool}`` and the reflector closes the connection
(so the TIME_WAIT stays on the learner's side, not on the worker's punch port).

Bounds: probes per second per source address and overall, 64 dial-backs at once (each 1 s at
most), 4,096 remembered observations for 120 s. The reflector reveals only the caller's own
address; a dial-back goes only to the address the probe came from.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypedDict

import msgpack

from echo_rl.core.errors import EchoError
from echo_rl.core.rates import TokenBucket
from echo_rl.core.security import PeerLimits

log = logging.getLogger(__name__)

PROBE_VERSION = 1
MAX_PROBE = 256
NONCE = 16
DIAL_TIMEOUT_S = 1.0
READ_TIMEOUT_S = 2.0
KEEP_S = 120.0
KEEP = 4096


class NatError(EchoError):
    default_reason = "nat"


class ReflectorPortTaken(NatError):
    """A reflector port the OS would not give (another process holds it): ``port``, which of
    the two, and the OS's words."""

    default_reason = "port_taken"

    def __init__(self, port: int, cause: OSError) -> None:
        super().__init__(f"port {port}: {cause}")
        self.port = port


@dataclass(frozen=True)
class Observation:
    ip: str
    port: int
    listener: int  # which of the reflector's listeners saw it (0 or 1)
    dialed: bool  # the dial-back to (ip, dial port) connected
    dial_port: int
    at: float


def reuse_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port) that other sockets may share: the probes and every
    punched connection leave from the same port, so they share the NAT's mapping."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    s.setblocking(False)
    s.bind((host, port))
    return s


def pick_punch_port(host: str) -> int:
    """A free port on ``host`` for this worker's probes and punches (kept for the session)."""
    s = reuse_socket(host, 0)
    port: int = s.getsockname()[1]
    s.close()
    return port


def punch_port_free(host: str, port: int) -> bool:
    """Whether no other process listens on ``port``: punch sockets share their port
    (SO_REUSEPORT), so a second worker given the same fixed port would bind it without an
    error and take the first one's punched connections. A socket without SO_REUSEPORT cannot
    bind beside a listener."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(
        socket.SOL_SOCKET, socket.SO_REUSEADDR, 1
    )  # old connections' TIME_WAIT is no owner
    try:
        s.bind((host, port))
        return True
    except OSError:
        return False
    finally:
        s.close()


class Reflector:
    def __init__(
        self,
        host: str,
        *,
        advertise: str = "",
        ports: tuple[int, int] = (0, 0),
        probes_per_s: float = 200.0,
        per_address_per_s: float = 5.0,
        max_dials: int = 64,
    ):
        """``ports``: the two listeners' (learner.reflector_ports; 0: the OS picks)."""
        self.host = host
        self._bind_ports = ports
        self.advertise = advertise or host  # the address workers probe (learner.public_host)
        self.ports: list[int] = []
        self.seen: OrderedDict[bytes, Observation] = OrderedDict()
        self.refused: dict[str, int] = {"rate": 0, "malformed": 0}
        self._all = TokenBucket(probes_per_s, 2 * probes_per_s)
        self._per_ip = PeerLimits(per_address_per_s, 4 * per_address_per_s)
        self._dials = asyncio.Semaphore(max_dials)
        self._servers: list[asyncio.base_events.Server] = []

    @property
    def endpoints(self) -> list[str]:
        return [f"{self.advertise}:{p}" for p in self.ports]

    async def start(self) -> None:
        for i, port in enumerate(self._bind_ports):
            try:
                srv = await asyncio.start_server(self._handler(i), self.host, port)
            except OSError as exc:
                self.close()
                raise ReflectorPortTaken(port, exc) from exc
            self._servers.append(srv)
            self.ports.append(srv.sockets[0].getsockname()[1])

    def close(self) -> None:
        for srv in self._servers:
            srv.close()

    def _handler(
        self, listener: int
    ) -> Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]:
        """The connection handler of listener ``listener`` (0: dial-back, 1: the second)."""
        return lambda reader, writer: self._serve(reader, writer, listener)

    async def _serve(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, listener: int
    ) -> None:
        ip, port = writer.get_extra_info("peername")[:2]
        try:
            if not self._per_ip.take(ip) or not self._all.take():
                self.refused["rate"] += 1
                return
            try:
                raw = await asyncio.wait_for(reader.read(MAX_PROBE + 1), READ_TIMEOUT_S)
                probe = _parse_probe(raw)
            except (TimeoutError, NatError, ConnectionError):
                self.refused["malformed"] += 1
                return
            dialed = False
            if listener == 0 and probe["dial"]:
                dialed = await self._dial(ip, probe["dial"])
            self._remember(
                probe["nonce"],
                Observation(ip, port, listener, dialed, probe["dial"], time.monotonic()),
            )
            writer.write(
                msgpack.packb({"v": PROBE_VERSION, "ip": ip, "port": port, "dialed": dialed})
            )
            await asyncio.wait_for(writer.drain(), READ_TIMEOUT_S)
        except (TimeoutError, ConnectionError):
            pass  # the prober went away: nothing was promised to it
        except asyncio.CancelledError:
            # The learner is shutting down mid-probe. Ending normally, not cancelled: Python
            # 3.11's stream server logs a cancelled handler as "Exception in callback" with two
            # tracebacks in the operator's log (fixed in 3.12). Nothing awaits this task.
            return
        finally:
            writer.close()

    async def _dial(self, ip: str, port: int) -> bool:
        """Can anyone connect to (ip, port)? Only the address the probe came from is dialled."""
        async with self._dials:
            try:
                _, w = await asyncio.wait_for(asyncio.open_connection(ip, port), DIAL_TIMEOUT_S)
            except (OSError, TimeoutError):
                return False
            w.close()
            return True

    def _remember(self, nonce: bytes, obs: Observation) -> None:
        self.seen[nonce] = obs
        self.seen.move_to_end(nonce)
        cutoff = time.monotonic() - KEEP_S
        while self.seen and (len(self.seen) > KEEP or next(iter(self.seen.values())).at < cutoff):
            self.seen.popitem(last=False)

    def classify(self, nonces: list[bytes], relay_endpoint: str) -> tuple[str, str]:
        """(nat, public address "ip:port" of the punch port) from this reflector's records."""
        obs = [o for o in (self.seen.get(n) for n in nonces[:2]) if o is not None]
        if len(obs) < 2 or {o.listener for o in obs} != {0, 1}:
            raise NatError(
                "probe_not_seen: probe both reflector addresses from the punch port "
                "(within 120 s) before reporting"
            )
        return nat_class(obs[0], obs[1], relay_endpoint)


def nat_class(first: Observation, second: Observation, relay_endpoint: str) -> tuple[str, str]:
    """(nat, the punch port's public "ip:port") from the two listeners' observations of one
    worker's probes: the rule the learner judges by, and ``echo-worker doctor`` reports."""
    addr = f"{first.ip}:{first.port}"
    dial = first if first.listener == 0 else second
    if dial.dialed and relay_endpoint == f"tcp://{dial.ip}:{dial.dial_port}":
        return "reachable", addr
    if (first.ip, first.port) == (second.ip, second.port):
        return "punchable", addr
    return "none", addr


class Probe(TypedDict):
    """A prober's message, checked: its nonce, and the port to dial back (0: none)."""

    nonce: bytes
    dial: int


def _parse_probe(raw: bytes) -> Probe:
    if not raw or len(raw) > MAX_PROBE:
        raise NatError("probe size")
    try:
        probe = msgpack.unpackb(raw, raw=False, max_map_len=8, max_bin_len=64, max_str_len=64)
    except (ValueError, msgpack.UnpackException) as exc:
        raise NatError("probe not msgpack") from exc
    if not isinstance(probe, dict) or probe.get("v") != PROBE_VERSION:
        raise NatError("probe version")
    nonce, dial = probe.get("nonce"), probe.get("dial", 0)
    if (
        not isinstance(nonce, bytes)
        or len(nonce) != NONCE
        or not isinstance(dial, int)
        or not 0 <= dial < 65536
    ):
        raise NatError("probe fields")
    return {"nonce": nonce, "dial": dial}


# ------------------------------------------------------------------------- worker side


async def probe(
    reflector: str, host: str, port: int, dial: int, timeout_s: float = 5.0
) -> tuple[bytes, dict[str, Any]]:
    """One probe from (host, port) to ``reflector`` ("ip:port"): (nonce, the reply)."""
    rip, rport = split_addr(reflector)
    nonce = os.urandom(NONCE)
    loop = asyncio.get_running_loop()
    s = reuse_socket(host, port)
    connected = False
    try:
        await asyncio.wait_for(loop.sock_connect(s, (rip, rport)), timeout_s)
        connected = True
        await loop.sock_sendall(
            s, msgpack.packb({"v": PROBE_VERSION, "nonce": nonce, "dial": dial})
        )
        raw = b""
        while len(raw) <= MAX_PROBE:
            part = await asyncio.wait_for(loop.sock_recv(s, MAX_PROBE), timeout_s)
            if not part:
                break
            raw += part
    except (OSError, TimeoutError) as exc:
        raise NatError(
            f"reflector {reflector} did not answer a probe: "
            f"{probe_failure(exc, timeout_s, connected)}"
        ) from exc
    finally:
        s.close()
    try:
        reply = msgpack.unpackb(raw, raw=False)
        assert isinstance(reply, dict) and reply.get("v") == PROBE_VERSION
    except Exception as exc:  # noqa: BLE001 - any malformed reply is one error
        raise NatError(f"reflector {reflector} sent a malformed reply") from exc
    return nonce, reply


def probe_failure(exc: BaseException, timeout_s: float, connected: bool) -> str:
    """What stopped a probe, in words, never empty: a timeout from ``asyncio.wait_for`` is a
    bare TimeoutError, whose text is "" (the worker's log said "did not answer a probe: ")."""
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused (nothing listens on that port there, or a firewall rejects it)"
    if isinstance(exc, ConnectionResetError):
        return "connection reset (a firewall or proxy on the way cut it)"
    if isinstance(exc, TimeoutError):
        if connected:
            return f"connected, but no reply within {timeout_s:g} s (timed out)"
        return (
            f"timed out after {timeout_s:g} s connecting (no answer: a firewall drops the "
            f"connection, or the address is not the learner's)"
        )
    text = (exc.strerror if isinstance(exc, OSError) else None) or str(exc)
    return text or type(exc).__name__


async def probe_all(reflectors: list[str], host: str, port: int, dial: int) -> list[bytes]:
    """Probe every reflector address in turn from the punch port; the nonces to report."""
    nonces = []
    for r in reflectors[:2]:
        nonce, _ = await probe(r, host, port, dial)
        nonces.append(nonce)
    return nonces


def split_addr(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit():
        raise NatError(f"bad address {addr!r}: expected ip:port")
    return host, int(port)
