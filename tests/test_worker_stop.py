"""SIGTERM ends a worker within 5 s whatever it is doing (issue 30, item 5): waiting for a
learner that never answers, loading its model, waiting for a snapshot that never comes,
generating, relaying to a chain child, and idle (standby). The issue saw 21 s while waiting
for a snapshot. Real processes on loopback (port 0), stopped by pid; each test waits for the
state it needs by reading the worker's status file or log, then times SIGTERM -> exit."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from echo_rl.core.config import EchoConfig, dump_toml
from echo_rl.core.procs import ProcessGroup, python_argv, wait_ready
from echo_rl.core.security import JoinLine, KeyPair

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

EXIT_S = 5.0


def _until(what: str, check: Callable[[], bool], timeout: float = 150.0) -> None:
    """Wait for a condition a process shows in its files (its status or log)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.05)
    raise AssertionError(f"not seen within {timeout:.0f} s: {what}")


def _status(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _log(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


class Fleet:
    """A learner and workers in one test's folder, every process stopped at the end."""

    def __init__(self, tmp: Path):
        self.tmp, self.group = tmp, ProcessGroup()
        self.run_dir = tmp / "run"

    def learner(self, cfg: EchoConfig, *sets: str) -> str:
        conf = self.tmp / "learner.toml"
        conf.write_text(dump_toml(cfg))
        argv = python_argv(
            "echo_rl.cli.rl",
            "learn",
            str(conf),
            "--run-dir",
            str(self.run_dir),
            *[a for s in sets for a in ("--set", s)],
        )
        proc = self.group.start("learner", argv, self.tmp / "learner.log", pipe_stdout=True)
        return wait_ready(proc, timeout=120)

    def worker(self, name: str, line: str, *flags: str) -> tuple[subprocess.Popen, Path, Path]:
        status, log = self.tmp / f"{name}.json", self.tmp / f"{name}.log"
        proc = self.group.start(
            name,
            python_argv(
                "echo_rl.cli.worker",
                "join",
                line,
                "--id",
                name,
                "--identity",
                str(self.tmp / f"{name}.key"),
                "--status-file",
                str(status),
                *flags,
            ),
            log,
        )
        return proc, status, log

    def sigterm(self, name: str) -> None:
        """SIGTERM; the process must exit 0 within ``EXIT_S`` (a deadline, like ``_until``'s: the
        seconds it took are printed, not asserted)."""
        proc = self.group.procs[name]
        assert proc.poll() is None, f"{name} exited before the signal"
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(EXIT_S)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{name} still running {EXIT_S:.0f} s after SIGTERM") from None
        print(f"{name}: SIGTERM -> exit {time.monotonic() - t0:.2f} s")
        assert code == 0, f"{name} exited {code}"

    def close(self) -> None:
        self.group.stop_all()


@pytest.fixture
def fleet(tmp_path):
    f = Fleet(tmp_path)
    yield f
    f.close()


def _cfg(small_cfg: EchoConfig) -> EchoConfig:
    small_cfg.learner.max_steps = 100_000
    return small_cfg


def _installed(status: Path) -> bool:
    return _status(status).get("installed_version", -1) >= 0


def test_waiting_for_a_learner_that_never_answers(fleet):
    """A listener that accepts and never speaks: the join waits on it, and a stop must not
    wait for the join's request timeout."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        line = str(
            JoinLine(f"tcp://127.0.0.1:{silent.getsockname()[1]}", KeyPair.generate().public)
        )
        _, status, _ = fleet.worker("w0", line)
        _until("the worker's first status", lambda: _status(status).get("activity") is not None)
        fleet.sigterm("w0")
    assert _status(status).get("installed_version") == -1 and _status(status).get("account") is None


def test_loading_its_model(fleet, small_cfg):
    """SIGTERM as soon as the join is answered: the model is loading (on its own thread)."""
    line = fleet.learner(_cfg(small_cfg))
    _, status, log = fleet.worker("w0", line)
    _until("the join answered", lambda: "joined run" in _log(log))
    fleet.sigterm("w0")
    assert not _installed(status)


def test_waiting_for_a_snapshot_that_never_comes(fleet, small_cfg):
    """The learner hands out a snapshot source nobody listens on (its public host is another
    loopback address than the one it binds: the issue's unreachable 0.0.0.0, on one host)."""
    line = fleet.learner(_cfg(small_cfg), "learner.public_host=127.0.0.2")
    _, status, _ = fleet.worker("w0", line.replace("127.0.0.2", "127.0.0.1"))
    _until(
        "the model loaded, the snapshot still missing",
        lambda: "model loaded" in (_status(status).get("install_phase") or ""),
    )
    assert not _installed(status) and _status(status)["account"] is not None
    fleet.sigterm("w0")


def test_generating(fleet, small_cfg):
    """Many groups per grant, so the worker spends most of its time generating."""
    small_cfg.worker.groups_per_request = 16
    small_cfg.learner.max_outstanding_groups = 64
    line = fleet.learner(_cfg(small_cfg))
    _, status, _ = fleet.worker("w0", line)
    _until(
        "the worker generating",
        lambda: (
            _status(status).get("activity") == "generating"
            and _status(status).get("groups_generated", 0) > 0
        ),
    )
    fleet.sigterm("w0")


def test_relaying_to_a_chain_child(fleet, small_cfg):
    """One chain (a slow learner uplink, fast workers): learner -> w0 -> w1. Stopped once w1
    has received a version from w0's relay."""
    line = fleet.learner(
        _cfg(small_cfg),
        "broadcast.uplink_mbit=10",
        "broadcast.link_mbit=100",
        "broadcast.topology=chains",
    )
    chunk_port = json.loads((fleet.run_dir / "learner.json").read_text())["ports"]["chunks"]
    fleet.worker("w0", line)
    _until("w0 installed", lambda: _installed(fleet.tmp / "w0.json"))
    fleet.worker("w1", line)
    relayed = re.compile(r"received snapshot v\d+ .*chunks from tcp://127\.0\.0\.1:(\d+)")

    def from_w0() -> bool:
        return any(int(p) != chunk_port for p in relayed.findall(_log(fleet.tmp / "w1.log")))

    _until("w1 fed by w0's relay", from_w0)
    fleet.sigterm("w0")


def test_idle_in_standby(fleet, small_cfg):
    """Provisioning keeps the second worker standby (one active at start, no probation, no
    window closes during the test): installed, relaying if asked, generating nothing."""
    line = fleet.learner(
        _cfg(small_cfg),
        "provisioning.enabled=true",
        "provisioning.initial_active=1",
        "provisioning.probation_slots=0",
        "provisioning.window_s=600",
        "provisioning.warmup_s=600",
    )
    fleet.worker("w0", line)
    _until(
        "w0 active",
        lambda: (_status(fleet.tmp / "w0.json").get("account") or {}).get("state") == "active",
    )
    _, status, _ = fleet.worker("w1", line)
    _until(
        "w1 installed, standby",
        lambda: (
            _installed(status) and (_status(status).get("account") or {}).get("state") == "standby"
        ),
    )
    fleet.sigterm("w1")
    assert _status(status)["groups_generated"] == 0
