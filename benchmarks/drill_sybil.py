"""Sybils inside the documented limits (issue 31, item 5; docs/security.md, "Sybils"): the drill
case ``sybil_flood`` and its check, with the Target interface of ``benchmarks/drill_attacks.py``.

``sybil_flood(t)`` brings ``n`` fresh CurveZMQ keys, each on its own connection, that join in
open mode and then stay: every admitted key heartbeats once a second for ``hold_s`` seconds, and
half of them also report an install (so they become members: the plan, the provisioner), the
most a key can cost without delivering. ``hosts="one"`` sends them all from one address (the
prefix budget applies); ``hosts="many"`` from 1,000 addresses in as many /24 networks (only the
learner-wide limits apply: 50 joins/s, 1,024 sessions). It prints what came back, counted.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import zmq
from drill_attacks import ATTACKER_HOST, Target, reason_of

from echo_rl.core import wire


def _source(i: int, hosts: str) -> str:
    """One address, or each key from its own /24 (127.1.0.1, 127.1.1.1, ...)."""
    return ATTACKER_HOST if hosts == "one" else f"127.{1 + i // 256}.{i % 256}.1"


def _join_batch(
    t: Target, start: int, stop: int, hosts: str, got: Counter[str], wait_s: float, prefix: str
) -> list[tuple[zmq.Socket, str]]:
    """Joins ``start..stop``; returns the sockets (and ids) that got a join_ack."""
    socks = {}
    for i in range(start, stop):
        s = t.dealer(src=_source(i, hosts))
        s.send(wire.encode(wire.Join(worker_id=f"{prefix}{i}", can_relay=False)))
        socks[s] = f"{prefix}{i}"
    poller = zmq.Poller()
    for s in socks:
        poller.register(s, zmq.POLLIN)
    joined, answered = [], set()
    deadline = time.monotonic() + wait_s
    while len(answered) < len(socks) and time.monotonic() < deadline:
        for s, _ in poller.poll(max(1, int(1000 * (deadline - time.monotonic())))):
            reason = reason_of(s.recv())
            got[reason] += 1
            poller.unregister(s)
            answered.add(s)
            if reason == "join_ack":
                joined.append((s, socks[s]))
    got["no_reply"] += len(socks) - len(answered)
    for s in socks:
        if s not in {j for j, _ in joined}:
            s.close()
    return joined


def _beat(joined: list[tuple[zmq.Socket, str]], got: Counter[str], install: bool) -> None:
    for n, (s, wid) in enumerate(joined):
        s.send(wire.encode(wire.Heartbeat(worker_id=wid, version=-1)))
        if install and n % 2 == 0:  # half claim an install: members, the most a key costs
            s.send(wire.encode(wire.Installed(worker_id=wid, version=0)))
        while s.poll(0):
            got[f"later:{reason_of(s.recv())}"] += 1


def sybil_flood(
    t: Target,
    n: int = 1000,
    hosts: str = "one",
    hold_s: float = 30.0,
    batch: int = 100,
    wait_s: float = 0.5,
) -> dict[str, Any]:
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)  # a socket per admitted key
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 65536)), hard))
    t.ctx.setsockopt(zmq.MAX_SOCKETS, 65536)
    prefix = f"sybil-{hosts}-{n}-"  # ids of an earlier flood may still be held
    got: Counter[str] = Counter()
    t0 = time.monotonic()
    joined: list[tuple[zmq.Socket, str]] = []
    beat = 0.0
    for start in range(0, n, batch):
        joined += _join_batch(t, start, min(n, start + batch), hosts, got, wait_s, prefix)
        if time.monotonic() - beat > 1.0:  # the admitted keep their sessions meanwhile
            beat = time.monotonic()
            _beat(joined, got, install=False)
    join_s = time.monotonic() - t0
    end = time.monotonic() + hold_s
    first = True
    while time.monotonic() < end:
        _beat(joined, got, install=first)
        first = False
        time.sleep(min(1.0, max(0.0, end - time.monotonic())))
    for s, _ in joined:
        s.close()
    return {
        "sent": n,
        "hosts": hosts,
        "joined": len(joined),
        "join_s": round(join_s, 1),
        "seconds": round(time.monotonic() - t0, 1),
        "replies": dict(got),
    }


def check_sybil(r: dict[str, Any], baseline_steps_per_s: float | None = None) -> list[str]:
    """Problems in a ``sybil_flood`` phase record (the drill's shape: ``learner_alive``,
    ``steps_per_s``, ``honest_admitted``): the learner exits or stops, steps at less than half
    its honest rate, an honest worker delivers nothing, or more sessions than the limit."""
    out = []
    if not r.get("learner_alive", False):
        out.append("learner exited")
    base = baseline_steps_per_s or r.get("baseline_steps_per_s")
    if base and r.get("steps_per_s", 0) < 0.5 * base:
        out.append(f"steps/s {r.get('steps_per_s')} < half of {base}")
    adm = r.get("honest_admitted", {})
    if not adm or min(adm.values()) <= 0:
        out.append(f"an honest worker delivered nothing: {adm}")
    if r.get("attacker", {}).get("joined", 0) > r.get("max_workers", 1024):
        out.append("more Sybil sessions than security.max_workers")
    return out
