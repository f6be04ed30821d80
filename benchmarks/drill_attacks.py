"""The hostile peers of ``benchmarks/security_drill.py``: each attack runs in its own process
(``security_drill.py attack NAME ...``), against a learner that is training, and prints one JSON
line saying what it sent and what came back (replies counted by type or refusal reason).

Attackers connect from other loopback addresses (127.0.1.x, a zmq source address) so that the
learner sees them as other hosts than the honest workers on 127.0.0.1, as on a real network.
"""

from __future__ import annotations

import errno
import json
import socket
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import zmq

from echo_rl.core import wire
from echo_rl.core.security import JoinLine, KeyPair, curve_client

JUNK = msgpack.packb({"v": 1, "type": ["x"]})  # the 13 bytes that once ended a learner
ATTACKER_HOST = "127.0.1.1"
MIB = 2**20


class Target:
    """What an attacker knows: the public join line, the learner's files, a relay it found."""

    def __init__(self, line: str, run_dir: Path, relay: str, relay_key: str, token: str):
        self.line = JoinLine.parse(line)
        self.info = json.loads((run_dir / "learner.json").read_text())
        self.run_dir = run_dir
        self.relay, self.relay_key, self.token = relay, relay_key.encode(), token
        self.ctx = zmq.Context()
        self.max_message_mib = 16.0  # transport.max_message_mib (set from the run's config)

    def dealer(
        self,
        endpoint: str = "",
        keys: KeyPair | None = None,
        server_key: bytes | None = None,
        src: str = ATTACKER_HOST,
        plaintext: bool = False,
    ) -> zmq.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        if not plaintext:
            curve_client(sock, keys or KeyPair.generate(), server_key or self.line.server_key)
        host_port = (endpoint or self.line.endpoint).removeprefix("tcp://")
        sock.connect(f"tcp://{src}:0;{host_port}")
        return sock


def reason_of(frame: bytes) -> str:
    try:
        msg = wire.decode(frame, 1 << 24)
    except wire.WireError as err:
        return f"undecodable:{err.reason}"
    return msg.reason if isinstance(msg, wire.Error) else msg.type


def drain(sock: zmq.Socket, want: int, timeout_s: float) -> Counter[str]:
    """Receive up to ``want`` replies (the first frame of each), or until the time is up."""
    got: Counter[str] = Counter()
    deadline = time.monotonic() + timeout_s
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    while sum(got.values()) < want:
        left = deadline - time.monotonic()
        if left <= 0 or not poller.poll(int(left * 1000)):
            break
        got[reason_of(sock.recv_multipart()[0])] += 1
    return got


# What the learner pushes to a joined session unasked: never the reply to a request. A new
# version published between a request and its reply put a snapshot_notice first (a drill under
# load read it as the reply to an impersonating heartbeat).
PUSHED = {"snapshot_notice"}


def ask(sock: zmq.Socket, msg: wire.Message, timeout_s: float = 5.0) -> str:
    """The reply to ``msg``, skipping pushed notices."""
    sock.send(wire.encode(msg))
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        kind = next(iter(drain(sock, 1, left)), None)
        if kind is None:
            break
        if kind not in PUSHED:
            return kind
    return "no_reply"


def flood(
    sock: zmq.Socket, frame: bytes, n: int, window: int = 500, timeout_s: float = 10.0
) -> Counter[str]:
    """Send ``n`` frames, ``window`` at a time, reading the replies of each window."""
    got: Counter[str] = Counter()
    for start in range(0, n, window):
        k = min(window, n - start)
        try:
            for _ in range(k):
                # NOBLOCK: a DEALER whose handshake was refused has no peer, and a blocking
                # send then waits forever (the attacker hung until the drill's time limit)
                sock.send(frame, zmq.NOBLOCK)
        except zmq.Again:
            got["no_connection"] += n - start
            break
        window_got = drain(sock, k, timeout_s)
        got += window_got
        if not window_got:  # nothing came back: refused at the handshake (e.g. an unjoined
            got["no_connection"] += n - start  # key at the learner's chunk socket); stop here
            break
    return got


def join_evil(t: Target, name: str = "evil") -> tuple[zmq.Socket, KeyPair, wire.Message]:
    """A volunteer with a real token (an insider) that turns hostile."""
    keys = KeyPair.load_or_create(t.run_dir.parent / f"{name}.key")
    sock = t.dealer(keys=keys)
    sock.send(wire.encode(wire.Join(worker_id=name, can_relay=False, token=t.token)))
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if sock.poll(int(1000 * (deadline - time.monotonic()))):
            reply = wire.decode(sock.recv(), 1 << 24)
            if isinstance(reply, wire.JoinAck):
                return sock, keys, reply
            raise RuntimeError(f"the insider's join was refused: {reply}")
    raise RuntimeError("no answer to the insider's join")


