"""``echo-worker doctor LINE``: from a volunteer's host, before (or beside) joining, can this
worker take part, and if not, what to do (docs/volunteers.md, docs/ports.md).

In order, each check printing a verdict and the fix: the learner's control port answers (a
ZeroMQ greeting, not just an open port); the learner holds the key the join line pins (a CURVE
handshake and a ``doctor`` request, which joins nothing and spends no token), and will take
this worker (not banned; a token when it wants one); its snapshot port answers; its two NAT
reflectors answer a probe, and what class of NAT this host is behind (the learner's own rule,
``echo_rl.broadcast.nat.reflect.nat_class``); for a public relay (``--relay-host`` not loopback), whether
the learner can connect back to the relay port. A relay port not checked (a relay on loopback,
no reflectors, a probe that failed) is printed as skipped, with the reason.
"""

from __future__ import annotations

import asyncio

from echo_rl.broadcast.nat.reflect import (
    NatError,
    Observation,
    nat_class,
    pick_punch_port,
    probe,
)
from echo_rl.core import wire
from echo_rl.core.addresses import split_endpoint
from echo_rl.core.doctor import Check, ask_learner, port_words, tcp_greeting
from echo_rl.core.security import JoinLine, KeyPair, fingerprint
from echo_rl.worker.unreachable import checks as learner_checks

PORTS_DOC = "docs/ports.md"


async def diagnose(
    line: JoinLine,
    keys: KeyPair | None,
    relay_host: str,
    relay_port: int | None,
    punch_host: str,
) -> list[Check]:
    """Every check that applies, stopping where the rest cannot be asked. ``relay_port``:
    the fixed port a public relay listens on (its dial-back is checked), None for a relay
    on loopback behind a router (it relays through punched links, if at all)."""
    _, host, port = split_endpoint(line.endpoint)
    found = await asyncio.to_thread(tcp_greeting, host, int(port))
    status, verdict = port_words(found, host, int(port), "the learner's control port, learner.port")
    out = [
        Check(
            "learner port",
            status,
            verdict,
            learner_checks(line.endpoint) + "; on the learner's host `echo-rl doctor "
            "--run-dir RUN` checks the same ports from there",
        )
    ]
    if status == "fail":
        return out
    reply, why = await ask_learner(line.endpoint, line.server_key, keys)
    out.append(_key_check(line, reply, why))
    if not isinstance(reply, wire.DoctorAck):
        return out
    out.append(await _snapshot_check(reply.snapshot_endpoint))
    out += await _nat_checks(reply.reflectors, relay_host, relay_port, punch_host)
    return out


def _key_check(line: JoinLine, reply: wire.Message | None, why: str) -> Check:
    if reply is None:
        return Check(
            "learner key",
            "fail",
            why or "the learner did not answer a request",
            "copy the join line the learner printed again, whole and in single "
            "quotes (its key is the part after the port)",
        )
    if isinstance(reply, wire.Error) and reply.reason == "unknown_type":
        return Check(
            "learner key",
            "warn",
            "the learner holds the key in the join line, but "
            "is older than this echo-worker (it does not know the doctor's request): "
            "its snapshot port and reflectors are not checked",
            "nothing, to join; the same echo-rl version on both sides checks everything",
        )
    if isinstance(reply, wire.Error):
        fix = (
            "ask the learner's operator why (echo-rl workers lists bans), or use the key "
            "they registered (--identity FILE)"
            if reply.reason == "banned"
            else "try again in a minute; ask the learner's operator if it stays"
        )
        return Check(
            "learner key",
            "fail",
            f"the learner refused this worker: {reply.reason}: {reply.detail}",
            fix,
        )
    assert isinstance(reply, wire.DoctorAck)  # a doctor request's answer, or an Error
    named = (
        f"the learner holds the key in the join line (fingerprint "
        f"{fingerprint(line.server_key)}) and answers: run {reply.run_id}, snapshot "
        f"v{reply.version}"
        if line.server_key
        else f"a plaintext learner answers: run {reply.run_id}, snapshot v{reply.version}"
    )
    if reply.join == "token" and not line.token:
        return Check(
            "learner key",
            "fail",
            named + "; it admits workers by token, and this join line carries none",
            "ask the operator for a token (echo-rl token "
            "create) and join with 'echo://...?token=TOKEN' or --token TOKEN",
        )
    return Check("learner key", "ok", named + f"; joining: {reply.join}")


async def _snapshot_check(endpoint: str) -> Check:
    _, host, port = split_endpoint(endpoint)
    found = await asyncio.to_thread(tcp_greeting, host, int(port))
    status, verdict = port_words(found, host, int(port), "snapshot chunks, learner.chunk_port")
    return Check(
        "snapshot port",
        status,
        verdict,
        f"the learner's operator opens TCP {port} to workers (learner.chunk_port) and "
        f"sets learner.public_host to an address workers reach: without it a worker "
        f"joins but never receives a snapshot ({PORTS_DOC})",
    )


