"""The learner's metrics registry, HTTP server and dashboard (echo_rl/core/metrics.py).

Names and labels are checked against the table in docs/observability.md, so the doc and the
exporter cannot drift apart."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from echo_rl.core.metrics import LearnerMetrics, LiveSources, from_run_dir  # noqa: E402
from echo_rl.core.tree import RelayTree, TreeNode  # noqa: E402

DOC = Path(__file__).resolve().parents[1] / "docs" / "observability.md"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def documented() -> dict[str, tuple[set[str], str]]:
    """{name: (labels, type)} from the metric table of docs/observability.md."""
    out = {}
    for line in DOC.read_text().splitlines():
        m = re.match(r"^\|\s*`(echo_[a-z0-9_]+)`\s*\|([^|]*)\|([^|]*)\|", line)
        if m:
            labels = {x.strip() for x in m.group(2).split(",") if x.strip()}
            out[m.group(1)] = (labels, m.group(3).strip())
    return out


def synthetic_row(step: int) -> dict:
    return {
        "step": step,
        "version": step,
        "reward_mean": 0.1 + 0.01 * step,
        "staleness_max": min(step, 2),
        "staleness_mean": 0.5,
        "t_train": 0.5,
        "t_wait": 0.1 if step else 5.0,
        "t_publish": 0.01,
        "bubble_ratio": 0.1,
        "admitted": 64 * (step + 1),
        "duplicates": 0,
        "dropped_stale": 1,
        "active_workers": 2,
        "standby_workers": 1,
        "fleet_price_per_hour": 0.7,
        "cost_step_usd": 0.7 * (0.6 if step else 5.5) / 3600,
        "rejected": {"bad_signature": 1},
        "learner_bytes_sent": 1000 * (step + 1),
        "t_bcast": 0.25,
        "reissued_groups": 0,
        "ready_groups": 3,
        "partial_groups": 1,
        "staleness_counts": {"0": 10, str(min(step, 2)): 6},
        "wall_s": step * 0.6,
        "publish_encoding": "delta" if step else "full",
        "publish_bytes": 30_000 if step else 1_000_000,
        "publish_full_bytes": 1_000_000,
        "delta_ratio": 0.03 if step else 1.0,
        "encode_s": 0.2,
        "decode_s": 0.05 * step or None,
        "keyframe_installs": step // 2,
        "completions_cut": 0.125,
        # a multi-turn adapter's info numbers, step means (docs/adapters.md)
        "episode_stats": {"won": 0.1 * step, "illegal": 0.25},
    }


def synthetic_stats(step: int) -> dict:
    return {
        "active_workers": 2,
        "standby_workers": 1,
        "fleet_price_per_hour": 0.7,
        "rejected": {"bad_signature": 1, "stale": step},
        "learner_bytes_sent": 1000 * (step + 1),
        "join_refused": {"token_required": step},
        "limited": {"rate_limited": step},
        "chunk_rejected": {"not_joined": step},
        "t_bcast": 0.25,
        "in_flight_groups": 4,
        "reissued_groups": 0,
        "ack_queue": 2,
        "workers": {
            f"w{i}": {
                "price": 0.35 * (i + 1),
                "version": step,
                "state": "generating",
                "active": i < 2,
                "throughput": 1.5 + i,
                "admitted": 10 * i,
            }
            for i in range(3)
        },
        "installs": {step: {"w0": 0.1, "w1": 0.2 + 0.01 * step}},
        "reputation": {
            "w0": {"audits": 5 + step, "failures": 0, "quarantined": 0},
            "evil": {"audits": 2, "failures": 2, "quarantined": 1},
        },
        "checks": {"reward:ok": 10 * step, "sampling:fail": 2},
        # echo_rl.control.accounts: the books, a departed worker's included
        "accounts": {
            "w0": {
                "state": "active",
                "accepted": 40 * step,
                "duplicates": 1,
                "rejected": {"stale": step},
                "active_s": 10.0 * step,
                "earned_usd": 0.001 * step,
            },
            "gone": {
                "state": "left",
                "accepted": 3,
                "duplicates": 0,
                "rejected": {"reward_mismatch": 4},
                "active_s": 5.0,
                "earned_usd": 0.0005,
            },
        },
    }


def synthetic_tree() -> RelayTree:
    """w0 fed by the learner, w1 by w0 through a punched link; w2 not placed yet."""

    def node(w, parent, role, **kw):
        return TreeNode(
            worker=w,
            parent=parent,
            source=kw.pop("source", ""),
            role=role,
            children=kw.pop("children", 0),
            transport=kw.pop("transport", "tcp"),
            nat=kw.pop("nat", "reachable"),
            relay_endpoint=f"tcp://10.0.0.{w[1]}:5560",
            declared_down_mbit=100.0,
            declared_up_mbit=50.0,
            **kw,
        )

    return RelayTree(
        version=5,
        source="tcp://learner:5556",
        nodes=[
            node(
                "w0",
                "learner",
                "head",
                source="tcp://learner:5556",
                children=1,
                measured_down_mbit=80.0,
                measured_up_mbit=30.5,
                installed_s=0.1,
            ),
            node(
                "w1",
                "w0",
                "tail",
                source="tcp://10.0.0.0:5560",
                transport="punched",
                nat="punchable",
                measured_down_mbit=30.5,
            ),
            node("w2", None, "unplaced", nat="unknown"),
        ],
    )


@pytest.fixture
def served():
    m = LearnerMetrics(learner_price_per_hour=3.06, run_id="synthetic")
    for step in range(6):
        m.update(synthetic_row(step), synthetic_stats(step))
    m.set_tree(synthetic_tree())
    m.add_decision(
        {
            "step": 3,
            "action": "activate",
            "worker": "w2",
            "reason": "C_eff 1 < 2",
            "c_eff": 1.0,
            "target": 2.0,
            "mu_req": 1.8,
        }
    )
    server = m.serve("127.0.0.1", 0)
    yield m, server
    server.close()


def get(server, path: str) -> bytes:
    with urllib.request.urlopen(server.url + path, timeout=10) as r:
        return r.read()


def families(server) -> dict:
    """Parsed /metrics; the histogram's ``<name>_created`` timestamp (which the text parser
    reports as a family of its own) is left out."""
    fams = {f.name: f for f in text_string_to_metric_families(get(server, "/metrics").decode())}
    return {n: f for n, f in fams.items() if not (n.endswith("_created") and n[:-8] in fams)}


def test_doc_table_is_parsed():
    doc = documented()
    assert (
        len(doc) >= 25
        and "echo_cost_usd" in doc
        and doc["echo_worker_price_per_hour"][0] == {"worker"}
    )


def test_worker_books_follow_the_learner_and_drop_what_is_gone():
    m = LearnerMetrics()
    books = {
        "w0": {"state": "active", "accepted": 5, "rejected": {"stale": 2}, "earned_usd": 0.01},
        "w1": {"state": "standby", "accepted": 0, "rejected": {}, "earned_usd": 0.0},
    }
    m.live = LiveSources(accounts=lambda: books)
    text = m.prometheus_text().decode()
    assert 'echo_worker_records_rejected{reason="stale",worker="w0"} 2.0' in text
    assert 'echo_worker_state{state="standby",worker="w1"} 1.0' in text
    books = {"w0": {"state": "left", "accepted": 6, "rejected": {}, "earned_usd": 0.02}}
    text = m.prometheus_text().decode()  # w1's books were dropped, w0 left, its stale count gone
    assert 'worker="w1"' not in text and 'reason="stale"' not in text
    assert 'echo_worker_state{state="left",worker="w0"} 1.0' in text
    assert 'state="active"' not in text and 'echo_worker_earned_usd{worker="w0"} 0.02' in text
    assert m.state()["accounts"][0]["worker"] == "w0"


def test_metrics_match_the_documented_names_and_labels(served):
    _, server = served
    fams = families(server)
    doc = documented()
    assert set(fams) == set(doc), set(fams) ^ set(doc)
    for name, (labels, kind) in doc.items():
        fam = fams[name]
        assert fam.type == kind, name
        seen = {k for s in fam.samples for k in s.labels if k != "le"}
        assert seen == labels, (name, seen, labels)


def test_metric_values(served):
    m, server = served
    fams = families(server)

    def value(name, **labels):
        (s,) = [s for s in fams[name].samples if s.labels == labels and s.name == name]
        return s.value

    secs = 5.5 + 5 * 0.6
    expected = (0.7 + 3.06) * secs / 3600
    assert value("echo_learner_step") == 5
    assert value("echo_cost_usd") == pytest.approx(expected)
    assert value("echo_cost_per_step_usd") == pytest.approx(expected / 6)
    assert value("echo_cost_per_1k_admitted_usd") == pytest.approx(1000 * expected / 384)
    assert value("echo_rejected", reason="stale") == 5
    assert value("echo_worker_active", worker="w2") == 0
    assert value("echo_worker_price_per_hour", worker="w1") == pytest.approx(0.7)
    assert value("echo_broadcast_seconds", version="5") == pytest.approx(0.25)
    assert value("echo_buffer_groups", kind="ready") == 3
    assert value("echo_worker_checks", worker="w0") == 10
    assert value("echo_worker_quarantined", worker="evil") == 1
    assert value("echo_checks", check="sampling", outcome="fail") == 2
    assert value("echo_publish_bytes") == 30_000 and value("echo_publish_full_bytes") == 1_000_000
    assert value("echo_delta_ratio") == pytest.approx(0.03)
    assert value("echo_encode_seconds") == pytest.approx(0.2)
    assert value("echo_decode_seconds") == pytest.approx(0.25)
    assert value("echo_keyframe_installs") == 2
    assert value("echo_completions_cut") == 0.125
    stats = {s.labels["name"]: s.value for s in fams["echo_episode_stat"].samples}
    assert stats == {"won": pytest.approx(0.5), "illegal": 0.25}
    assert value("echo_ack_queue") == 2
    assert value("echo_worker_nat", worker="w1", nat="punchable") == 1
    assert value("echo_worker_transport", worker="w1", transport="punched") == 1
    assert value("echo_worker_relay_role", worker="w1", role="tail", parent="w0") == 1
    assert value("echo_worker_relay_role", worker="w2", role="unplaced", parent="") == 1
    assert value("echo_worker_link_mbit", worker="w0", direction="up") == pytest.approx(30.5)
    assert value("echo_worker_declared_mbit", worker="w2", direction="down") == 100
    assert ("w1", "up") not in {
        (s.labels["worker"], s.labels["direction"])  # not measured
        for s in fams["echo_worker_link_mbit"].samples
    }
    count = [s for s in fams["echo_staleness"].samples if s.name == "echo_staleness_count"][0]
    assert count.value == 6 + 16 * 5  # step 0: {"0": 10, "0": 6} is one key


def test_workers_that_leave_lose_their_series(served):
    m, server = served
    stats = synthetic_stats(6)
    del stats["workers"]["w2"]
    m.update(synthetic_row(6), stats)
    workers = {s.labels["worker"] for s in families(server)["echo_worker_price_per_hour"].samples}
    assert workers == {"w0", "w1"}


def test_health_and_state(served):
    m, server = served
    health = json.loads(get(server, "/health"))
    assert health["ok"] is True and health["step"] == 5
    state = json.loads(get(server, "/api/state"))
    assert state["step"] == 5 and len(state["rows"]) == 6
    assert [w["worker"] for w in state["workers"]] == ["w0", "w1", "w2"]
    assert state["decisions"][0]["reason"] == "C_eff 1 < 2"
    assert set(state["installs"]) == {str(v) for v in range(6)}
    assert state["totals"]["cost_usd"] == pytest.approx(m.cost_usd)
    page = get(server, "/").decode()
    assert 'id="cost-usd"' in page and "http://" not in page.replace(
        "http://www.w3.org/2000/svg", ""
    )
    assert server.address[1] > 0


def test_recorded_run_replays(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps(synthetic_row(s)) + "\n" for s in range(4))
    )
    (tmp_path / "decisions.jsonl").write_text(
        json.dumps({"step": 1, "action": "short", "worker": None, "reason": "no standby"}) + "\n"
    )
    (tmp_path / "config.toml").write_text("[learner]\nprice_per_hour = 3.06\n")
    m = from_run_dir(tmp_path)
    assert m.steps == 4 and m.learner_price == 3.06 and len(m.decisions) == 1


@pytest.mark.skipif(
    CHROMIUM is None, reason="needs the chromium binary (Debian package `chromium`)"
)
@pytest.mark.integration
def test_dashboard_in_headless_chromium(served, tmp_path):
    """The page renders in a real browser and shows the same numbers as /metrics."""
    _, server = served
    flags = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--no-first-run",
        "--disable-sync",
        f"--user-data-dir={tmp_path / 'profile'}",
        "--window-size=1400,1000",
        "--virtual-time-budget=5000",
    ]
    png = tmp_path / "dashboard.png"
    subprocess.run(
        flags + [f"--screenshot={png}", server.url + "/"],
        check=True,
        capture_output=True,
        timeout=120,
    )
    assert png.stat().st_size > 10_000
    dom = subprocess.run(
        flags + ["--dump-dom", server.url + "/"],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout

    def shown(elem_id: str) -> float:
        m = re.search(rf'id="{elem_id}"[^>]*data-value="([^"]*)"', dom)
        assert m and m.group(1), f"#{elem_id} not rendered"
        return float(m.group(1))

    fams = families(server)

    def metric(name: str) -> float:
        return fams[name].samples[0].value

    assert shown("step") == metric("echo_learner_step")
    assert shown("cost-usd") == pytest.approx(metric("echo_cost_usd"), rel=1e-9)
    assert shown("cost-per-1k") == pytest.approx(metric("echo_cost_per_1k_admitted_usd"), rel=1e-9)
    assert shown("bubble-ratio") == pytest.approx(metric("echo_bubble_ratio"))
    assert shown("publish-bytes") == metric("echo_publish_bytes")
    assert 'id="worker-w1"' in dom and "C_eff 1 &lt; 2" in dom
    assert re.search(r'id="checks-evil">.*?quarantined', dom)  # the checks table
    # the relay tree: parents, roles, transport, and which rates are measured or declared
    assert re.search(
        r'id="tree-w1" data-parent="w0" data-role="tail">.*?punched.*?punchable'
        r".*?30\.5 / –.*?100\.0 / 50\.0",
        dom,
    )
    assert 'id="tree-w2" data-parent="" data-role="unplaced"' in dom and "version 5" in dom
    assert "measured by the learner" in dom and "declared by the worker" in dom
    # the episode statistics table: the last step's mean of each name
    assert re.search(r'id="stat-won">.*?data-value="0\.5"', dom)
    assert re.search(r'id="stat-illegal">.*?data-value="0\.25"', dom)
