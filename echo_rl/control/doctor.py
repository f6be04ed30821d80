"""``echo-rl doctor``: from the operator's host, is the learner set up so that volunteers can
take part (docs/ports.md)? Each check prints a verdict and the fix.

Config: the address it hands out (``learner.public_host``; never a wildcard; loopback reaches
only this machine, and a private address fails unless ``--lan`` says the fleet is on this
network). Then each port of the layout: bound here (something Echo answers on the bind
address), and reachable on the public address. When the public address is one of this host's,
a failure there is this host's firewall or a wrong address. When it is not (a cloud's 1:1 NAT,
a port forward: no connection from here loops back), the doctor says so instead of failing,
and passes on what the learner saw of its workers from outside (``wire.DoctorAck``,
``echo_rl/control/outside.py``): joins and NAT probes from public addresses, installs, and the workers'
reports of a closed chunk port. Last, the learner answers a ``doctor`` request with the key
its join line pins (on its bound address when the public one does not loop back). The bound
ports come from the run's ``learner.json``, the config from ``config.toml``.
"""

from __future__ import annotations

import asyncio
import json
import socket
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict

from echo_rl.broadcast.nat.reflect import NatError, pick_punch_port, probe
from echo_rl.core import wire
from echo_rl.core.addresses import (
    canonical_host,
    is_loopback,
    is_wildcard,
    public_host_problem,
    reach,
)
from echo_rl.core.config import EchoConfig, ListenPorts
from echo_rl.core.doctor import Check, ask_learner, port_words, tcp_greeting
from echo_rl.core.security import KeyPair, fingerprint

PORTS_DOC = "docs/ports.md"


class BoundPorts(TypedDict, total=False):
    """learner.json's ``ports``: what the learner bound (``LearnerServer.bound_ports``, and
    the dashboard's)."""

    control: int
    chunks: int
    reflectors: list[int]
    metrics: int


class LearnerInfo(TypedDict, total=False):
    """What the doctor reads of a run's learner.json (written by echo_rl.learner.startup)."""

    endpoint: str
    public_key: str
    join: str
    ports: BoundPorts


# The learner's answer to a doctor request (None: none came), why not, and where it was asked.
Asked = tuple[wire.Message | None, str, str]


def diagnose(cfg: EchoConfig, run_dir: Path | None, lan: bool = False) -> list[Check]:
    """The config's checks, then (when the run has a learner.json) every port's and the
    learner's own answer. ``lan``: the workers are on this network (a private address is
    then what they should be told)."""
    out = config_checks(cfg, lan)
    if any(c.status == "fail" for c in out):
        return out
    info = _learner_json(run_dir)
    ports = _ports(cfg, info)
    where = Where(_local_host(cfg), _announced(cfg))
    asked = _ask(info, where, ports.control) if info is not None else None
    ack = asked[0] if asked is not None and isinstance(asked[0], wire.DoctorAck) else None
    for key, port, kind in _layout(cfg, ports):
        out.append(_port_check(key, port, kind, where, cfg, ack))
    if info is None or asked is None:
        out.append(
            Check(
                "learner",
                "fail",
                f"no learner.json in {run_dir}: the learner has not started in this run folder",
                "start it: echo-rl learn CONFIG "
                "--run-dir RUN, then run echo-rl doctor --run-dir RUN",
            )
        )
    elif any(c.status == "fail" for c in out[1:]):
        out.append(
            Check(
                "learner",
                "skip",
                "not judged: a port above failed (its answer, if any, is not the path "
                "workers take)",
                "fix the failed ports first, then run echo-rl doctor again",
            )
        )
    else:
        out.append(_answer_check(info, asked))
    return out


@dataclass(frozen=True)
class Where:
    """Where the doctor runs against the addresses in the config: ``local``, an address the
    learner is bound on here; ``public``, the one workers are told. ``here``: ``public`` is an
    address of this host (or the same as ``local``); False behind a 1:1 NAT or a router's port
    forward, where a connection from this host to ``public`` does not come back in."""

    local: str
    public: str

    @property
    def here(self) -> bool:
        return canonical_host(self.public) == canonical_host(self.local) or on_this_host(
            self.public
        )


