"""``echo-rl doctor``: from the operator's host, is the learner set up so that volunteers can
take part (docs/ports.md)? Each check prints a verdict and the fix.

Config: the address it hands out (``learner.public_host``; never a wildcard, and loopback or a
private address only reaches workers that can reach it), fixed ports, encryption. Then each
port of the layout: bound here (something Echo answers on the bind address), and reachable on
the public address (from this host: a firewall on this host or a cloud security group that
drops it shows; a router that does not loop back to its own public address shows as a failure
too, so the fix says to run ``echo-worker doctor LINE`` from another machine). Last, the
learner answers a ``doctor`` request on its public address with the key its join line pins.
The bound ports come from the run's ``learner.json``, the config from ``config.toml``.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import urllib.request
from pathlib import Path
from typing import Any

from broadcast.nat.reflect import NatError, pick_punch_port, probe
from echo import wire
from echo.addresses import canonical_host, is_loopback, is_wildcard, public_host_problem
from echo.config import EchoConfig, ListenPorts
from echo.doctor import Check, ask_learner, port_words, tcp_greeting
from echo.security import KeyPair, fingerprint

PORTS_DOC = "docs/ports.md"


def diagnose(cfg: EchoConfig, run_dir: Path | None) -> list[Check]:
    """The config's checks, then (when the run has a learner.json) every port's and the
    learner's own answer."""
    out = config_checks(cfg)
    if any(c.status == "fail" for c in out):
        return out
    info = _learner_json(run_dir)
    ports = _ports(cfg, info)
    local, public = _local_host(cfg), _announced(cfg)
    for key, port, kind in _layout(cfg, ports):
        out.append(_port_check(key, port, kind, local, public, cfg))
    if info is None:
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
                "not asked for its doctor answer: a port above failed, and the request "
                "would go the same way",
                "fix the failed ports first, then run echo-rl doctor again",
            )
        )
    else:
        out.append(_answer_check(info))
    return out


def config_checks(cfg: EchoConfig) -> list[Check]:
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
    out = [_address_check(host)]
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


def _address_check(host: str) -> Check:
    if is_loopback(host):
        return Check(
            "public address",
            "warn",
            f"workers are told {host}: only workers on this machine reach it",
            "for volunteers on other machines: --set "
            "learner.host=0.0.0.0 --set learner.public_host=PUBLIC_IP",
        )
    try:
        private = ipaddress.ip_address(canonical_host(host)).is_private
    except ValueError:
        private = False  # a DNS name: whoever resolves it
    if private:
        return Check(
            "public address",
            "warn",
            f"workers are told {host}, a private address: "
            f"only workers on the same network reach it",
            "for volunteers on the "
            "internet set learner.public_host to this machine's public IP or name",
        )
    return Check("public address", "ok", f"workers are told {host}")


def _learner_json(run_dir: Path | None) -> dict[str, Any] | None:
    path = run_dir / "learner.json" if run_dir is not None else None
    if path is None or not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _ports(cfg: EchoConfig, info: dict[str, Any] | None) -> ListenPorts:
    """The ports the learner bound (learner.json), else the ones the config fixes."""
    ports = cfg.listen_ports()
    if info is None:
        return ports
    p = info.get("ports") or {}
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


def _port_check(key: str, port: int, kind: str, local: str, public: str, cfg: EchoConfig) -> Check:
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
    status, far, _ = _probe(kind, public, port)
    if status == "ok":
        return Check(key, "ok", f"bound on {local}, and {far}")
    return Check(
        key,
        "fail",
        f"bound on {local}, but on the public address: {far}",
        f"open TCP {port} to workers in this host's firewall (ufw allow "
        f"{port}/tcp) and the cloud's security group; check that learner.public_host "
        f"({public}) is this machine's address. A router or 1:1 NAT that does not "
        f"loop back shows here too: then run echo-worker doctor LINE from another "
        f"machine ({PORTS_DOC})",
    )


def _probe(kind: str, host: str, port: int) -> tuple[str, str, str]:
    """(status, verdict, what the probe found: ``tcp_greeting``'s word)."""
    if kind == "reflector":
        return _reflector(host, port)
    found = tcp_greeting(host, port)
    return (*port_words(found, host, port, "ZeroMQ"), found)


def _reflector(host: str, port: int) -> tuple[str, str, str]:
    """A real NAT probe, as a worker sends it: the reflector answers with what it saw."""

    async def one() -> dict:
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


def _answer_check(info: dict[str, Any]) -> Check:
    """The learner answers a doctor request on its public endpoint, with the key its join
    line carries."""
    key = (info.get("public_key") or "").encode() or None
    reply, why = asyncio.run(
        ask_learner(info["endpoint"], key, KeyPair.generate() if key else None)
    )
    if isinstance(reply, wire.DoctorAck):
        named = f"key fingerprint {fingerprint(key)}" if key else "plaintext"
        return Check(
            "learner",
            "ok",
            f"answers at {info['endpoint']} ({named}): run "
            f"{reply.run_id}, snapshot v{reply.version}, joining: {reply.join}; "
            f"volunteers join with: echo-worker join '{info.get('join', '')}'",
        )
    if isinstance(reply, wire.Error):
        return Check(
            "learner",
            "ok",
            f"answers at {info['endpoint']} (refused the check: {reply.reason}; an older learner?)",
        )
    if "refused this worker's key" in why:  # allowlist: it judged the check's throwaway key
        return Check(
            "learner",
            "ok",
            f"answers at {info['endpoint']} with its key, and refuses "
            f"keys it does not know (security.join = allowlist)",
        )
    return Check(
        "learner",
        "fail",
        f"no answer at {info['endpoint']}: {why}",
        "the learner in this run folder is not the one listening: restart it, or "
        "point --run-dir at the run that is running",
    )
