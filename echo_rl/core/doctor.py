"""What ``echo-rl doctor`` and ``echo-worker doctor`` share: a check's verdict and fix, and
the probes of one port (docs/ports.md): is something listening, is it Echo, does the learner
answer with the key the join line pins.

Each probe says what it found in a short word (``open``, ``refused``, ``timeout``, ``silent``,
...) and the checks turn that into a sentence naming the host, the port, the config key or flag
behind it and what to do. Nothing here needs the planes: the NAT probe lives with the reflector
(``echo_rl.broadcast.nat.reflect``), the checks that use it in ``echo_rl.worker.doctor`` and ``echo_rl.control.doctor``.
"""

from __future__ import annotations

import asyncio
import socket
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from echo_rl.core import wire
    from echo_rl.core.security import KeyPair

ZMTP_SIGNATURE_LEN = 10  # 0xFF, 8 bytes of padding, 0x7F: the first bytes any ZeroMQ peer sends
TIMEOUT_S = 3.0
MARK = {"ok": "ok  ", "warn": "warn", "fail": "FAIL", "skip": "skip"}


@dataclass(frozen=True)
class Check:
    name: str
    # ok, warn (works, with a cost named), fail (something does not work), skip (not run:
    # the verdict says why, never silently left out)
    status: str
    verdict: str
    fix: str = ""


def show(checks: list[Check], out: TextIO | None = None) -> int:
    """Print each check (verdict, then the fix); 1 when any failed, else 0. A skipped check
    is neither passed nor failed: the last line names it."""
    out = out or sys.stdout
    for c in checks:
        print(f"[{MARK[c.status]}] {c.name}: {c.verdict}", file=out)
        if c.fix and c.status != "ok":
            print(f"       fix: {c.fix}", file=out)
    failed = [c.name for c in checks if c.status == "fail"]
    skipped = [c.name for c in checks if c.status == "skip"]
    ran = len(checks) - len(skipped)
    print(
        f"{ran - len(failed)} of {ran} checks passed"
        + (f"; failed: {', '.join(failed)}" if failed else "")
        + (f"; skipped: {', '.join(skipped)}" if skipped else ""),
        file=out,
    )
    return 1 if failed else 0


def tcp_greeting(host: str, port: int, timeout: float = TIMEOUT_S) -> str:
    """Connect to (host, port) and wait for a ZeroMQ greeting: ``zmtp`` (an Echo socket, or any
    ZeroMQ peer), ``refused`` (nobody listens), ``timeout`` (no answer to the connection: a
    firewall dropping it, or no such host), ``silent`` (accepted, said nothing), ``other`` (it
    speaks, but not ZeroMQ), or ``error: ...``."""
    sock = _connect(host, port, timeout)
    if isinstance(sock, str):
        return sock
    with sock:
        sock.settimeout(timeout)
        try:
            head = sock.recv(ZMTP_SIGNATURE_LEN)
        except TimeoutError:
            return "silent"
        except OSError:
            return "silent"
    if len(head) >= 1 and head[0] == 0xFF:
        return "zmtp"
    return "silent" if not head else "other"


def _connect(host: str, port: int, timeout: float) -> socket.socket | str:
    """A connected socket, or why none: ``refused``, ``timeout`` or ``error: ...``."""
    try:
        return socket.create_connection((host, port), timeout=timeout)
    except ConnectionRefusedError:
        return "refused"
    except TimeoutError:
        return "timeout"
    except OSError as exc:
        return f"error: {exc.strerror or exc}"


def port_words(found: str, host: str, port: int, what: str) -> tuple[str, str]:
    """(status, verdict) for a ``tcp_greeting`` result on ``what``."""
    where = f"{host} port {port}"
    if found == "zmtp":
        return "ok", f"{where} answers ({what})"
    return "fail", {
        "refused": f"nothing listens on {where} (connection refused)",
        "timeout": f"no answer from {where} within {TIMEOUT_S:g} s: a firewall drops the "
        f"connection, or {host} is not the address",
        "silent": f"{where} accepts connections but never speaks: not an Echo learner (another "
        f"program holds the port, or a proxy swallows the connection)",
        "other": f"{where} answers, but not in ZeroMQ: another program holds the port",
    }.get(found, f"cannot connect to {where} ({found})")


async def ask_learner(
    endpoint: str, server_key: bytes | None, keys: KeyPair | None, timeout: float = TIMEOUT_S
) -> tuple[wire.Message | None, str]:
    """One ``doctor`` request over CurveZMQ, pinning ``server_key``: (the reply, "") or (None,
    why not, in words: the handshake's own explanation when it failed)."""
    import zmq.asyncio

    from echo_rl.core import wire
    from echo_rl.core.client import Client, RequestTimeout

    ctx = zmq.asyncio.Context()
    client = Client(ctx, endpoint, 1 << 20, keys=keys, server_key=server_key)
    listen = asyncio.ensure_future(client.receive_forever())
    try:
        reply = await client.request(wire.Doctor(), timeout)
        return reply, ""
    except RequestTimeout as exc:
        return None, client.handshake_error or str(exc)
    finally:
        listen.cancel()
        await asyncio.gather(listen, return_exceptions=True)
        client.close()
        ctx.term()
