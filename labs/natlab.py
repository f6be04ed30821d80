"""A wide area with real NATs on one host: network namespaces, veth, iptables, tc tbf.

The "internet" is a bridge on 198.51.100.0/24 (a documentation range: a public address, as
``echo_rl.core.addresses.reach`` counts it, that routes nowhere real).

* ``echo-npub``: the learner's side (``198.51.100.1``), uplink shaped at U. With
  ``cloud_nat``, as on most clouds: the learner's host has a private address (``10.0.0.2``)
  behind a 1:1 NAT gateway ``echo-ngw`` that holds the public one, forwards it all to the
  host and lets in only new TCP connections to the documented ports (``CLOUD_PORTS``, the
  security group); a connection from the host to its own public address does not loop back.
* Public worker i: namespace ``echo-nw<i>`` on the same "internet" bridge
  (``198.51.100.<100+i>``).
* Home worker i: namespace ``echo-nw<i>`` (``172.16.<i>.2``) behind its own router namespace
  ``echo-nr<i>`` (WAN ``198.51.100.<10+i>``, LAN ``172.16.<i>.1``). The router masquerades what
  leaves and drops new connections from the WAN, like a home router:
  ``cone`` NAT keeps the source port for every destination (Linux MASQUERADE: endpoint-
  independent mapping, filtering by address and port), ``symmetric`` picks a random port per
  connection (``--random-fully``). Nothing on the internet side routes to 172.16.0.0/12.

Each worker's upload is shaped at b on its own veth and its download at b where its traffic
enters its namespace. Needs root (CAP_NET_ADMIN) and iptables; every object is named ``echo-n*``
(or as the ``Names`` given say) and removed on exit, also after a failure. ``../shared/research/nat-traversal.md`` has the bed
this follows (and its pitfalls: without the WAN drop rule, an early SYN leaves a conntrack entry
that makes the router remap the host's own flow, and punching fails even on a cone NAT).
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from labs.netns import tbf_burst

NET = "198.51.100"
ROOT_ADDR = f"{NET}.1"
CLOUD_PRIVATE = "10.0.0.2"  # the learner's host behind the cloud's 1:1 NAT (``cloud_nat``)
CLOUD_PORTS = "5555:5558"  # what the cloud's security group lets in (docs/ports.md)


@dataclass(frozen=True)
class Names:
    """What the lab's objects are called: namespaces ``{ns}pub``, ``{ns}w<i>``, ``{ns}r<i>``
    and the bridge ``{ns}br0``; host-side veths ``{dev}pub``, ``{dev}w<i>``, ``{dev}r<i>``
    (at most 15 characters). Another pair lets two labs stand side by side on one host."""

    ns: str = "echo-n"
    dev: str = "en"

    @property
    def root(self) -> str:
        return f"{self.ns}pub"

    @property
    def bridge(self) -> str:
        return f"{self.ns}br0"

    @property
    def gateway(self) -> str:
        return f"{self.ns}gw"


BRIDGE = Names().bridge
ROOT_NS = Names().root


@dataclass(frozen=True)
class Node:
    index: int
    nat: str  # "public", "cone" or "symmetric"
    names: Names = Names()

    @property
    def ns(self) -> str:
        return f"{self.names.ns}w{self.index}"

    @property
    def router(self) -> str:
        return f"{self.names.ns}r{self.index}"

    @property
    def address(self) -> str:
        return f"{NET}.{100 + self.index}" if self.nat == "public" else f"172.16.{self.index}.2"


def _run(*args: str, ns: str | None = None) -> None:
    cmd = (["ip", "netns", "exec", ns] if ns else []) + list(args)
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)}: {done.stderr.strip()}")


def _tbf(dev: str, mbit: float, ns: str | None) -> None:
    if mbit > 0:
        burst = tbf_burst(mbit)  # labs.netns says why
        _run(
            "tc",
            "qdisc",
            "replace",
            "dev",
            dev,
            "root",
            "tbf",
            "rate",
            f"{mbit}mbit",
            "burst",
            str(burst),
            "latency",
            "100ms",
            ns=ns,
        )


def missing_tools() -> str:
    """ "" when the lab can be built here, else what is missing (tests skip saying so)."""
    for tool in ("ip", "tc", "iptables"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt-get install iproute2 iptables)"
    return ""


def teardown(n: int, names: Names = Names()) -> None:
    for i in range(n):
        for ns in (f"{names.ns}w{i}", f"{names.ns}r{i}"):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
        for dev in (f"{names.dev}w{i}", f"{names.dev}r{i}"):
            subprocess.run(["ip", "link", "del", dev], capture_output=True, check=False)
    for ns in (names.root, names.gateway):
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
    for dev in (f"{names.dev}pub", f"{names.dev}gw"):
        subprocess.run(["ip", "link", "del", dev], capture_output=True, check=False)
    subprocess.run(["ip", "link", "del", names.bridge], capture_output=True, check=False)


def _attach(
    ns: str, host_dev: str, addr: str, up_mbit: float, down_mbit: float, bridge: str
) -> None:
    """A veth from the bridge into ``ns`` as eth0 with ``addr``/24; upload and download shaped."""
    _run("ip", "link", "add", host_dev, "type", "veth", "peer", "name", "eth0", "netns", ns)
    _run("ip", "link", "set", host_dev, "master", bridge, "up")
    _run("ip", "addr", "add", f"{addr}/24", "dev", "eth0", ns=ns)
    _run("ip", "link", "set", "eth0", "up", ns=ns)
    _tbf("eth0", up_mbit, ns)
    _tbf(host_dev, down_mbit, None)


def _home(node: Node, link_mbit: float) -> None:
    r, h, i = node.router, node.ns, node.index
    _run("ip", "netns", "add", r)
    _run("ip", "link", "set", "lo", "up", ns=r)
    _attach(r, f"{node.names.dev}r{i}", f"{NET}.{10 + i}", 0, 0, node.names.bridge)
    _run("ip", "link", "set", "eth0", "name", "wan", ns=r)
    _run("ip", "link", "add", "lan", "netns", r, "type", "veth", "peer", "name", "eth0", "netns", h)
    _run("ip", "addr", "add", f"172.16.{i}.1/24", "dev", "lan", ns=r)
    _run("ip", "link", "set", "lan", "up", ns=r)
    _run("ip", "addr", "add", f"{node.address}/24", "dev", "eth0", ns=h)
    _run("ip", "link", "set", "eth0", "up", ns=h)
    _run("ip", "route", "add", "default", "via", f"172.16.{i}.1", ns=h)
    _tbf("eth0", link_mbit, h)  # the home's upload
    _tbf("lan", link_mbit, r)  # its download
    for key in (
        "net.ipv4.ip_forward=1",
        "net.ipv4.conf.all.rp_filter=0",
        "net.ipv4.conf.default.rp_filter=0",
    ):
        _run("sysctl", "-qw", key, ns=r)
    _run(
        "iptables",
        "-A",
        "INPUT",
        "-i",
        "wan",
        "-m",
        "conntrack",
        "--ctstate",
        "NEW",
        "-j",
        "DROP",
        ns=r,
    )
    masq = ["iptables", "-t", "nat", "-A", "POSTROUTING", "-o", "wan", "-j", "MASQUERADE"]
    _run(*masq, *(["--random-fully"] if node.nat == "symmetric" else []), ns=r)


def _cloud_nat(names: Names, uplink_mbit: float) -> None:
    """The learner's host ``names.root`` at ``CLOUD_PRIVATE`` behind a 1:1 NAT gateway that
    holds ``ROOT_ADDR`` (DNAT in, SNAT out, on the WAN side only: no hairpin) and lets in new
    TCP connections to ``CLOUD_PORTS`` only."""
    gw, root = names.gateway, names.root
    _run("ip", "netns", "add", gw)
    _run("ip", "link", "set", "lo", "up", ns=gw)
    _attach(gw, f"{names.dev}gw", ROOT_ADDR, 0, 0, names.bridge)
    _run("ip", "link", "set", "eth0", "name", "wan", ns=gw)
    _run(
        "ip",
        "link",
        "add",
        "lan",
        "netns",
        gw,
        "type",
        "veth",
        "peer",
        "name",
        "eth0",
        "netns",
        root,
    )
    _run("ip", "addr", "add", "10.0.0.1/24", "dev", "lan", ns=gw)
    _run("ip", "link", "set", "lan", "up", ns=gw)
    _run("ip", "addr", "add", f"{CLOUD_PRIVATE}/24", "dev", "eth0", ns=root)
    _run("ip", "link", "set", "eth0", "up", ns=root)
    _run("ip", "route", "add", "default", "via", "10.0.0.1", ns=root)
    _tbf("eth0", uplink_mbit, root)
    for key in ("net.ipv4.ip_forward=1", "net.ipv4.conf.all.rp_filter=0"):
        _run("sysctl", "-qw", key, ns=gw)
    nat = ["iptables", "-t", "nat", "-A"]
    _run(
        *nat,
        "PREROUTING",
        "-i",
        "wan",
        "-d",
        ROOT_ADDR,
        "-j",
        "DNAT",
        "--to-destination",
        CLOUD_PRIVATE,
        ns=gw,
    )
    _run(
        *nat,
        "POSTROUTING",
        "-o",
        "wan",
        "-s",
        CLOUD_PRIVATE,
        "-j",
        "SNAT",
        "--to-source",
        ROOT_ADDR,
        ns=gw,
    )
    _run("iptables", "-P", "FORWARD", "DROP", ns=gw)
    est = ["-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT"]
    _run("iptables", "-A", "FORWARD", *est, ns=gw)
    _run("iptables", "-A", "FORWARD", "-i", "lan", "-o", "wan", "-j", "ACCEPT", ns=gw)
    _run(
        "iptables",
        "-A",
        "FORWARD",
        "-i",
        "wan",
        "-o",
        "lan",
        "-p",
        "tcp",
        "--dport",
        CLOUD_PORTS,
        "-m",
        "conntrack",
        "--ctstate",
        "NEW",
        "-j",
        "ACCEPT",
        ns=gw,
    )


@contextmanager
def lab(
    nodes: list[Node],
    uplink_mbit: float,
    link_mbit: float,
    names: Names = Names(),
    cloud_nat: bool = False,
) -> Iterator[None]:
    """The learner's namespace ``names.root`` and every node's; ``nodes`` carry ``names``.
    ``cloud_nat``: the learner's host behind a cloud's 1:1 NAT (``_cloud_nat``)."""
    n = max((x.index for x in nodes), default=-1) + 1
    assert all(x.names == names for x in nodes), "nodes of another lab"
    teardown(n, names)  # leftovers of an interrupted run
    try:
        _run("ip", "link", "add", names.bridge, "type", "bridge")
        _run("ip", "link", "set", names.bridge, "up")
        _run("ip", "netns", "add", names.root)
        _run("ip", "link", "set", "lo", "up", ns=names.root)
        if cloud_nat:
            _cloud_nat(names, uplink_mbit)
        else:
            _attach(names.root, f"{names.dev}pub", ROOT_ADDR, uplink_mbit, 0, names.bridge)
        for node in nodes:
            if node.nat == "public":
                _run("ip", "netns", "add", node.ns)
                _run("ip", "link", "set", "lo", "up", ns=node.ns)
                _attach(
                    node.ns,
                    f"{names.dev}w{node.index}",
                    node.address,
                    link_mbit,
                    link_mbit,
                    names.bridge,
                )
            else:
                _run("ip", "netns", "add", node.ns)
                _run("ip", "link", "set", "lo", "up", ns=node.ns)
                _home(node, link_mbit)
        yield
    finally:
        teardown(n, names)


def fleet(workers: int, nat: int, symmetric: int, names: Names = Names()) -> list[Node]:
    """The first ``workers - nat`` public, then ``nat`` behind NATs, the last ``symmetric`` of
    them symmetric."""
    out = []
    for i in range(workers):
        if i < workers - nat:
            kind = "public"
        elif i >= workers - symmetric:
            kind = "symmetric"
        else:
            kind = "cone"
        out.append(Node(i, kind, names))
    return out
