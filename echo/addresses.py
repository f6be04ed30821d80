"""Addresses the learner binds, hands out and compares: one notion of each.

A socket is *bound* on ``learner.host`` (possibly a wildcard: every interface); every endpoint
the learner hands to a worker (join line, snapshot source, reflectors, learner.json) names the
learner's *public* host instead (``learner.public_host``, or ``host`` when that is unset), with
the bound port. A wildcard is never handed out: no worker can connect to 0.0.0.0.

Endpoints are compared in canonical form (``canonical_endpoint``): ``localhost`` and
``127.0.0.1`` are the same host, IPv6 is written one way, case and a trailing dot in a DNS name
do not matter. Nothing here resolves a name: pure string functions, cheap on any thread.
"""

from __future__ import annotations

import ipaddress

WILDCARDS = frozenset({"", "*", "0.0.0.0", "::", "[::]"})
LOCALHOST = "localhost"


def is_wildcard(host: str) -> bool:
    """Binds every interface; an address no peer can connect to."""
    return host.strip().lower() in WILDCARDS


def canonical_host(host: str) -> str:
    """``localhost`` -> ``127.0.0.1``; IP addresses in their compressed form, without
    brackets; names lower-case without a trailing dot."""
    h = host.strip().lower().removeprefix("[").removesuffix("]").rstrip(".")
    if h == LOCALHOST or h.endswith("." + LOCALHOST):
        return "127.0.0.1"
    try:
        ip = ipaddress.ip_address(h)
    except ValueError:
        return h
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped  # ::ffff:127.0.0.1 is 127.0.0.1
    return str(ip)


def is_loopback(host: str) -> bool:
    h = canonical_host(host)
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False


def _is_ipv6(host: str) -> bool:
    try:
        return isinstance(ipaddress.ip_address(host), ipaddress.IPv6Address)
    except ValueError:
        return False


def split_endpoint(endpoint: str) -> tuple[str, str, str]:
    """``tcp://HOST:PORT`` -> (scheme, host, port); host without brackets. A missing scheme or
    port is returned empty."""
    scheme, sep, rest = endpoint.partition("://")
    if not sep:
        scheme, rest = "", endpoint
    host, colon, port = rest.rpartition(":")
    if not colon or not port.isdigit():
        host, port = rest, ""
    return scheme, host.removeprefix("[").removesuffix("]"), port


def join_endpoint(scheme: str, host: str, port: str | int) -> str:
    h = f"[{host}]" if ":" in host else host  # IPv6 in brackets
    head = f"{scheme}://" if scheme else ""
    return f"{head}{h}:{port}" if str(port) else f"{head}{h}"


def canonical_endpoint(endpoint: str) -> str:
    """One spelling per endpoint, for comparing: ``tcp://localhost:5555`` and
    ``tcp://127.0.0.1:5555`` compare equal, ``TCP://[::1]:5555`` and ``tcp://[::1]:5555`` too."""
    scheme, host, port = split_endpoint(endpoint.strip())
    return join_endpoint(scheme.lower(), canonical_host(host), port)


def same_endpoint(a: str, b: str) -> bool:
    return canonical_endpoint(a) == canonical_endpoint(b)


def public_host_problem(host: str, public_host: str) -> str:
    """Why binding ``host`` and announcing ``public_host`` would hand workers an address they
    cannot use ("" when it is fine), phrased with the key to set and the fix."""
    if public_host:
        if "://" in public_host or "/" in public_host:
            return (
                f"learner.public_host={public_host!r} must be a host name or IP address only "
                f"(no scheme, port or path; the port is learner.port): e.g. "
                f"--set learner.public_host=203.0.113.7"
            )
        if is_wildcard(public_host):
            return (
                f"learner.public_host={public_host!r} is a wildcard, not an address workers "
                f"can connect to: set it to this machine's public IP or DNS name"
            )
        bare = public_host.removeprefix("[").removesuffix("]")
        if ":" in bare and not _is_ipv6(bare):
            return (
                f"learner.public_host={public_host!r} must not carry a port (the port is "
                f"learner.port): write the host alone, e.g. 203.0.113.7"
            )
        return ""
    if is_wildcard(host):
        return (
            f"learner.host={host!r} binds every interface, and workers cannot connect to "
            f"{host or '0.0.0.0'!r}: set learner.public_host to the address workers reach this "
            f"machine at (its public IP or DNS name, e.g. --set learner.public_host=203.0.113.7), "
            f"or bind learner.host to that address itself"
        )
    return ""


def public_endpoint(bound: str, host: str, public_host: str) -> str:
    """The endpoint a worker is handed for a socket bound at ``bound`` (its LAST_ENDPOINT, on
    ``host``): the public host with the bound port. Raises ValueError, naming the key to set,
    rather than hand out a wildcard."""
    problem = public_host_problem(host, public_host)
    scheme, bound_host, port = split_endpoint(bound)
    announced = (public_host or bound_host).removeprefix("[").removesuffix("]")
    if not problem and is_wildcard(announced):
        problem = public_host_problem(announced, "")
    if problem:
        raise ValueError(problem)
    return join_endpoint(scheme, announced, port)
