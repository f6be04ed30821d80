"""A volunteer joined to two runs at once (issue 35, docs/multirun.md): real learners and one
``echo-worker join LINE1 LINE2`` process on loopback (port 0).

Both runs train from the one worker; each run keeps its own books and status; and nothing of
one run leaks into the other: a ban by one learner ends that run only, and the other run goes
on taking steps from the same worker process."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from echo_rl.cli.commands.admin import main as admin_main
from echo_rl.cli.worker import main as worker_main
from echo_rl.core.config import EchoConfig, dump_toml
from echo_rl.core.procs import ProcessGroup, python_argv, wait_ready
from echo_rl.worker.status import read_status


def _learner(group: ProcessGroup, tmp: Path, name: str, cfg: EchoConfig) -> tuple[Path, str]:
    conf, run = tmp / f"{name}.toml", tmp / name
    conf.write_text(dump_toml(cfg))
    proc = group.start(
        name,
        python_argv("echo_rl.cli.rl", "learn", str(conf), "--run-dir", str(run)),
        tmp / f"{name}.log",
        pipe_stdout=True,
    )
    return run, wait_ready(proc, timeout=120)


def _steps(run: Path) -> int:
    path = run / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def _wait(what: str, check, timeout: float, alive) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert alive.poll() is None, f"the worker exited while waiting for {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_one_worker_serves_two_runs_and_a_ban_by_one_leaves_the_other(
    tmp_path, small_cfg, monkeypatch, capsys
):
    small_cfg.learner.max_steps = 100_000
    other = small_cfg.model_copy(deep=True)
    other.seed = small_cfg.seed + 1
    group = ProcessGroup()
    status_dir = tmp_path / "status"
    try:
        run_a, line_a = _learner(group, tmp_path, "a", small_cfg)
        run_b, line_b = _learner(group, tmp_path, "b", other)
        worker = group.start(
            "w0",
            python_argv(
                "echo_rl.cli.worker",
                "join",
                line_a,
                line_b,
                "--share",
                "1,1",
                "--id",
                "w0",
                "--identity",
                str(tmp_path / "w0.key"),
                "--plain",
            ),
            tmp_path / "w0.log",
            env={"ECHO_STATUS_DIR": str(status_dir)},
        )
        _wait("2 steps in each run", lambda: min(_steps(run_a), _steps(run_b)) >= 2, 240, worker)
        files = sorted(status_dir.glob("w0@*.json"))
        assert len(files) == 2, files

        def both_used_the_device() -> bool:  # the status files follow once a second
            docs = [read_status(f) for f in files]
            return all(d.sharing is not None and d.sharing.device_s > 0 for d in docs)

        _wait("both runs' status to show device time", both_used_the_device, 30, worker)
        assert all(read_status(f).sharing.runs == 2 for f in files)

        assert admin_main(["worker", "ban", "w0", "--run-dir", str(run_a)]) == 0
        endpoint_a = line_a.split("//")[1].split("/")[0]
        doc_a = next(f for f in files if endpoint_a.replace(":", "_") in f.name)
        _wait("run a to end with the ban", lambda: read_status(doc_a).exit is not None, 60, worker)
        assert "banned" in (read_status(doc_a).exit or ""), (tmp_path / "w0.log").read_text()[
            -4000:
        ]
        at_ban = _steps(run_b)
        _wait("2 more steps in run b", lambda: _steps(run_b) >= at_ban + 2, 180, worker)
        assert worker.poll() is None  # the process serves run b still
        doc_b = next(f for f in files if f != doc_a)
        assert read_status(doc_b).exit is None
        assert read_status(doc_b).account.state == "active"
        # `echo-worker status` shows each run the process serves, the banned one as such
        monkeypatch.setenv("ECHO_STATUS_DIR", str(status_dir))
        assert worker_main(["status"]) == 0
        shown = capsys.readouterr().out
        assert shown.count("echo-worker w0 (running") == 1, shown  # run b
        assert shown.count("echo-worker w0 (not running") == 1, shown  # run a: banned
        assert "banned" in shown and "2 runs; this run" in shown  # run a's, as it ended
    finally:
        group.stop_all()


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "argv, says",
    [
        (
            ["echo://127.0.0.1:1/" + "a" * 64, "echo://127.0.0.1:2/" + "b" * 64, "--share", "1"],
            "--share gives 1 shares for 2 join lines",
        ),
        (["echo://127.0.0.1:1/" + "a" * 64, "echo://127.0.0.1:1/" + "b" * 64], "is named twice"),
        (
            ["echo://127.0.0.1:1/" + "a" * 64, "echo://127.0.0.1:2/" + "b" * 64, "--token", "t"],
            "put each run's token in its join line",
        ),
        (["echo://127.0.0.1:1/" + "a" * 64, "--runs", "x.toml"], "not both"),
        (
            ["echo://127.0.0.1:1/" + "a" * 64, "echo://127.0.0.1:2/" + "b" * 64, "--resident", "0"],
            "--resident 0",
        ),
    ],
)
def test_bad_multirun_flags_say_what_to_fix(argv, says, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("ECHO_HOME", str(tmp_path))
    assert worker_main(["join", *argv, "--identity", str(tmp_path / "k")]) == 2
    assert says in capsys.readouterr().err


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "text, says",
    [
        ("", "no [[run]] table"),
        ("[[run]]\nshare = 1\n", "has no line"),
        (
            '[[run]]\nline = "echo://127.0.0.1:1/' + "a" * 64 + '"\nweight = 2\n',
            "unknown keys ['weight']",
        ),
        ('[[run]]\nline = "echo://127.0.0.1:1/' + "a" * 64 + '"\nshare = 0\n', "share must be > 0"),
        ("[[run]\n", "--runs"),
    ],
)
def test_a_bad_runs_file_names_the_problem(text, says, capsys, tmp_path):
    path = tmp_path / "runs.toml"
    path.write_text(text)
    assert worker_main(["join", "--runs", str(path), "--identity", str(tmp_path / "k")]) == 2
    assert says in capsys.readouterr().err


def test_a_runs_file_gives_each_run_its_line_share_and_price(tmp_path):
    from echo_rl.worker.multirun import specs_from_file

    path = tmp_path / "runs.toml"
    a, b = "echo://10.0.0.1:5555/" + "a" * 64 + "?token=T1", "echo://10.0.0.2:5555/" + "b" * 64
    path.write_text(f'[[run]]\nline = "{a}"\nshare = 3\n\n[[run]]\nline = "{b}"\nprice = 0.5\n')
    specs = specs_from_file(path)
    assert [(s.name, s.line.token, s.share, s.price) for s in specs] == [
        ("10.0.0.1:5555", "T1", 3.0, 0.0),
        ("10.0.0.2:5555", "", 1.0, 0.5),
    ]


def test_the_help_names_the_multirun_flags():
    out = subprocess.run(
        python_argv("echo_rl.cli.worker", "join", "--help"),
        capture_output=True,
        text=True,
        timeout=30,
    ).stdout
    assert "--runs" in out and "--share" in out and "--resident" in out


def test_each_run_gets_its_own_relay_ports_two_above_the_last():
    from echo_rl.cli.worker import build_parser
    from echo_rl.cli.worker_join import _relay

    args = build_parser().parse_args(
        ["join", "echo://a:1/" + "a" * 64, "--relay-host", "10.0.0.5", "--no-spill"]
    )
    ports = [(r.port, r.punch_port) for r in (_relay(args, "tcp://a:1", i) for i in range(3))]
    assert ports == [(5560, 5561), (5562, 5563), (5564, 5565)]
    loopback = build_parser().parse_args(["join", "echo://a:1/" + "a" * 64, "--no-spill"])
    assert {_relay(loopback, "tcp://127.0.0.1:1", i).port for i in range(3)} == {0}


@pytest.mark.timeout(60)
def test_the_runs_of_one_process_share_one_memory_budget(tmp_path, monkeypatch):
    """`echo-worker join LINE1 LINE2 --host-memory-gb G` gives every run the one budget
    (echo_rl.core.memplan.HostBudget: what the runs need together is checked against G; its own
    rules are tests/test_memplan.py::test_runs_in_one_process_share_its_budget_with_the_fixed_part_counted_once)."""
    from echo_rl.cli import worker as cli

    monkeypatch.setenv("ECHO_STATUS_DIR", str(tmp_path / "status"))
    seen = []

    class Fake:
        def __init__(self, line, **kw):
            seen.append((kw["shared"].seat.name, kw["shared"].host_budget))
            self.status = kw["status"].board

        async def run(self):
            return "done"

    lines = ["echo://127.0.0.1:1/" + "a" * 64, "echo://127.0.0.1:2/" + "b" * 64]
    argv = ["join", *lines, "--host-memory-gb", "6", "--identity", str(tmp_path / "k")]
    assert cli.main(argv, make_worker=Fake) == 0
    (a, budget_a), (b, budget_b) = seen
    assert a != b and budget_a is budget_b and budget_a.budget_gb == 6.0