def current_version(joined: zmq.Socket) -> int:
    """The learner's newest version, from a heartbeat of the insider's session."""
    joined.send(wire.encode(wire.Heartbeat(worker_id="evil", version=-1, rid=7)))
    deadline = time.monotonic() + 10
    while joined.poll(max(1, int(1000 * (deadline - time.monotonic())))):
        reply = wire.decode(joined.recv(), 1 << 24)
        if isinstance(reply, wire.HeartbeatAck) and reply.rid == 7:  # not an earlier one
            return reply.version
    raise RuntimeError("no heartbeat_ack for the insider")


# ----------------------------------------------------------------------------- attacks


def junk13(t: Target) -> dict[str, Any]:
    out: dict[str, Any] = {}
    targets = [("control", t.line.endpoint, None), ("snapshot", t.info["snapshot_endpoint"], None)]
    if t.relay:
        targets.append(("relay", t.relay, t.relay_key))
    for name, endpoint, key in targets:
        sock = t.dealer(endpoint, server_key=key)
        out[name] = dict(flood(sock, JUNK, 1000))
        sock.close()
    return {"sent_each": 1000, "replies": out}


def impersonate(t: Target) -> dict[str, Any]:
    stranger = t.dealer()
    traj = wire.Trajectories(worker_id="w0", batch_id="b", count=0, payload=wire.pack_records([]))
    out = {
        "never_joined_trajectories": ask(stranger, traj),
        "join_as_w0": ask(stranger, wire.Join(worker_id="w0", can_relay=False, token=t.token)),
    }
    sock, _, ack = join_evil(t)
    out["join_as_evil"] = ack.type
    for msg in (
        wire.Heartbeat(worker_id="w0", version=0),
        traj,
        wire.SourceRequest(
            worker_id="w0", version=0, bad_source=t.relay or "tcp://x:1", reason="corrupt", chunk=0
        ),
        wire.Leave(worker_id="w0"),
    ):
        out[f"evil_{msg.type}_as_w0"] = ask(sock, msg)
    out["evil_leaves_as_itself"] = ask(sock, wire.Leave(worker_id="evil"), 1.0)
    return out


def leave_flood(t: Target, seconds: float = 20.0, rate: float = 40.0) -> dict[str, Any]:
    joined, _, _ = join_evil(t)
    stranger = t.dealer()
    got: Counter[str] = Counter()
    sent = 0
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        sock = joined if sent % 2 else stranger
        sock.send(wire.encode(wire.Leave(worker_id=f"w{sent % 2}")))
        if sent % 20 == 0:  # the insider stays alive while it floods
            joined.send(wire.encode(wire.Heartbeat(worker_id="evil", version=-1)))
        sent += 1
        got += drain(joined, 10**9, 0) + drain(stranger, 10**9, 0)
        time.sleep(max(0.0, t0 + sent / rate - time.monotonic()))
    got += drain(joined, 10**9, 1.0) + drain(stranger, 10**9, 1.0)
    return {"sent": sent, "seconds": seconds, "replies": dict(got)}


