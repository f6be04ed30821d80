"""Link rates measured at both ends (echo_rl.broadcast.link_meter) and the plans made from them."""

import math

import pytest

from echo_rl.broadcast.coordinator import Coordinator
from echo_rl.broadcast.link_meter import MAX_MBIT, LinkMeter
from echo_rl.broadcast.topology import ChainsTopology
from labs.doubles import DeclaredRatesCoordinator

ROOT = "tcp://learner:1"


def test_a_liar_cannot_raise_its_uplink_above_what_its_child_measured():
    m = LinkMeter()
    plan = {"liar": None, "child": "liar"}
    m.report(1, "liar", down_mbit=100, up_mbit=1000, plan=plan)  # claims 1 Gbit/s served
    m.report(1, "child", down_mbit=25, up_mbit=0, plan=plan)  # honest: got 25
    assert m.up["liar"] == 25 and m.down["liar"] == 100
    # No evidence either way: the uplink is blamed; the child only proved it gets >= 25.
    assert "child" not in m.down and m.down_floor["child"] == 25


def test_either_end_may_arrive_first_and_the_lower_end_binds():
    m = LinkMeter()
    plan = {"p": None, "c": "p"}
    m.report(1, "c", down_mbit=80, up_mbit=0, plan=plan)  # child first: parent not in yet
    assert "p" not in m.up
    m.report(1, "p", down_mbit=100, up_mbit=30, plan=plan)  # parent's end is lower: it binds
    assert m.up["p"] == 30 and m.down_floor["c"] == 30


def test_a_starved_link_only_raises_estimates():
    # root -> a -> b: b downloads as fast as a received, so the a->b link was not the
    # bottleneck: it proves "at least 95", it does not measure a's uplink.
    m = LinkMeter()
    plan = {"a": None, "b": "a"}
    m.up["a"] = 200.0  # measured before at 200
    m.report(1, "a", down_mbit=100, up_mbit=0, plan=plan)
    m.report(1, "b", down_mbit=95, up_mbit=0, plan=plan)
    assert m.up["a"] == 200.0 and m.down_floor["b"] == 95  # not lowered by starvation
    m.up["a"] = 50.0
    m.report(2, "a", down_mbit=100, up_mbit=0, plan=plan)
    m.report(2, "b", down_mbit=95, up_mbit=0, plan=plan)
    assert m.up["a"] == 95.0  # raised to what the link proved


def test_a_link_limited_measurement_blames_the_end_without_evidence_of_speed():
    m = LinkMeter()
    plan = {"a": None, "b": "a"}
    m.up_floor["a"] = 100.0  # a served another child at 100 before
    m.report(1, "a", down_mbit=100, up_mbit=0, plan=plan)
    m.report(1, "b", down_mbit=25, up_mbit=0, plan=plan)
    assert m.down["b"] == 25 and "a" not in m.up  # b's downlink, not a's uplink
    m.up["c"], m.down_floor["d"] = 100.0, 100.0  # both ends were fast before: both measured
    plan = {"c": None, "d": "c"}
    m.report(2, "c", down_mbit=100, up_mbit=0, plan=plan)
    m.report(2, "d", down_mbit=20, up_mbit=0, plan=plan)
    assert m.up["c"] == pytest.approx(60) and m.down["d"] == 20


def test_reports_are_bounded():
    m = LinkMeter()
    plan = {"a": None, "b": None, "c": None}
    assert m.report(1, "a", down_mbit=math.inf, up_mbit=math.nan, plan=plan)
    assert "a" not in m.down  # non-finite: not measured
    m.report(1, "b", down_mbit=1e12, up_mbit=0, plan=plan)
    assert m.down["b"] == MAX_MBIT  # clamped
    m.report(1, "c", down_mbit=10, up_mbit=0, plan=plan)
    assert not m.report(1, "c", down_mbit=10_000, up_mbit=0, plan=plan)  # one per install
    assert m.down["c"] == 10


def test_declared_rates_are_capped_until_measured():
    m = LinkMeter()
    declared = {"a": (100.0, 100.0), "b": (100.0, 100.0), "c": (100.0, 1000.0), "d": (0.0, 0.0)}
    # Nobody measured: capped at the median declared rate; 0 stays unknown.
    assert m.rates(declared) == {"a": (100, 100), "b": (100, 100), "c": (100, 100), "d": (0, 0)}
    m.up.update(a=40.0, b=60.0)
    m.down.update(a=80.0)
    rates = m.rates(declared)
    assert rates["a"] == (80, 40) and rates["c"] == (80, 50)  # median measured: 80 down, 50 up
    m.up_floor["d"] = 70.0  # proved: a floor lifts even an unknown declaration
    assert m.rates(declared)["d"] == (0, 70)


# ------------------------------------------------------------------ the planner's choice


def _coordinator(trust_declared: bool = False) -> Coordinator:
    topo = ChainsTopology(
        uplink_mbit=400, link_mbit=100, chunk_bytes=1 << 20, snapshot_bytes=16 << 20
    )
    coord = (DeclaredRatesCoordinator if trust_declared else Coordinator)(topo, ROOT)
    for i in range(8):
        declared_up = 250.0 if i == 0 else 100.0  # w0 declares 10x its real 25 Mbit/s
        coord.join(f"w{i}", f"tcp://w{i}:1", 100.0, declared_up)
    return coord


REAL_UP = {f"w{i}": 25.0 if i == 0 else 100.0 for i in range(8)}


def _deliver(coord: Coordinator, version: int) -> None:
    """Every worker reports what it would measure on the real links of this plan: a chain runs
    at its slowest uplink so far (the learner's share is 100 Mbit/s per chain)."""
    by_ep = {p.endpoint: p.worker_id for p in coord.peers.values()}
    parent = {w: by_ep.get(ep) for w, ep in coord.sources.items()}

    def down(w: str) -> float:
        p = parent[w]
        return 100.0 if p is None else min(down(p), REAL_UP[p])

    for w in sorted(coord.sources, key=lambda w: down(w), reverse=True):  # parents first
        children = [c for c, p in parent.items() if p == w]
        up = min(REAL_UP[w], down(w)) if children else 0.0
        coord.installed(w, version)
        coord.measured(w, version, down(w), up)


def _heads(coord: Coordinator) -> set[str]:
    return {w for w, ep in coord.sources.items() if ep == ROOT}


def test_declared_liar_heads_a_chain_when_declarations_are_believed():
    coord = _coordinator(trust_declared=True)
    for v in (1, 2, 3):
        coord.publish(v)
        assert "w0" in _heads(coord)
        _deliver(coord, v)


def test_measured_liar_is_no_chain_head_after_the_next_publication():
    coord = _coordinator()
    coord.publish(1)
    _deliver(coord, 1)
    assert coord.links.up["w0"] == 25.0  # its honest child's measurement, not its claim
    for v in (2, 3):
        coord.publish(v)
        assert "w0" not in _heads(coord)
        parent_of_child = [w for w, ep in coord.sources.items() if ep == "tcp://w0:1"]
        assert parent_of_child == []  # a tail: it uploads to nobody
        _deliver(coord, v)
