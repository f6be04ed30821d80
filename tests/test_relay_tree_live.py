"""The dashboard's relay tree and the per-worker NAT, transport and link-rate series of
``/metrics`` with a real learner and three worker processes on loopback (issue 30, item 4).

The tree's parents are checked against what each worker fetched: its log says where every
version's chunks came from, i.e. the source the coordinator's plan handed it."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_integration import Cluster  # one loopback cluster for both

from echo_rl.core.procs import python_argv
from echo_rl.core.tree import LEARNER, RelayTree

pytestmark = [pytest.mark.slow, pytest.mark.timeout(360)]
WORKERS = ("w0", "w1", "w2")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")  # the page, if present


@pytest.fixture
def cluster(tmp_path, small_cfg):
    cfg = small_cfg.model_copy(deep=True)
    cfg.learner.max_steps = 10_000
    # A publication every 8 steps: versions that do not fly past a CPU-starved worker
    cfg.learner.staleness, cfg.learner.kappa = 8, 8
    # One chain's worth of learner uplink for 100 Mbit/s workers: relays, not a star.
    cfg.broadcast.uplink_mbit, cfg.broadcast.link_mbit = 100.0, 100.0
    c = Cluster(tmp_path, cfg)
    yield c
    c.group.stop_all()


def start_worker(c: Cluster, name: str) -> None:
    c.group.start(
        name,
        python_argv(
            "echo_rl.cli.worker",
            "join",
            c.endpoint,
            "--id",
            name,
            "--price",
            "0.35",
            "--down-mbit",
            "100",
            "--up-mbit",
            "100",
            "--identity",
            str(c.tmp / f"{name}.key"),
        ),
        c.tmp / f"{name}.log",
    )


def get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read()


def poll(what: str, fn, timeout: float = 120.0):
    """``fn()`` until it returns something truthy; the learner and the workers are other
    processes, so there is no event to wait on."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = fn()
        if got:
            return got
        time.sleep(0.2)
    raise AssertionError(f"no {what} within {timeout}s")


def served_tree(url: str) -> RelayTree:
    return RelayTree.model_validate(json.loads(get(url + "/api/state"))["tree"])


def fetches(log: Path) -> dict[int, str]:
    """Version -> where the worker's log says its chunks came from (one source: loopback)."""
    text = log.read_text() if log.exists() else ""
    return {
        int(v): src
        for v, src in re.findall(r"received snapshot v(\d+) \(.*? chunks from (\S+?)\)", text)
    }


def past(log: Path, version: int) -> dict[int, str] | None:
    """The worker's fetches once it has fetched ``version`` or a later one."""
    got = fetches(log)
    return got if max(got, default=-1) >= version else None


def compared(c: Cluster, url: str) -> RelayTree | None:
    """A served tree, once every worker is placed and installed, checked against what each
    worker fetched for that version; None when a worker skipped it (superseded meanwhile:
    try a newer one). A parent that differs from the fetch fails at once."""
    tree = served_tree(url)
    nodes = {n.worker: n for n in tree.nodes}
    settled = all(len(fetches(c.tmp / f"{w}.log")) >= 2 for w in WORKERS)  # past start-up
    if (
        set(nodes) != set(WORKERS)
        or any(n.role == "unplaced" for n in nodes.values())
        or tree.version is None
        or not settled
    ):
        return None
    logs = {
        w: poll(f"{w} at v{tree.version}", lambda w=w: past(c.tmp / f"{w}.log", tree.version))
        for w in WORKERS
    }
    if any(tree.version not in f for f in logs.values()):
        return None
    for n in nodes.values():
        expected = tree.source if n.parent == LEARNER else nodes[n.parent].relay_endpoint
        got = logs[n.worker][tree.version]
        assert got == expected == n.source, (tree.version, n.worker, n.parent, got, expected)
    return tree


def dashboard_shows_a_tree(url: str, profile: Path) -> None:
    """The page in headless Chromium: a row per worker under the learner, each parent shown
    one of the rows, roles as the rows' children make them (the plan may have moved on since
    the check above, so the page is held to the shape, not to that version)."""
    dom = subprocess.run(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            f"--user-data-dir={profile}",
            "--virtual-time-budget=5000",
            "--dump-dom",
            url + "/",
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    rows = {
        w: (p, r)
        for w, p, r in re.findall(
            r'id="tree-([^"]+)" data-parent="([^"]*)" data-role="([^"]*)"', dom
        )
    }
    assert set(rows) == set(WORKERS) and 'id="tree-learner"' in dom, rows
    kids = {w: sum(p == w for p, _ in rows.values()) for w in rows}
    for w, (parent, role) in rows.items():
        assert parent in {LEARNER, *WORKERS} - {w}, (w, parent)
        assert role == ("head" if parent == LEARNER else "relay" if kids[w] else "tail"), rows
    assert "measured by the learner" in dom and "declared by the worker" in dom


def series(url: str, family: str) -> list[dict[str, str]]:
    fams = {f.name: f for f in text_string_to_metric_families(get(url + "/metrics").decode())}
    return [{**s.labels, "value": s.value} for s in fams[family].samples]


def test_dashboard_tree_matches_what_the_workers_fetched_and_metrics_follow(cluster):
    run = cluster.learner()
    for name in WORKERS:
        start_worker(cluster, name)
    url = json.loads((run / "learner.json").read_text())["metrics"]
    tree = poll("a tree every worker fetched by", lambda: compared(cluster, url), timeout=180)
    nodes = {n.worker: n for n in tree.nodes}
    assert any(n.parent not in (LEARNER, None) for n in nodes.values()), tree  # a chain
    for n in nodes.values():
        assert n.nat == "reachable" and n.transport == "tcp"  # loopback: dialled back directly
        assert n.declared_up_mbit == 100.0

    place = {s["worker"]: s["parent"] for s in series(url, "echo_worker_relay_role")}
    assert set(place) == set(WORKERS)
    nat = {(s["worker"], s["nat"]) for s in series(url, "echo_worker_nat")}
    assert nat == {(w, "reachable") for w in WORKERS}
    transport = {(s["worker"], s["transport"]) for s in series(url, "echo_worker_transport")}
    assert transport == {(w, "tcp") for w in WORKERS}
    measured = poll("a measured link rate", lambda: series(url, "echo_worker_link_mbit"))
    assert all(s["worker"] in WORKERS and s["value"] > 0 for s in measured)

    if CHROMIUM:
        dashboard_shows_a_tree(url, cluster.tmp / "profile")

    cluster.group.stop("w2", sig=signal.SIGKILL)  # leaves by heartbeat timeout: series go
    gone = poll(
        "w2's series removed",
        lambda: (
            all(
                s["worker"] != "w2"
                for fam in (
                    "echo_worker_relay_role",
                    "echo_worker_nat",
                    "echo_worker_transport",
                    "echo_worker_link_mbit",
                    "echo_worker_declared_mbit",
                )
                for s in series(url, fam)
            )
            and "w2" not in {n.worker for n in served_tree(url).nodes}
        ),
    )
    assert gone
    cluster.group.stop("learner", timeout=60)
