"""A wide area with real NATs on one host: network namespaces, veth, iptables, tc tbf.

* ``echo-npub``: the learner's side (``10.99.0.1``), uplink shaped at U.
* Public worker i: namespace ``echo-nw<i>`` on the same "internet" bridge (``10.99.0.<100+i>``).
* Home worker i: namespace ``echo-nw<i>`` (``172.16.<i>.2``) behind its own router namespace
  ``echo-nr<i>`` (WAN ``10.99.0.<10+i>``, LAN ``172.16.<i>.1``). The router masquerades what
  leaves and drops new connections from the WAN, like a home router:
  ``cone`` NAT keeps the source port for every destination (Linux MASQUERADE: endpoint-
  independent mapping, filtering by address and port), ``symmetric`` picks a random port per
  connection (``--random-fully``). Nothing on the internet side routes to 172.16.0.0/12.

Each worker's upload is shaped at b on its own veth and its download at b where its traffic
enters its namespace. Needs root (CAP_NET_ADMIN) and iptables; every object is named ``echo-n*``
and removed on exit, also after a failure. ``../shared/research/nat-traversal.md`` has the bed
this follows (and its pitfalls: without the WAN drop rule, an early SYN leaves a conntrack entry
that makes the router remap the host's own flow, and punching fails even on a cone NAT).
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from broadcast.netns import tbf_burst

BRIDGE = "echo-nbr0"
ROOT_NS = "echo-npub"
ROOT_ADDR = "10.99.0.1"


@dataclass(frozen=True)
class Node:
    index: int
    nat: str  # "public", "cone" or "symmetric"

    @property
    def ns(self) -> str:
        return f"echo-nw{self.index}"

    @property
    def router(self) -> str:
        return f"echo-nr{self.index}"

    @property
    def address(self) -> str:
        return f"10.99.0.{100 + self.index}" if self.nat == "public" else f"172.16.{self.index}.2"


def _run(*args: str, ns: str | None = None) -> None:
    cmd = (["ip", "netns", "exec", ns] if ns else []) + list(args)
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)}: {done.stderr.strip()}")


def _tbf(dev: str, mbit: float, ns: str | None) -> None:
    if mbit > 0:
        burst = tbf_burst(mbit)  # broadcast.netns says why
        _run("tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{mbit}mbit",
             "burst", str(burst), "latency", "100ms", ns=ns)


def missing_tools() -> str:
    """"" when the lab can be built here, else what is missing (tests skip saying so)."""
    for tool in ("ip", "tc", "iptables"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt-get install iproute2 iptables)"
    return ""


def teardown(n: int) -> None:
    for i in range(n):
        for ns in (f"echo-nw{i}", f"echo-nr{i}"):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        for dev in (f"enw{i}", f"enr{i}"):
            subprocess.run(["ip", "link", "del", dev], capture_output=True)
    subprocess.run(["ip", "netns", "del", ROOT_NS], capture_output=True)
    subprocess.run(["ip", "link", "del", "enpub"], capture_output=True)
    subprocess.run(["ip", "link", "del", BRIDGE], capture_output=True)


def _attach(ns: str, host_dev: str, addr: str, up_mbit: float, down_mbit: float) -> None:
    """A veth from the bridge into ``ns`` as eth0 with ``addr``/24; upload and download shaped."""
    _run("ip", "link", "add", host_dev, "type", "veth", "peer", "name", "eth0", "netns", ns)
    _run("ip", "link", "set", host_dev, "master", BRIDGE, "up")
    _run("ip", "addr", "add", f"{addr}/24", "dev", "eth0", ns=ns)
    _run("ip", "link", "set", "eth0", "up", ns=ns)
    _tbf("eth0", up_mbit, ns)
    _tbf(host_dev, down_mbit, None)


def _home(node: Node, link_mbit: float) -> None:
    r, h, i = node.router, node.ns, node.index
    _run("ip", "netns", "add", r)
    _run("ip", "link", "set", "lo", "up", ns=r)
    _attach(r, f"enr{i}", f"10.99.0.{10 + i}", 0, 0)
    _run("ip", "link", "set", "eth0", "name", "wan", ns=r)
    _run("ip", "link", "add", "lan", "netns", r, "type", "veth", "peer", "name", "eth0", "netns", h)
    _run("ip", "addr", "add", f"172.16.{i}.1/24", "dev", "lan", ns=r)
    _run("ip", "link", "set", "lan", "up", ns=r)
    _run("ip", "addr", "add", f"{node.address}/24", "dev", "eth0", ns=h)
    _run("ip", "link", "set", "eth0", "up", ns=h)
    _run("ip", "route", "add", "default", "via", f"172.16.{i}.1", ns=h)
    _tbf("eth0", link_mbit, h)  # the home's upload
    _tbf("lan", link_mbit, r)  # its download
    for key in ("net.ipv4.ip_forward=1", "net.ipv4.conf.all.rp_filter=0",
                "net.ipv4.conf.default.rp_filter=0"):
        _run("sysctl", "-qw", key, ns=r)
    _run("iptables", "-A", "INPUT", "-i", "wan", "-m", "conntrack", "--ctstate", "NEW", "-j", "DROP", ns=r)
    masq = ["iptables", "-t", "nat", "-A", "POSTROUTING", "-o", "wan", "-j", "MASQUERADE"]
    _run(*masq, *(["--random-fully"] if node.nat == "symmetric" else []), ns=r)


@contextmanager
def lab(nodes: list[Node], uplink_mbit: float, link_mbit: float) -> Iterator[None]:
    n = max((x.index for x in nodes), default=-1) + 1
    teardown(n)  # leftovers of an interrupted run
    try:
        _run("ip", "link", "add", BRIDGE, "type", "bridge")
        _run("ip", "link", "set", BRIDGE, "up")
        _run("ip", "netns", "add", ROOT_NS)
        _run("ip", "link", "set", "lo", "up", ns=ROOT_NS)
        _attach(ROOT_NS, "enpub", ROOT_ADDR, uplink_mbit, 0)
        for node in nodes:
            if node.nat == "public":
                _run("ip", "netns", "add", node.ns)
                _run("ip", "link", "set", "lo", "up", ns=node.ns)
                _attach(node.ns, f"enw{node.index}", node.address, link_mbit, link_mbit)
            else:
                _run("ip", "netns", "add", node.ns)
                _run("ip", "link", "set", "lo", "up", ns=node.ns)
                _home(node, link_mbit)
        yield
    finally:
        teardown(n)


def fleet(workers: int, nat: int, symmetric: int) -> list[Node]:
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
        out.append(Node(i, kind))
    return out
