"""Preemption and owner-first yield with real processes on loopback (docs/preemption.md)."""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path

import pytest
from test_integration import Cluster, rows, wait_rows

from echo_rl.core.procs import pin_learner_port, python_argv

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture
def cluster(tmp_path, small_cfg):
    pin_learner_port(small_cfg)
    c = Cluster(tmp_path, small_cfg)
    yield c
    c.group.stop_all()


def start_worker(cluster: Cluster, name: str, *flags: str, slowdown: float = 1.0) -> Path:
    """``slowdown`` > 1: the worker on a device that many times slower (``labs.slow_device``)."""
    status = cluster.tmp / f"{name}.json"
    entry = (
        ("labs.slow_device", "--slowdown", str(slowdown))
        if slowdown > 1
        else ("echo_rl.cli.worker",)
    )
    cluster.group.start(
        name,
        python_argv(
            *entry,
            "join",
            cluster.endpoint,
            "--id",
            name,
            "--plain",
            "--ledger",
            str(cluster.tmp / f"{name}.ledger"),
            "--identity",
            str(cluster.tmp / f"{name}.key"),
            "--status-file",
            str(status),
            *flags,
        ),
        cluster.tmp / f"{name}.log",
    )
    return status


def wait_status(path: Path, ok, timeout: float = 60) -> dict:
    """Polls the worker's status file (its published state; it is rewritten once a second)."""
    deadline = time.monotonic() + timeout
    doc: dict = {}
    while time.monotonic() < deadline:
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError):
            doc = {}
        if doc and ok(doc):
            return doc
        time.sleep(0.1)
    raise AssertionError(f"{path.name} never reached the expected state; last: {doc}")


@pytest.mark.parametrize("how", ["sigterm", "notice", "poker"])
def test_a_preempted_worker_hands_back_prefixes_another_worker_continues(cluster, how):
    from echo_rl.learner.run_audit import audit_run

    # Long rollouts, so the stop lands mid-generation: with 160 tokens a rollout took about
    # 0.2 s and a CI run's SIGTERM once landed between two (the worker waiting on the learner),
    # handing back no prefixes. 400 tokens: about 0.6 s, and the learner rarely gates the worker.
    cluster.cfg.worker.max_new_tokens = 400
    # a's prefixes wait off the queue for their check (at least one audit job a learner step),
    # then b continues them: with S = 2 they could go stale first and be generated afresh (a
    # fresh-clone run saw no continued sample). S = 4 and 12 steps leave room for both.
    cluster.cfg.learner.staleness = 4
    cluster.cfg.learner.lr = 1e-5  # the random model keeps writing long completions
    # the text vocabulary: end-of-sequence is one token in ~100, so most completions run to
    # the token limit
    cluster.cfg.model.tiny_vocab = "text"
    cluster.cfg.model.max_positions = 512
    if how == "poker":  # episodes: cut between decisions, replayed by the next worker
        cluster.cfg.adapter.name = "poker"
        # sixteen hands an episode: a rollout lasts seconds, so the stop (sent up to a second
        # after the status file said "generating") lands inside one, not between two (with
        # six hands a rollout took about one second and a fresh-clone run missed it)
        cluster.cfg.adapter.options = {
            "obs_format": "compact",
            "bot_samples": 6,
            "hands": 16,
            "opponents": ["station"],
            "max_episode_tokens": 4000,
        }
        cluster.cfg.model.max_positions = 4096
        cluster.cfg.worker.max_new_tokens = 5
    run = cluster.learner(
        "learner", max_steps=12
    )  # room for the held prefixes: checked, then continued
    # The stop must land inside a rollout. The engine (the default backend) samples these
    # rollouts several times faster than generate did, and a's stop often fell between two,
    # handing back nothing: a runs on a device 4x slower (labs.slow_device), where a rollout
    # is mostly the device's wait and a stop landing in it finds the rollout unfinished.
    a = start_worker(cluster, "a", slowdown=4)
    # generating, as a fresh write says (the file is rewritten once a second: an old
    # "generating" may describe a rollout already over)
    seen: dict[int, int] = {}  # tokens sampled when each count of finished groups was first seen

    def inside_a_rollout(d: dict) -> bool:
        """Generating, as a fresh write says, past the first rollout (which has no slow wait);
        for poker also with tokens sampled in this rollout already: an episode cut before its
        first decision has nothing to hand back (a stop once landed 3 ms into one)."""
        g, tokens = d.get("groups_generated", 0), d.get("tokens_sampled", 0)
        started = seen.setdefault(g, tokens)
        return (
            g > 0
            and d["activity"] == "generating"
            and time.time() - d["updated_at"] < 0.3
            and (how != "poker" or tokens > started)
        )

    wait_status(a, inside_a_rollout)
    if how != "notice":
        cluster.group.stop("a")  # SIGTERM: cut, hand back, drain, leave
    else:  # a spot notice: the worker stops on its own 2 s (its margin) before the deadline
        from echo_rl.cli import worker as cli

        assert cli.main(["preempt", str(a), "--in", "2.5"]) == 0
        assert cluster.wait("a", 60) == 0
        assert "preemption notice" in (cluster.tmp / "a.log").read_text()
    assert cluster.group.procs["a"].returncode == 0
    start_worker(cluster, "b")
    assert cluster.wait("learner") == 0
    got = rows(run)
    assert len(got) == 12
    a_log = (cluster.tmp / "a.log").read_text()
    assert got[-1]["handbacks"].get("prefixes", 0) > 0, a_log[-3000:]
    assert got[-1]["handbacks"]["continued_samples"] > 0  # b finished what a had started
    assert all(r["staleness_max"] <= cluster.cfg.learner.staleness for r in got)
    assert "handed back" in a_log
    audit = audit_run(
        run, [cluster.tmp / f"{w}.ledger" for w in "ab"], cluster.cfg.learner.group_size
    )
    assert audit.lost == set() and audit.groups_trained_twice == 0


def test_an_owner_burning_cpu_makes_the_worker_yield_then_resume(cluster):
    from echo_rl.learner.run_audit import audit_run

    cluster.cfg.worker.max_new_tokens = 64
    run = cluster.learner("learner", max_steps=10_000)
    status = start_worker(
        cluster,
        "w",
        "--yield-to-owner",
        "--owner-signal",
        "cpu",
        "--owner-quiet-s",
        "1",
        "--owner-cpu-cores",
        "0.5",
    )
    wait_rows(run, 2)
    # The owner: a process of the machine's user that is not Echo, burning a core.
    cluster.group.start(
        "owner", [sys.executable, "-c", "while True: pass"], cluster.tmp / "owner.log"
    )
    yielded = wait_status(status, lambda d: d["activity"] == "yielded")
    assert yielded.get("yield_stop_s", 0.0) < 1.0  # generation stopped within a second of the yield
    before = yielded["samples_generated"]
    cluster.group.stop("owner", sig=signal.SIGKILL)
    resumed = wait_status(
        status, lambda d: d["samples_generated"] > before and d["activity"] != "yielded"
    )
    assert resumed["samples_generated"] > before
    log = (cluster.tmp / "w.log").read_text()
    assert "yielding" in log and "generating again" in log
    cluster.group.stop("w")
    cluster.group.stop("learner")
    audit = audit_run(run, [cluster.tmp / "w.ledger"], cluster.cfg.learner.group_size)
    assert audit.acked and audit.lost == set()