def future_chunks(t: Target, n: int = 60_000) -> dict[str, Any]:
    joined, _, ack = join_evil(t)
    future = max(ack.version, 0) + 1000
    frame = wire.encode(wire.ChunkRequest(version=future, index=0, rid=1))
    out: dict[str, Any] = {"future_version": future}
    t0 = time.monotonic()
    for who in ("joined", "unjoined"):
        sock = t.dealer(
            t.info["snapshot_endpoint"],
            keys=KeyPair.load(t.run_dir.parent / "evil.key") if who == "joined" else None,
        )
        got: Counter[str] = Counter()
        beat = 0.0
        for _ in range(0, n // 2, 1000):
            # 1 s per window: requests over a peer's rate are dropped unanswered by design
            got += flood(sock, frame, 1000, window=1000, timeout_s=1.0)
            if time.monotonic() - beat > 1.0:  # keep the insider's session (heartbeat timeout 5 s)
                beat = time.monotonic()
                joined.send(wire.encode(wire.Heartbeat(worker_id="evil", version=-1)))
                drain(joined, 10**9, 0)
        out[who] = dict(got)
        sock.close()
    # The next version is parked, not refused: at most max_parked_per_peer of it per key.
    sock = t.dealer(t.info["snapshot_endpoint"], keys=KeyPair.load(t.run_dir.parent / "evil.key"))
    nxt = wire.encode(wire.ChunkRequest(version=current_version(joined) + 1, index=0, rid=2))
    out["next_version_x2000"] = dict(flood(sock, nxt, 2000, window=2000, timeout_s=3.0))
    out["seconds"] = round(time.monotonic() - t0, 1)
    return out


def join_flood(t: Target, n: int = 10_000, batch: int = 250, hosts: int = 50) -> dict[str, Any]:
    """``n`` joins, each from a fresh key on a new connection, from ``hosts`` addresses; half
    carry no token, half a made-up one."""
    got: Counter[str] = Counter()
    t0 = time.monotonic()
    for start in range(0, n, batch):
        socks = []
        for i in range(start, min(n, start + batch)):
            s = t.dealer(src=f"127.0.1.{1 + i % hosts}")
            s.send(
                wire.encode(
                    wire.Join(
                        worker_id=f"sybil{i}",
                        can_relay=False,
                        token="" if i % 2 else f"echo_guess{i}",
                    )
                )
            )
            socks.append(s)
        poller = zmq.Poller()
        for s in socks:
            poller.register(s, zmq.POLLIN)
        answered = 0
        deadline = time.monotonic() + 0.5
        while answered < len(socks) and time.monotonic() < deadline:
            for s, _ in poller.poll(max(1, int(1000 * (deadline - time.monotonic())))):
                got[reason_of(s.recv())] += 1
                poller.unregister(s)
                answered += 1
        got["no_reply"] += len(socks) - answered
        for s in socks:
            s.close()
    return {"sent": n, "seconds": round(time.monotonic() - t0, 1), "replies": dict(got)}


def _health(url: str) -> str:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as r:
            return "ok" if json.loads(r.read()).get("ok") else "not ok"
    except Exception as exc:  # noqa: BLE001 - the outcome is the measurement
        return f"{type(exc).__name__}"


def idle_http(t: Target, n: int = 780) -> dict[str, Any]:
    """``n`` TCP connections opened at once to the dashboard, then left idle."""
    host, port = t.info["metrics"].removeprefix("http://").rsplit(":", 1)
    socks, failed = [], 0
    for _ in range(n):
        s = socket.socket()
        s.setblocking(False)
        s.bind((ATTACKER_HOST, 0))
        if s.connect_ex((host, int(port))) not in (0, errno.EINPROGRESS):
            failed += 1
        socks.append(s)
    time.sleep(1.0)
    during = _health(t.info["metrics"])
    time.sleep(11.0)  # past the server's 10 s idle timeout, the flood still held open
    later = _health(t.info["metrics"])
    closed_by_server = 0
    for s in socks:
        try:
            closed_by_server += s.recv(1) == b""
        except OSError:  # still open (BlockingIOError), reset, or never connected
            pass
        s.close()
    return {
        "connections": n,
        "connect_failed": failed,
        "closed_by_server": closed_by_server,
        "health_during_1s": during,
        "health_during_12s": later,
    }


def plaintext(t: Target) -> dict[str, Any]:
    plain = t.dealer(plaintext=True)
    wrong = t.dealer(server_key=KeyPair.generate().public)
    out = {}
    for name, s in (("plaintext_dealer", plain), ("wrong_server_key", wrong)):
        out[name] = ask(s, wire.Join(worker_id=name, can_relay=False, token=t.token), 2.0)
    return out


def oversize(t: Target) -> dict[str, Any]:
    limit = int(t.max_message_mib * MIB)
    out: dict[str, Any] = {"max_message_bytes": limit}
    sock = t.dealer()
    sock.send(b"\x00" * (limit + MIB))  # over the app limit, under the socket's hard cap
    out["control_limit_plus_1mib"] = next(iter(drain(sock, 1, 15.0)), "no_reply")
    sock.send(b"\x00" * (4 * limit + MIB))  # over the hard cap: libzmq drops the connection
    out["control_4x_limit_plus_1mib"] = next(iter(drain(sock, 1, 5.0)), "no_reply")
    sock.close()
    if t.relay:
        big = b"\x00" * (64 * MIB)
        relay = t.dealer(t.relay, server_key=t.relay_key)
        for _ in range(8):
            relay.send(big, copy=False)
        out["relay_8x64mib"] = next(iter(drain(relay, 1, 5.0)), "no_reply")
        relay.close()
    return out


def spellings_of(host: str) -> list[str]:
    """Other ways to write an IPv4 address that the C library reads as the same address
    (``127.1``, ``0x7f000001``, ``2130706433``, ``127.0.0.01``, ``127.000.000.001``)."""
    import ipaddress

    ip = ipaddress.IPv4Address(host)
    a, b, c, d = ip.packed
    return [
        f"{a}.{(b << 16) | (c << 8) | d}",
        hex(int(ip)),
        str(int(ip)),
        f"{a}.{b}.{c}.{d:o}".rsplit(".", 1)[0] + f".0{d:o}",
        ".".join(f"{x:03d}" for x in ip.packed),
    ]


def relay_spellings(t: Target) -> dict[str, Any]:
    """Issue 52: claim an honest relay's address (w0's) in another spelling of its host, and
    the unspecified address; each from a fresh key with the insider's token. Every join must
    be refused (``bad_endpoint``) without spending a use of the token."""
    from echo_rl.core.addresses import split_endpoint

    _, host, port = split_endpoint(t.relay)
    replies: dict[str, str] = {}
    for n, form in enumerate([*spellings_of(host), "0.0.0.0"]):
        sock = t.dealer(keys=KeyPair.generate())
        join = wire.Join(
            worker_id=f"spell{n}", relay_endpoint=f"tcp://{form}:{port}", token=t.token
        )
        replies[form] = ask(sock, join)
        sock.close()
    return {"relay": t.relay, "replies": replies}


def newest_version(name: str, sock: zmq.Socket) -> int:
    """The learner's newest version, from a heartbeat of ``name``'s session."""
    sock.send(wire.encode(wire.Heartbeat(worker_id=name, version=-1, rid=7)))
    deadline = time.monotonic() + 10
    while sock.poll(max(1, int(1000 * (deadline - time.monotonic())))):
        reply = wire.decode(sock.recv(), 1 << 24)
        if isinstance(reply, wire.HeartbeatAck) and reply.rid == 7:
            return reply.version
    raise RuntimeError(f"no heartbeat_ack for {name}")


def colluding_reporters(t: Target, keys: int = 2, seconds: float = 15.0) -> dict[str, Any]:
    """Issue 52, attack 1: ``keys`` workers joined with one leaked token report every source
    they are granted as ``timeout`` and take the next grant, walking the relays. No honest
    relay may be convicted; the learner's probes (one per counted report, bounded per
    witness) find them intact, and the token's keys lose the word together."""
    from echo_rl.control.gate import security_dir
    from echo_rl.core.security import TokenStore

    token = TokenStore(security_dir(t.run_dir) / "tokens.json").create(
        uses=keys, ttl_s=600, note="drill: a leaked token"
    )
    socks: dict[str, zmq.Socket] = {}
    for i in range(keys):
        name = f"colluder{keys}-{i}"
        sock = t.dealer(keys=KeyPair.generate())
        reply, deadline = "bad_token", time.monotonic() + 15
        while reply == "bad_token" and time.monotonic() < deadline:  # till the gate re-reads
            reply = ask(sock, wire.Join(worker_id=name, can_relay=False, token=token))
            if reply == "bad_token":
                time.sleep(0.5)
        if reply != "join_ack":
            return {"error": f"{name}'s join was refused: {reply}"}
        socks[name] = sock
    version = newest_version(*next(iter(socks.items())))
    source = {name: t.info["snapshot_endpoint"] for name in socks}
    granted: Counter[str] = Counter()
    replies: Counter[str] = Counter()
    sent, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        for name, sock in socks.items():
            msg = wire.SourceRequest(
                worker_id=name, version=version, bad_source=source[name], reason="timeout"
            )
            sock.send(wire.encode(msg))
            sent += 1
            while sock.poll(5000):
                reply = wire.decode(sock.recv(), 1 << 24)
                if isinstance(reply, wire.SourceGrant):
                    source[name] = reply.source
                    granted[reply.source] += 1
                    replies["source_grant"] += 1
                    break
                if isinstance(reply, wire.Error):
                    replies[reply.reason] += 1
                    if reply.reason == "unknown_version":  # a newer version went out
                        version = newest_version(name, sock)
                    break
            else:
                replies["no_reply"] += 1
        time.sleep(0.2)  # a report every 200 ms per key: 5 a second each
    for name, sock in socks.items():
        ask(sock, wire.Leave(worker_id=name), 1.0)
        sock.close()
    return {"keys": keys, "reports_sent": sent, "granted": dict(granted), "replies": dict(replies)}


def colluding_reporters_5(t: Target) -> dict[str, Any]:
    return colluding_reporters(t, keys=5)


ATTACKS: dict[str, Callable[[Target], dict[str, Any]]] = {
    f.__name__: f
    for f in (
        junk13,
        impersonate,
        leave_flood,
        future_chunks,
        join_flood,
        idle_http,
        plaintext,
        oversize,
        relay_spellings,
        colluding_reporters,
        colluding_reporters_5,
    )
}
