"""The real thing on loopback: a learner process and worker processes, started and stopped by pid."""

from __future__ import annotations

import json
import shutil
import signal
import time
from pathlib import Path

import msgpack
import pytest
import zmq

from echo_rl.core import wire
from echo_rl.core.config import EchoConfig, dump_toml
from echo_rl.core.procs import ProcessGroup, pin_learner_port, python_argv, wait_ready
from echo_rl.core.security import JoinLine, KeyPair, curve_client

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


class Cluster:
    def __init__(self, tmp: Path, cfg: EchoConfig):
        self.tmp, self.cfg, self.group = tmp, cfg, ProcessGroup()
        self.endpoint = ""

    def learner(
        self, name: str = "learner", resume: Path | None = None, **learner_overrides
    ) -> Path:
        cfg = self.cfg.model_copy(deep=True)
        for k, v in learner_overrides.items():
            setattr(cfg.learner, k, v)
        run_dir = resume or self.tmp / name
        run_dir.mkdir(exist_ok=True)
        conf = self.tmp / f"{name}.toml"
        conf.write_text(dump_toml(cfg))
        where = ["--resume", str(run_dir)] if resume else ["--run-dir", str(run_dir)]
        proc = self.group.start(
            name,
            python_argv("echo_rl.cli.rl", "learn", str(conf), *where),
            self.tmp / f"{name}.err",
            pipe_stdout=True,
        )
        self.endpoint = wait_ready(proc, timeout=120)
        return run_dir

    def dealer(self, ctx: zmq.Context) -> zmq.Socket:
        """A hand-driven peer of the learner: CURVE with a fresh key, pinned to its key."""
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.RCVTIMEO, 10_000)
        line = JoinLine.parse(self.endpoint)
        curve_client(sock, KeyPair.generate(), line.server_key)
        sock.connect(line.endpoint)
        return sock

    def worker(self, name: str) -> None:
        self.group.start(
            name,
            python_argv(
                "echo_rl.cli.worker",
                "join",
                self.endpoint,
                "--id",
                name,
                "--price",
                "0.35",
                "--ledger",
                str(self.tmp / f"{name}.ledger"),
                "--identity",
                str(self.tmp / f"{name}.key"),
            ),
            self.tmp / f"{name}.log",
        )

    def wait(self, name: str, timeout: float = 180) -> int:
        return self.group.procs[name].wait(timeout)


@pytest.fixture
def cluster(tmp_path, small_cfg):
    c = Cluster(tmp_path, small_cfg)
    yield c
    c.group.stop_all()


def rows(run_dir: Path) -> list[dict]:
    p = run_dir / "metrics.jsonl"
    return [json.loads(x) for x in p.read_text().splitlines()] if p.exists() else []


