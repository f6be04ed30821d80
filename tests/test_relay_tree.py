"""The relay tree (echo_rl/core/tree.py, echo_rl/broadcast/tree.py, echo_rl/core/tree_metrics.py): built from a real
coordinator's plan, served on /api/state and /metrics, series removed when a worker leaves.
The live test with a learner and worker processes is tests/test_relay_tree_live.py."""

from __future__ import annotations

import json
import urllib.request

import pydantic
import pytest

from echo_rl.broadcast.coordinator import Coordinator
from echo_rl.broadcast.topology import make_topology
from echo_rl.broadcast.tree import relay_tree
from echo_rl.core.metrics import LearnerMetrics, LiveSources
from echo_rl.core.tree import LEARNER, RelayTree, TreeNode

pytestmark = pytest.mark.timeout(60)
SOURCE = "tcp://learner:1"


def _coordinator(n: int = 6, uplink: float = 200.0) -> Coordinator:
    """``n`` reachable relays of 100 Mbit/s under a learner of ``uplink``: chains of several."""
    c = Coordinator(make_topology("chains", uplink_mbit=uplink, link_mbit=100.0), SOURCE)
    for i in range(n):
        c.join(f"w{i}", f"tcp://10.0.0.{i + 2}:5", 100.0, 100.0)
    c.publish(0)
    return c


def _expected_parents(c: Coordinator) -> dict[str, str]:
    """The plan, endpoints turned into worker ids (independent of echo_rl.broadcast.tree)."""
    by_endpoint = {p.endpoint: w for w, p in c.peers.items()}
    return {w: LEARNER if src == SOURCE else by_endpoint[src] for w, src in c.sources.items()}


def test_tree_parents_and_roles_follow_the_coordinators_plan():
    c = _coordinator()
    tree = relay_tree(c)
    parents = {n.worker: n.parent for n in tree.nodes}
    assert parents == _expected_parents(c)
    assert tree.version == 0 and tree.source == SOURCE
    kids = {w: sum(p == w for p in parents.values()) for w in parents}
    for n in tree.nodes:
        assert n.children == kids[n.worker]
        assert n.role == ("head" if n.parent == LEARNER else "relay" if n.children else "tail")
        assert n.source == c.sources[n.worker] and n.transport == "tcp" and n.nat == "reachable"
    roles = {n.role for n in tree.nodes}
    assert {"head", "tail"} <= roles and "relay" in roles, [n.role for n in tree.nodes]
    seen = {LEARNER}
    for n in tree.nodes:  # parents are listed before their children
        assert n.parent in seen
        seen.add(n.worker)


def test_rates_are_shown_as_measured_only_once_measured():
    c = _coordinator(2, uplink=1000.0)
    before = {n.worker: n for n in relay_tree(c).nodes}
    assert before["w0"].measured_down_mbit is None and before["w0"].declared_down_mbit == 100.0
    c.installed("w0", 0)
    c.measured("w0", 0, 37.5, 12.25)
    after = {n.worker: n for n in relay_tree(c).nodes}
    assert after["w0"].measured_down_mbit == pytest.approx(c.links.down["w0"], abs=1e-3)
    assert after["w0"].declared_up_mbit == 100.0 and after["w0"].installed_s is not None


def test_unplaced_and_punched_workers():
    c = _coordinator(1)
    c.join("late", "")  # joined after the publication: in no plan yet
    c.join("p", "tcp://10.0.0.9:5", nat="punchable")
    c.classify("p", "punchable", "203.0.113.2:4000")
    c.classify("late", "punchable", "203.0.113.3:4000")
    c.sources["late"] = c.route("late", "tcp://10.0.0.9:5")[0]
    nodes = {n.worker: n for n in relay_tree(c).nodes}
    assert nodes["late"].parent == "p" and nodes["late"].transport == "punched"
    assert nodes["p"].role == "unplaced" and nodes["p"].parent is None and nodes["p"].source == ""


def test_the_schema_refuses_unknown_fields_and_bad_rates():
    node = relay_tree(_coordinator(1)).nodes[0].model_dump()
    with pytest.raises(pydantic.ValidationError):
        TreeNode.model_validate({**node, "parnet": "w1"})
    with pytest.raises(pydantic.ValidationError):
        TreeNode.model_validate({**node, "measured_up_mbit": float("nan")})
    with pytest.raises(pydantic.ValidationError):
        TreeNode.model_validate({**node, "role": "king"})


def _samples(m: LearnerMetrics, family: str) -> dict[tuple, float]:
    from prometheus_client.parser import text_string_to_metric_families

    fams = {f.name: f for f in text_string_to_metric_families(m.prometheus_text().decode())}
    return {tuple(sorted(s.labels.items())): s.value for s in fams[family].samples}


def test_metrics_follow_the_tree_and_drop_workers_that_left():
    c = _coordinator(3)
    c.installed("w0", 0)
    c.measured("w0", 0, 40.0, 20.0)
    m = LearnerMetrics()
    m.live = LiveSources(tree=lambda: relay_tree(c))
    nat = _samples(m, "echo_worker_nat")
    assert nat == {(("nat", "reachable"), ("worker", f"w{i}")): 1.0 for i in range(3)}
    rates = _samples(m, "echo_worker_link_mbit")
    assert {dict(k)["worker"] for k in rates} == {"w0"}  # the others are not measured yet
    roles = _samples(m, "echo_worker_relay_role")
    assert {dict(k)["worker"]: dict(k)["parent"] for k in roles} == _expected_parents(c)
    c.leave("w2")
    c.peers["w1"].nat = "punchable"
    c.publish(1)
    for family in (
        "echo_worker_nat",
        "echo_worker_transport",
        "echo_worker_relay_role",
        "echo_worker_declared_mbit",
    ):
        assert {dict(k)["worker"] for k in _samples(m, family)} == {"w0", "w1"}, family
    nat = _samples(m, "echo_worker_nat")
    assert nat[(("nat", "punchable"), ("worker", "w1"))] == 1.0 and len(nat) == 2


def test_a_busy_control_loop_keeps_the_last_tree():
    m = LearnerMetrics()
    tree = relay_tree(_coordinator(2))
    answers = iter([tree])

    def source() -> RelayTree:
        for t in answers:
            return t
        raise TimeoutError

    m.live = LiveSources(tree=source)
    assert m.state()["tree"]["nodes"][0]["worker"] in ("w0", "w1")
    assert m.state()["tree"] == tree.model_dump()  # the second call timed out


def test_api_state_serves_the_tree_as_json():
    c = _coordinator(3)
    m = LearnerMetrics()
    m.live = LiveSources(tree=lambda: relay_tree(c))
    server = m.serve("127.0.0.1", 0)
    try:
        with urllib.request.urlopen(server.url + "/api/state", timeout=10) as r:
            state = json.loads(r.read())
    finally:
        server.close()
    assert RelayTree.model_validate(state["tree"]) == relay_tree(c)
