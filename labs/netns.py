"""Real kernel-shaped links for the broadcast benchmark: network namespaces, veth, tc tbf.

One namespace per node (``echo-root`` for the learner side, ``echo-wK`` per relay), each with a
veth into one bridge in the initial namespace, addresses 10.77.0.0/24. Shaping is the
kernel's: a tbf qdisc on the namespace side of each veth limits its upload (U for the root, b
for a relay), one on the bridge side limits its download. Needs root (CAP_NET_ADMIN); every
object is named ``echo-*`` and removed on exit, including after a failure.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager

BRIDGE = "echo-br0"
SUBNET = "10.77.0"


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = (["ip", "netns", "exec", ns] if ns else []) + list(args)
    subprocess.run(cmd, check=True, capture_output=True, text=True)


def tbf_burst(mbit: float) -> int:
    """tc tbf's bucket for a link of ``mbit``: ~2 ms at the rate, and at least two 64 KiB GSO
    packets (~10 ms at 100 Mbit/s). A tiny bucket (32 kbit) makes the shaper CPU-bound on this
    machine; one below 64 KiB makes tbf cut every GSO packet into MTU segments, and each then
    crosses veth, bridge and NAT on its own: 16 workers at 100 Mbit/s spent 60 % of 2 cores in
    the kernel and ran at half rate (T_bcast 1.8-2.0x the bound, every worker public); with
    128 KiB, 20 % (docs/nat.md). Over a 64 MiB snapshot it lets through 0.2 % above the rate."""
    return max(131072, int(mbit * 1e6 / 8 * 0.002))


def _tbf(dev: str, mbit: float, ns: str | None = None) -> None:
    if mbit > 0:
        _ip(
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
            str(tbf_burst(mbit)),
            "latency",
            "100ms",
            ns=ns,
        )


def node_name(i: int | None) -> str:
    return "echo-root" if i is None else f"echo-w{i}"


def address(i: int | None) -> str:
    return f"{SUBNET}.1" if i is None else f"{SUBNET}.{i + 2}"


def teardown(n: int) -> None:
    for i in [None, *range(n)]:
        subprocess.run(["ip", "netns", "del", node_name(i)], capture_output=True)
        subprocess.run(["ip", "link", "del", f"eh{'r' if i is None else i}"], capture_output=True)
    subprocess.run(["ip", "link", "del", BRIDGE], capture_output=True)


@contextmanager
def lab(n_workers: int, uplink_mbit: float, link_mbit: float) -> Iterator[None]:
    teardown(n_workers)  # leftovers of an interrupted run
    try:
        _ip("ip", "link", "add", BRIDGE, "type", "bridge")
        _ip("ip", "link", "set", BRIDGE, "up")
        for i in [None, *range(n_workers)]:
            ns, host, inner = node_name(i), f"eh{'r' if i is None else i}", "eth0"
            rate = uplink_mbit if i is None else link_mbit
            _ip("ip", "netns", "add", ns)
            _ip("ip", "link", "add", host, "type", "veth", "peer", "name", inner, "netns", ns)
            _ip("ip", "link", "set", host, "master", BRIDGE, "up")
            _ip("ip", "addr", "add", f"{address(i)}/24", "dev", inner, ns=ns)
            _ip("ip", "link", "set", inner, "up", ns=ns)
            _ip("ip", "link", "set", "lo", "up", ns=ns)
            _tbf(inner, rate, ns=ns)  # this node's upload
            _tbf(host, link_mbit if i is not None else 0, ns=None)  # a relay's download
        yield
    finally:
        teardown(n_workers)