def on_this_host(host: str) -> bool:
    """Is ``host`` an address of one of this machine's interfaces (can a socket bind it)? A
    name is resolved; one that does not resolve is not here."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, _, _, _, addr in infos:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            try:
                s.bind((addr[0], 0))
                return True
            except OSError:
                continue
    return False


def config_checks(cfg: EchoConfig, lan: bool = False) -> list[Check]:
    lc = cfg.learner
    problem = public_host_problem(lc.host, lc.public_host)
    if problem:
        return [
            Check(
                "public address",
                "fail",
                problem,
                "set learner.public_host (or learner.host) as the message says; docs/ports.md",
            )
        ]
    host = _announced(cfg)
    out = [_address_check(host, lan)]
    ports = cfg.listen_ports()
    if not is_loopback(lc.host) and not all([ports.control, ports.chunks, *ports.reflectors]):
        out.append(
            Check(
                "ports",
                "warn",
                "some ports are left to the OS (0): they change at "
                "every start, so no firewall rule or port forward can be written "
                "before the run",
                "set learner.port (5555: the layout follows, docs/ports.md)",
            )
        )
    else:
        out.append(
            Check(
                "ports",
                "ok",
                f"control {ports.control or 'OS-picked'}, chunks "
                f"{ports.chunks or 'OS-picked'}, reflectors {ports.reflectors[0] or '-'}/"
                f"{ports.reflectors[1] or '-'}, dashboard {ports.metrics or '-'}",
            )
        )
    if not cfg.security.curve and not is_loopback(lc.host):
        out.append(
            Check(
                "encryption",
                "warn",
                "security.curve is off on a non-loopback "
                "address: anyone can impersonate any worker",
                "turn security.curve on (the default) unless this network is private",
            )
        )
    if cfg.metrics.enabled and not is_loopback(cfg.metrics.host):
        out.append(
            Check(
                "dashboard",
                "warn",
                f"metrics.host={cfg.metrics.host!r}: the "
                f"dashboard and /metrics are unauthenticated and readable from "
                f"the network",
                "keep metrics.host on 127.0.0.1 (an SSH tunnel reaches it) or a private network",
            )
        )
    return out


def _address_check(host: str, lan: bool) -> Check:
    where = reach(host)
    if where == "loopback":
        return Check(
            "public address",
            "warn",
            f"workers are told {host}: only workers on this machine reach it",
            "for volunteers on other machines: --set "
            "learner.host=0.0.0.0 --set learner.public_host=PUBLIC_IP",
        )
    if where == "private" and lan:
        return Check(
            "public address",
            "ok",
            f"workers are told {host}, a private address: workers on this network reach it (--lan)",
        )
    if where == "private":
        return Check(
            "public address",
            "fail",
            f"workers are told {host}, a private address: volunteers outside this network "
            f"cannot reach it",
            "set learner.public_host to the address the internet reaches this machine at "
            "(behind a cloud's 1:1 NAT: its public IP, which is on no interface here; keep "
            "learner.host at 0.0.0.0). For a fleet on this network only, run echo-rl doctor "
            f"--lan ({PORTS_DOC})",
        )
    return Check("public address", "ok", f"workers are told {host}")


def _learner_json(run_dir: Path | None) -> LearnerInfo | None:
    path = run_dir / "learner.json" if run_dir is not None else None
    if path is None or not path.exists():
        return None
    try:
        info: LearnerInfo = json.loads(path.read_text())  # what the learner wrote
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


def _ports(cfg: EchoConfig, info: LearnerInfo | None) -> ListenPorts:
    """The ports the learner bound (learner.json), else the ones the config fixes."""
    ports = cfg.listen_ports()
    if info is None:
        return ports
    p: BoundPorts = info.get("ports") or {}
    refl = p.get("reflectors") or [0, 0]
    return ListenPorts(
        int(p.get("control", 0)),
        int(p.get("chunks", 0)),
        (int(refl[0]), int(refl[1])),
        int(p.get("metrics", 0)),
    ).reusing(ports)


def _layout(cfg: EchoConfig, ports: ListenPorts) -> list[tuple[str, int, str]]:
    """(config key, port, kind) of each socket this config opens."""
    out = [("learner.port", ports.control, "zmq"), ("learner.chunk_port", ports.chunks, "zmq")]
    if cfg.broadcast.nat_traversal:
        out += [
            (f"learner.reflector_ports[{i}]", p, "reflector")
            for i, p in enumerate(ports.reflectors)
        ]
    if cfg.metrics.enabled:
        out.append(("metrics.port", ports.metrics, "http"))
    return out


def _local_host(cfg: EchoConfig) -> str:
    return "127.0.0.1" if is_wildcard(cfg.learner.host) else cfg.learner.host


def _announced(cfg: EchoConfig) -> str:
    return cfg.learner.public_host or cfg.learner.host


def _port_check(
    key: str, port: int, kind: str, where: Where, cfg: EchoConfig, ack: wire.DoctorAck | None
) -> Check:
    local, public = where.local, where.public
    if not port:
        return Check(
            key,
            "warn",
            "left to the OS and the learner has not recorded one",
            "start the learner, or fix the port (docs/ports.md)",
        )
    if kind == "http":  # the dashboard is for the operator: on metrics.host only
        return _http_check(
            key, cfg.metrics.host if not is_wildcard(cfg.metrics.host) else local, port
        )
    status, verdict, found = _probe(kind, local, port)
    if found == "timeout":  # a listener refuses or answers; silence is a rule dropping packets
        return Check(
            key,
            "fail",
            f"{verdict}: a firewall on this host drops connections to "
            f"port {port}, even from the host itself",
            f"allow TCP {port} in this host's firewall (ufw allow {port}/tcp; "
            f"iptables -S INPUT lists the rule that drops it), then run echo-rl doctor "
            f"again ({PORTS_DOC})",
        )
    if status == "fail":
        return Check(
            key,
            "fail",
            f"{verdict}: the learner is not running, or not on this port",
            f"start it (echo-rl learn CONFIG --run-dir RUN); if another program holds "
            f"port {port}, set {key} to a free port ({PORTS_DOC})",
        )
    if canonical_host(public) == canonical_host(local):
        return Check(key, "ok", verdict)
    status, far, found = _probe(kind, public, port)
    if status == "ok":
        return Check(key, "ok", f"bound on {local}, and {far}")
    if not where.here:
        return _outside_check(key, port, kind, where, ack)
    if found == "refused":  # an address of this host the sockets are not bound on
        return Check(
            key,
            "fail",
            f"bound on {local}, but on the public address, one of this host's own: {far}",
            f"learner.public_host ({public}) names an address the learner does not listen "
            f"on: set learner.host=0.0.0.0 (every interface), or learner.public_host to "
            f"{local} ({PORTS_DOC})",
        )
    return Check(
        key,
        "fail",
        f"bound on {local}, but on the public address, one of this host's own: {far}",
        f"open TCP {port} to workers in this host's firewall (ufw allow "
        f"{port}/tcp; iptables -S INPUT lists the rule that drops it), then check "
        f"learner.public_host ({public}) ({PORTS_DOC})",
    )


def _outside_check(
    key: str, port: int, kind: str, where: Where, ack: wire.DoctorAck | None
) -> Check:
    """``public`` is not an address of this host (a 1:1 NAT, a port forward) and this host's
    connection to it did not come back in, as such NATs do: what it says about workers is
    only what the learner saw of them (``wire.DoctorAck``, echo_rl/control/outside.py)."""
    head = (
        f"bound on {where.local}; {where.public} is not an address of this host (a cloud's "
        f"1:1 NAT or a port forward) and a connection from here to it does not loop back"
    )
    chunks = key == "learner.chunk_port"
    if chunks and ack is not None and ack.snapshot_path:
        return Check(
            key,
            "fail",
            f"{head}; the learner says: {ack.snapshot_path}",
            f"open TCP {port} to this host in the cloud's security group or the router's "
            f"forward, as for the other ports ({PORTS_DOC})",
        )
    seen = 0 if ack is None else ack.outside_installed if chunks else ack.outside_joined
    if seen:
        did = {
            "learner.chunk_port": "installed snapshots fed from it (directly or through "
            "their relays)",
            "learner.port": "joined through it",
        }.get(key, "had their NAT probe answered on it")
        return Check(
            key,
            "ok",
            f"{seen} worker(s) from outside {did} (as the learner saw them: {where.public} is "
            f"not an address of this host and does not loop back, a 1:1 NAT)",
        )
    return Check(
        key,
        "skip",
        f"{head}, and no worker from outside has used port {port} yet: only a machine "
        f"outside can tell whether it is open",
        "run echo-worker doctor 'JOIN LINE' on a machine outside this network, or run "
        "echo-rl doctor again once a volunteer has joined: it then reads what the learner "
        f"saw of its ports ({PORTS_DOC})",
    )


def _probe(kind: str, host: str, port: int) -> tuple[str, str, str]:
    """(status, verdict, what the probe found: ``tcp_greeting``'s word)."""
    if kind == "reflector":
        return _reflector(host, port)
    found = tcp_greeting(host, port)
    return (*port_words(found, host, port, "ZeroMQ"), found)


def _reflector(host: str, port: int) -> tuple[str, str, str]:
    """A real NAT probe, as a worker sends it: the reflector answers with what it saw."""

    async def one() -> dict[str, object]:
        _, reply = await probe(
            f"{host}:{port}", "0.0.0.0", pick_punch_port("0.0.0.0"), 0, timeout_s=3.0
        )
        return reply

    try:
        reply = asyncio.run(one())
    except NatError as exc:
        found = "refused" if isinstance(exc.__cause__, ConnectionRefusedError) else "timeout"
        return (*port_words(found, host, port, "a NAT reflector"), found)
    return (
        "ok",
        f"{host} port {port} answers a NAT probe (saw this host as {reply.get('ip')})",
        "ok",
    )


def _http_check(key: str, host: str, port: int) -> Check:
    url = f"http://{host}:{port}/health"
    try:
        with urllib.request.urlopen(url, timeout=3.0) as r:
            r.read()
        return Check(key, "ok", f"the dashboard answers at http://{host}:{port}")
    except OSError as exc:
        return Check(
            key,
            "warn",
            f"no dashboard at {url} ({exc}): training is unaffected",
            f"start the learner, or free port {port} (metrics.port)",
        )


def _ask(info: LearnerInfo, where: Where, control: int) -> Asked:
    """The learner's answer to a doctor request with the key its join line pins: (reply,
    why not, endpoint asked). On its public endpoint when that is an address of this host,
    else on the bound one (behind a 1:1 NAT the public one does not loop back)."""
    key = (info.get("public_key") or "").encode() or None
    endpoint = info["endpoint"]
    if not where.here and control:
        endpoint = f"tcp://{where.local}:{control}"
    reply, why = asyncio.run(ask_learner(endpoint, key, KeyPair.generate() if key else None))
    return reply, why, endpoint


def _answer_check(info: LearnerInfo, asked: Asked) -> Check:
    """The learner answers a doctor request, with the key its join line carries."""
    reply, why, endpoint = asked
    key = (info.get("public_key") or "").encode() or None
    if isinstance(reply, wire.DoctorAck):
        named = f"key fingerprint {fingerprint(key)}" if key else "plaintext"
        return Check(
            "learner",
            "ok",
            f"answers at {endpoint} ({named}): run "
            f"{reply.run_id}, snapshot v{reply.version}, joining: {reply.join}; "
            f"volunteers join with: echo-worker join '{info.get('join', '')}'",
        )
    if isinstance(reply, wire.Error):
        return Check(
            "learner",
            "ok",
            f"answers at {endpoint} (refused the check: {reply.reason}; an older learner?)",
        )
    if "refused this worker's key" in why:  # allowlist: it judged the check's throwaway key
        return Check(
            "learner",
            "ok",
            f"answers at {endpoint} with its key, and refuses "
            f"keys it does not know (security.join = allowlist)",
        )
    return Check(
        "learner",
        "fail",
        f"no answer at {endpoint}: {why}",
        "the learner in this run folder is not the one listening: restart it, or "
        "point --run-dir at the run that is running",
    )
