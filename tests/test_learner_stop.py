"""A learner stopped by SIGTERM or Ctrl-C writes summary.json of the steps it took (issue 30,
item 6): before, only a run that reached max_steps had one. Real processes on loopback (port 0):
a learner and one worker, then a learner alone."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest

from echo_rl.core.config import EchoConfig, dump_toml
from echo_rl.core.procs import ProcessGroup, python_argv, wait_ready

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def _learn(group: ProcessGroup, tmp: Path, cfg: EchoConfig) -> tuple[Path, str]:
    run_dir, conf = tmp / "run", tmp / "learner.toml"
    conf.write_text(dump_toml(cfg))
    proc = group.start(
        "learner",
        python_argv("echo_rl.cli.rl", "learn", str(conf), "--run-dir", str(run_dir)),
        tmp / "learner.err",
        pipe_stdout=True,
    )
    return run_dir, wait_ready(proc, timeout=120)


def _steps(run_dir: Path, n: int, timeout: float = 150) -> None:
    """The learner's append-only metrics file is its only progress signal: poll it."""
    deadline = time.monotonic() + timeout
    path = run_dir / "metrics.jsonl"
    while time.monotonic() < deadline:
        if path.exists() and len(path.read_text().splitlines()) >= n:
            return
        time.sleep(0.1)
    raise AssertionError(f"fewer than {n} learner steps within {timeout}s")


def test_sigterm_mid_run_writes_the_summary_of_the_steps_taken(tmp_path, small_cfg):
    small_cfg.learner.max_steps = 10_000
    group = ProcessGroup()
    try:
        run_dir, join = _learn(group, tmp_path, small_cfg)
        group.start(
            "w0",
            python_argv(
                "echo_rl.cli.worker",
                "join",
                join,
                "--id",
                "w0",
                "--identity",
                str(tmp_path / "w0.key"),
            ),
            tmp_path / "w0.log",
        )
        _steps(run_dir, 2)
        assert not (run_dir / "summary.json").exists()
        group.stop("learner", timeout=60, sig=signal.SIGTERM)
    finally:
        group.stop_all()
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert summary["ended"] == "stopped (SIGTERM)"
    assert summary["steps"] == len(rows) >= 2
    assert summary["last"]["step"] == json.loads(rows[-1])["step"]
    assert not (run_dir / "summary.json.tmp").exists()


def test_ctrl_c_before_any_step_writes_a_summary_of_none(tmp_path, small_cfg):
    group = ProcessGroup()
    try:
        run_dir, _ = _learn(group, tmp_path, small_cfg)
        group.stop("learner", timeout=60, sig=signal.SIGINT)
    finally:
        group.stop_all()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["ended"] == "stopped (Ctrl-C)"
    assert summary["steps"] == 0 and summary["last"] is None and summary["staleness_max"] is None
