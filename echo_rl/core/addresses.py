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


# Addresses that reach only a local network: RFC 1918, shared address space (carrier-grade
# NAT), link-local, IPv6 unique-local and link-local. Python's ``is_private`` also counts the
# documentation ranges (192.0.2.0/24, 198.51.100.0/24, 203.0.113.0/24, 2001:db8::/32), which
# stand for public addresses in examples and in the NAT lab: here they are public.
LOCAL_NETS = tuple(
    ipaddress.ip_network(n)
    for n in (
        "10.0.0.0/8",
        "172.16.0.0/12",
        "192.168.0.0/16",
        "100.64.0.0/10",
        "169.254.0.0/16",
        "fc00::/7",
        "fe80::/10",
    )
)


def reach(host: str) -> str:
    """Who can reach ``host``: ``loopback`` (this machine), ``private`` (its network: a LAN, a
    cloud VPC, behind a carrier-grade NAT), ``public`` (an IP address the internet routes) or
    ``name`` (a DNS name: whoever resolves it)."""
    h = canonical_host(host)
    try:
        ip = ipaddress.ip_address(h)
    except ValueError:
        return "name"
    if ip.is_loopback:
        return "loopback"
    return "private" if any(ip in net for net in LOCAL_NETS) else "public"


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


MAX_DECLARED = 128  # characters: tcp://[IPv6 with a zone]:PORT fits with room to spare


def declared_endpoint(endpoint: str) -> str:
    """The one spelling of a relay endpoint a worker declares at join, or ValueError naming
    what is wrong and the fix. A relay's endpoint is what its socket reports after binding
    (``tcp://IP:PORT``, numeric), so anything else is refused rather than compared: a name
    (other than ``localhost``), a numeric host in a form ``ipaddress`` does not write
    (``127.1``, ``0x7f000001``, ``2130706433``, ``127.0.0.01``: each one the OS would connect to
    127.0.0.1, so each could claim an honest relay's address under another spelling), and the
    unspecified address (0.0.0.0, ::: no peer can connect to it)."""
    if len(endpoint) > MAX_DECLARED:  # a peer's string: never echoed back at its own length
        raise ValueError(
            f"relay endpoint of {len(endpoint)} characters: longer than any tcp://IP:PORT"
        )
    scheme, host, port = split_endpoint(endpoint.strip())
    where = f"relay endpoint {endpoint!r}"
    if scheme.lower() != "tcp":
        raise ValueError(f"{where}: the scheme must be tcp://")
    if not port or not 0 < int(port) < 65536:
        raise ValueError(f"{where}: a TCP port 1-65535 must follow the host")
    h = canonical_host(host)
    try:
        ip = ipaddress.ip_address(h)
    except ValueError:
        loose = _loose_ipv4(host)
        if loose is not None:
            raise ValueError(
                f"{where}: {host!r} is {loose} written another way; declare it as "
                f"{join_endpoint('tcp', loose, int(port))}"
            ) from None
        raise ValueError(
            f"{where}: {host!r} is not an IP address; --relay-host must be the address the "
            f"relay binds (an IP address, which its socket then reports)"
        ) from None
    if ip.is_unspecified:
        raise ValueError(
            f"{where}: {ip} binds every interface and no peer can connect to it: give "
            f"--relay-host the address peers reach this machine at"
        )
    return join_endpoint("tcp", str(ip), int(port))


def _loose_ipv4(host: str) -> str | None:
    """The IPv4 address the C library reads ``host`` as (``inet_aton``: shortened, hex, octal
    and single-number forms), or None when it reads none."""
    import socket

    try:
        return socket.inet_ntoa(socket.inet_aton(host.strip()))
    except (OSError, ValueError):  # ValueError: an embedded NUL
        return None


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
            f"machine at (its public IP or DNS name, e.g. --set learner.public_host=203.0.113.7). "
            f"Keep learner.host at 0.0.0.0 (or this machine's private address) behind a cloud's "
            f"1:1 NAT: the public address is on no interface here, so binding it fails "
            f"(docs/ports.md)"
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