async def _nat_checks(
    reflectors: list[str], relay_host: str, relay_port: int | None, punch_host: str
) -> list[Check]:
    public = relay_port is not None
    if len(reflectors) < 2:
        return [
            Check(
                "NAT",
                "warn",
                "the learner runs without its NAT reflectors "
                "(broadcast.nat_traversal off): this worker relays only if its relay port "
                "is reachable, else it is a chain tail",
                "nothing to do here; the operator may turn broadcast.nat_traversal on",
            ),
            _relay_skipped(
                relay_host,
                public,
                "the learner's NAT reflector is what connects back to it, and this learner "
                "runs none",
                "none needed to join; with broadcast.nat_traversal on, the learner checks it",
            ),
        ]
    async with RelayListener(relay_host, relay_port) as dial_port:
        try:
            obs = await _probe_both(reflectors, punch_host, dial_port)
        except NatError as exc:
            host = reflectors[0].rpartition(":")[0]  # as the learner hands it out
            return [
                Check(
                    "NAT",
                    "fail",
                    f"{exc}: this worker will not relay (the learner "
                    f"feeds it itself; the run works, its uplink carries more)",
                    f"the learner's operator opens TCP "
                    f"{' and '.join(r.rpartition(':')[2] for r in reflectors[:2])} to workers "
                    f"on {host}, the address the learner hands out (learner.public_host, else "
                    f"learner.host): in that host's firewall and, behind a cloud's 1:1 NAT, "
                    f"its security group (learner.reflector_ports, {PORTS_DOC})",
                ),
                _relay_skipped(
                    relay_host,
                    public,
                    "the learner's NAT reflector connects back to it, and the reflector did "
                    "not answer (NAT above)",
                    "fix the NAT check first: the relay port is checked with it",
                ),
            ]
    relay = f"tcp://{relay_host}:{dial_port}"
    nat, seen = nat_class(obs[0], obs[1], relay)
    checks = [_nat_words(nat, seen)]
    checks.append(
        _relay_words(obs[0], relay_host, dial_port) if public else _relay_skipped(relay_host)
    )
    return checks


def _relay_skipped(relay_host: str, public: bool = False, why: str = "", fix: str = "") -> Check:
    """The relay port's check, not run: why, and how to have it run."""
    if not public:
        return Check(
            "relay port",
            "skip",
            f"not checked: --relay-host {relay_host} is loopback (the default behind a home "
            f"router), so nobody connects to the relay port directly; the relay works through "
            f"punched links if the NAT verdict above allows",
            "nothing to do behind a home router; on a public address, run doctor with "
            "--relay-host YOUR_PUBLIC_IP to check the relay port",
        )
    return Check("relay port", "skip", f"not checked: {why}", fix)


def _nat_words(nat: str, seen: str) -> Check:
    if nat == "reachable":
        return Check(
            "NAT",
            "ok",
            f"reachable: peers connect to this worker's relay directly (seen as {seen})",
        )
    if nat == "punchable":
        return Check(
            "NAT",
            "ok",
            f"punchable: the NAT keeps one mapping per port (seen as "
            f"{seen}), so this worker relays through punched links (docs/nat.md)",
        )
    return Check(
        "NAT",
        "warn",
        f"symmetric NAT (a new public port per destination, first "
        f"seen as {seen}): this worker will be a chain tail and relay nothing; "
        f"it still generates",
        "nothing is needed to take part; to relay, use a "
        "router with endpoint-independent mapping, or a public --relay-host",
    )


def _relay_words(dial: Observation, relay_host: str, port: int) -> Check:
    if dial.dialed and dial.ip == relay_host:
        return Check(
            "relay port",
            "ok",
            f"the learner connected back to {relay_host} port "
            f"{port}: chain children reach this worker's relay",
        )
    if dial.dialed:
        return Check(
            "relay port",
            "fail",
            f"--relay-host {relay_host}, but the learner sees "
            f"this host as {dial.ip} (and reached port {port} there)",
            f"join with --relay-host {dial.ip}",
        )
    return Check(
        "relay port",
        "fail",
        f"the learner could not connect to {dial.ip} port {port} "
        f"(the address it saw this host at): no chain child can reach the relay",
        f"open TCP {port} to the internet on this host's firewall and router "
        f"(--relay-port, {PORTS_DOC}), or leave --relay-host at its default behind a "
        f"home router: the relay then works through punched links",
    )


class RelayListener:
    """A listener on the relay port while the learner dials back: accepts and closes. A port
    already held (this host's worker running) is probed as it is."""

    def __init__(self, host: str, port: int | None):
        self.host, self.port = host, port
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> int:
        if self.port is None:
            return 0
        try:
            self.server = await asyncio.start_server(_hang_up, self.host, self.port)
            port: int = self.server.sockets[0].getsockname()[1]
            return port
        except OSError:
            return self.port  # taken: a running worker's relay answers the dial-back

    async def __aexit__(self, *exc: object) -> None:
        if self.server is not None:
            self.server.close()


async def _hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.close()


async def _probe_both(reflectors: list[str], host: str, dial: int) -> list[Observation]:
    """Both reflectors probed from one punch port: what each saw, as the learner records it."""
    port = pick_punch_port(host)
    obs = []
    for i, r in enumerate(reflectors[:2]):
        _, reply = await probe(r, host, port, dial if i == 0 else 0, timeout_s=3.0)
        try:
            obs.append(
                Observation(
                    str(reply["ip"]), int(reply["port"]), i, bool(reply.get("dialed")), dial, 0.0
                )
            )
        except (KeyError, TypeError, ValueError):
            raise NatError(f"reflector {r} sent a reply without an address") from None
    return obs