def wait_rows(run_dir: Path, n: int, timeout: float = 120) -> list[dict]:
    """Polls the learner's append-only metrics file (it has no other progress signal)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = rows(run_dir)
        if len(got) >= n:
            return got
        time.sleep(0.1)
    raise AssertionError(f"fewer than {n} learner steps within {timeout}s")


def wait_log(path: Path, text: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text():
            return
        time.sleep(0.1)
    raise AssertionError(f"{text!r} not in {path} within {timeout}s")


def test_learner_and_two_workers_train_within_staleness(cluster):
    run = cluster.learner(max_steps=6)
    cluster.worker("w0")
    cluster.worker("w1")
    assert cluster.wait("learner") == 0
    got = rows(run)
    assert [r["step"] for r in got] == list(range(6))
    assert all(r["staleness_max"] <= cluster.cfg.learner.staleness for r in got)
    assert got[-1]["admitted"] >= 6 * 4 * 4 and got[-1]["active_workers"] == 2
    # told the run is over, workers exit on their own with status 0
    assert cluster.wait("w0", 30) == 0 and cluster.wait("w1", 30) == 0


def test_killed_worker_does_not_stop_training(cluster):
    run = cluster.learner(max_steps=10_000)
    cluster.worker("w0")
    cluster.worker("w1")
    wait_rows(run, 2)
    cluster.group.stop("w0", sig=signal.SIGKILL)
    wait_log(run / "learner.log", "w0 removed (no heartbeat")
    after = len(rows(run))
    got = wait_rows(run, after + 5)  # the learner keeps stepping on w1 alone
    assert got[-1]["active_workers"] == 1
    assert cluster.group.procs["learner"].poll() is None
    cluster.group.stop("learner", timeout=60)


def test_junk_on_learner_sockets_is_rejected_while_training(cluster):
    run = cluster.learner(max_steps=8)
    cluster.worker("w0")
    wait_rows(run, 1)
    ctx = zmq.Context()
    sock = cluster.dealer(ctx)
    sock.send(wire.encode(wire.Join(worker_id="evil", can_relay=False)))
    assert isinstance(wire.decode(sock.recv(), 1 << 24), wire.JoinAck)
    junk = [
        b"\xc1",
        msgpack.packb({"v": 7, "type": "join"}),
        b"y" * (3 * 2**20),
        wire.encode(
            wire.Trajectories(
                worker_id="evil",
                batch_id="x",
                count=1,
                payload=wire.pack_records([{"group_id": 1}]),
            )
        ),
    ]
    reasons = []
    for frame in junk:
        sock.send(frame)
        reply = wire.decode(sock.recv(), 1 << 24)
        while isinstance(reply, wire.SnapshotNotice):  # a joined key also gets notices
            reply = wire.decode(sock.recv(), 1 << 24)
        reasons.append(reply.reason if isinstance(reply, wire.Error) else reply.rejected)
    sock.close(linger=0)
    ctx.term()
    assert reasons == ["malformed", "wrong_version", "oversize", {"invalid_fields": 1}]
    assert cluster.wait("learner") == 0
    last = rows(run)[-1]
    assert len(rows(run)) == 8
    assert {"malformed", "wrong_version", "oversize", "invalid_fields"} <= set(last["rejected"])
    assert "rejected message from" in (run / "learner.log").read_text()


@pytest.mark.alone  # the goodbye has the last 1 s of a 5 s stop: a loaded machine missed it once
def test_worker_leaves_cleanly_on_sigterm(cluster):
    run = cluster.learner(max_steps=1000)
    cluster.worker("w0")
    wait_rows(run, 1)
    assert cluster.group.stop("w0", timeout=60) == 0
    cluster.group.stop("learner", timeout=60)
    assert "w0 removed (left)" in (run / "learner.log").read_text()


def test_worker_survives_learner_restart(cluster):
    pin_learner_port(cluster.cfg)
    first = cluster.learner("learner-a", max_steps=1000)
    cluster.worker("w0")
    wait_rows(first, 1)
    cluster.group.stop("learner-a", sig=signal.SIGKILL)
    # Same address and the same learner key (the operator's), new run and instance: workers
    # pin the key, so a learner with another key would be refused (test_security.py).
    key = cluster.tmp / "learner-b" / "security" / "learner.key"
    key.parent.mkdir(parents=True)
    shutil.copy(first / "security" / "learner.key", key)
    second = cluster.learner("learner-b", max_steps=3)
    assert cluster.wait("learner-b") == 0
    assert len(rows(second)) == 3 and rows(second)[-1]["active_workers"] == 1
    assert cluster.wait("w0", 30) == 0
    assert "learner restarted" in (cluster.tmp / "w0.log").read_text()


def test_quickstart_interrupt_leaves_no_orphans(tmp_path):
    import subprocess
    import sys

    run_dir = tmp_path / "qs"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "echo_rl.cli.rl",
            "quickstart",
            "--workers",
            "2",
            "--run-dir",
            str(run_dir),
            "--set",
            "learner.max_steps=10000",
            "--set",
            "learner.prompts_per_step=4",
            "--set",
            "learner.group_size=4",
            "--set",
            "learner.max_outstanding_groups=8",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_rows(run_dir, 2)
        children = [
            int(p) for p in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        ]
        assert len(children) == 3  # learner + 2 workers
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 130
        for pid in children:
            assert (
                not Path(f"/proc/{pid}").exists()
                or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
            )
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.parametrize("release_thread", ["off", "on"])
def test_sigkill_learner_and_resume_loses_nothing_acknowledged(cluster, release_thread):
    """With the release thread on (echo_rl/learner/releasing.py: checkpoints written while the next
    step trains, the buffer log compacted only when a checkpoint holds every step taken) a
    SIGKILL loses nothing either."""
    from echo_rl.learner.checkpoint import load_checkpoint
    from echo_rl.learner.run_audit import audit_run

    pin_learner_port(cluster.cfg)
    cluster.cfg.learner.release_thread = release_thread
    cluster.cfg.learner.staleness = 4  # kappa = 3: steps after a checkpoint are lost and redone
    run = cluster.learner("first", max_steps=10_000)
    workers = ["w0", "w1"]
    for w in workers:
        cluster.worker(w)
    wait_rows(run, 7)
    cluster.group.stop("first", sig=signal.SIGKILL)
    ckpt_step = load_checkpoint(run)["step"]
    # Make the kill land in the narrowest window every time: after the checkpoint of a step,
    # before that step's metrics line (the line must come back from the checkpoint).
    metrics = run / "metrics.jsonl"
    metrics.write_text(
        "".join(
            line + "\n"
            for line in metrics.read_text().splitlines()
            if json.loads(line)["step"] < ckpt_step
        )
    )
    cluster.learner("second", resume=run, max_steps=ckpt_step + 8)
    assert cluster.wait("second") == 0
    for w in workers:  # the same worker processes, re-joined: they never restarted
        assert cluster.wait(w, 30) == 0
        assert "learner restarted" in (cluster.tmp / f"{w}.log").read_text()
    got = rows(run)
    assert [r["step"] for r in got] == list(range(ckpt_step + 8))  # the version continues
    assert all(r["version"] == r["step"] for r in got)
    audit = audit_run(
        run, [cluster.tmp / f"{w}.ledger" for w in workers], cluster.cfg.learner.group_size
    )
    assert len(audit.acked) > ckpt_step * 4 * cluster.cfg.learner.group_size
    assert audit.lost == set()


@pytest.mark.skipif(
    __import__("shutil").which("chromium") is None,
    reason="needs the chromium binary (Debian package `chromium`)",
)
def test_quickstart_dashboard_in_chromium_matches_metrics(cluster, tmp_path):
    import re
    import shutil
    import subprocess
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    run = cluster.learner(max_steps=10_000)
    cluster.worker("w0")
    wait_rows(run, 3)
    cluster.group.stop("w0", sig=signal.SIGKILL)  # the learner starves: its figures settle
    wait_log(run / "learner.log", "w0 removed (no heartbeat")
    url = json.loads((run / "learner.json").read_text())["metrics"]
    flags = [
        shutil.which("chromium"),
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
        flags + [f"--screenshot={png}", url + "/"], check=True, capture_output=True, timeout=120
    )
    assert png.stat().st_size > 10_000
    dom = subprocess.run(
        flags + ["--dump-dom", url + "/"], check=True, capture_output=True, text=True, timeout=120
    ).stdout
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    metric = {f.name: f.samples[0].value for f in text_string_to_metric_families(text) if f.samples}

    def shown(elem_id: str) -> float:
        m = re.search(rf'id="{elem_id}"[^>]*data-value="([^"]*)"', dom)
        assert m and m.group(1), f"#{elem_id} not rendered"
        return float(m.group(1))

    assert shown("step") == metric["echo_learner_step"] >= 2
    assert shown("cost-usd") == pytest.approx(metric["echo_cost_usd"], rel=1e-9)
    assert shown("bubble-ratio") == pytest.approx(metric["echo_bubble_ratio"])
    cluster.group.stop("learner", timeout=60)


def _chaos(cluster: Cluster, name: str, target: str, *flags: str) -> str:
    """A chaos proxy process in front of ``target``; returns the endpoint workers should join."""
    from labs import child_env
    from labs.chaos import READY_PREFIX

    line = JoinLine.parse(target)
    host_port = line.endpoint.removeprefix("tcp://")
    proc = cluster.group.start(
        name,
        python_argv(
            "labs.chaos",
            "--target",
            host_port,
            *flags,
            "--stats",
            str(cluster.tmp / f"{name}.json"),
        ),
        cluster.tmp / f"{name}.err",
        pipe_stdout=True,
        env=child_env(),
    )
    ready = proc.stdout.readline().decode()  # printed once it listens (or it exits)
    assert ready.startswith(READY_PREFIX), (cluster.tmp / f"{name}.err").read_text()
    port = ready[len(READY_PREFIX) :].strip()
    return str(JoinLine(f"tcp://127.0.0.1:{port}", line.server_key, line.token))


def test_nothing_acknowledged_is_lost_or_trained_twice_over_a_misbehaving_link(cluster):
    """Workers reach the learner only through a link that adds latency, stalls, and cuts
    connections with RSTs every second or so (messages in flight are lost). Training goes on;
    every batch a worker saw acknowledged is trained on, still buffered or a counted stale drop;
    no sample is trained twice (at-least-once delivery, exactly-once admission)."""
    from echo_rl.learner.run_audit import audit_run

    cluster.cfg.transport.request_timeout_s = 2.0  # a lost request is retried soon
    cluster.cfg.transport.heartbeat_timeout_s = 8.0
    run = cluster.learner(max_steps=30)
    learner_endpoint = cluster.endpoint
    cluster.endpoint = _chaos(
        cluster,
        "chaos",
        learner_endpoint,
        "--latency-ms",
        "20",
        "--reset-every-s",
        "0.3",
        "--stall-every-s",
        "3",
        "--stall-s",
        "0.5",
    )
    workers = ["w0", "w1"]
    for w in workers:
        cluster.worker(w)
    assert cluster.wait("learner", 200) == 0
    assert cluster.group.stop("chaos") == 0
    chaos = json.loads((cluster.tmp / "chaos.json").read_text())
    assert chaos["resets"] >= 3, chaos  # the link really misbehaved
    got = rows(run)
    assert [r["step"] for r in got] == list(range(30))
    assert all(r["staleness_max"] <= cluster.cfg.learner.staleness for r in got)
    audit = audit_run(
        run, [cluster.tmp / f"{w}.ledger" for w in workers], cluster.cfg.learner.group_size
    )
    assert audit.groups_trained_twice == 0
    assert audit.acked and audit.lost == set()


def test_deltas_rebuild_bit_exact_and_a_late_joiner_takes_a_keyframe(cluster):
    """Every version after the first travels as a delta; a worker that joins late has no base,
    so it fetches the current version's full payload (a keyframe) and goes on with deltas."""
    cluster.cfg.broadcast.keyframe_every = 1000
    cluster.cfg.broadcast.dtype = "bfloat16"  # float32 snapshots change in every element
    cluster.cfg.broadcast.delta_max_ratio = 1.0  # a delta even where most of the model changed
    run = cluster.learner(max_steps=10_000, lr=1e-5)  # an RL-sized step: deltas are small
    cluster.worker("w0")
    wait_rows(run, 4)
    cluster.worker("w1")
    w1_log = cluster.tmp / "w1.log"
    wait_log(w1_log, "then a keyframe", timeout=120)
    got = wait_rows(run, len(rows(run)) + 4)
    deltas = [r for r in got if r.get("publish_encoding") == "delta"]
    assert deltas and all(r["publish_bytes"] < 0.5 * r["publish_full_bytes"] for r in deltas)
    assert got[-1]["keyframe_installs"] >= 1 and got[-1]["keyframes_published"] == 1
    # w0 rebuilt every version from its predecessor: each result matched the signed hashes
    w0 = (cluster.tmp / "w0.log").read_text()
    assert "(delta," in w0 and "fetching a keyframe" not in w0
    after = w1_log.read_text().split("then a keyframe", 1)[1]
    wait_log(w1_log, "(delta,", timeout=60) if "(delta," not in after else None
    assert "(delta," in w1_log.read_text().split("then a keyframe", 1)[1]
    cluster.group.stop("learner", timeout=60)
