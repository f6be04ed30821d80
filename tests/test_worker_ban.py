"""After a ban every line of the volunteer's summary agrees (issue 30, item 5): the state row
said "active" after a ban. A real learner and worker on loopback, banned by the id the
operator sees; and the refusal met by a work request or a join (not only by a heartbeat or a
delivery) ends the worker through the same path."""

from __future__ import annotations

import asyncio
import subprocess
import time

import pytest
from worker_doubles import ScriptedClient, make_generation

from echo_rl.cli.commands.admin import main as admin_main
from echo_rl.core import wire
from echo_rl.core.config import dump_toml
from echo_rl.core.procs import ProcessGroup, python_argv, wait_ready
from echo_rl.worker.agent import WorkerError
from echo_rl.worker.status import WorkerStatus, read_status, rows

BANNED = "this key is banned (banned by the operator)"


def _agrees(doc: WorkerStatus) -> list[tuple[str, str]]:
    """The rows that still speak of the worker as taking part."""
    return [
        (name, value)
        for name, value in rows(doc)
        if name != "active time" and ("active" in value or "standby" in value)
    ]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_banned_worker_s_summary_and_status_agree(tmp_path, small_cfg):
    small_cfg.learner.max_steps = 100_000
    conf, run = tmp_path / "learner.toml", tmp_path / "run"
    conf.write_text(dump_toml(small_cfg))
    group = ProcessGroup()
    try:
        learner = group.start(
            "learner",
            python_argv("echo_rl.cli.rl", "learn", str(conf), "--run-dir", str(run)),
            tmp_path / "l.log",
            pipe_stdout=True,
        )
        line = wait_ready(learner, timeout=120)
        status = tmp_path / "w0.json"
        worker = group.start(
            "w0",
            python_argv(
                "echo_rl.cli.worker",
                "join",
                line,
                "--id",
                "w0",
                "--identity",
                str(tmp_path / "w0.key"),
                "--status-file",
                str(status),
                "--plain",
            ),
            tmp_path / "w0.log",
        )
        deadline = time.monotonic() + 180
        while not _delivered(status):  # a worker in the middle of its work
            assert time.monotonic() < deadline and worker.poll() is None, "nothing delivered"
            time.sleep(0.05)
        assert admin_main(["worker", "ban", "w0", "--run-dir", str(run)]) == 0
        assert worker.wait(30) == 1
    except subprocess.TimeoutExpired:
        raise AssertionError("the banned worker did not exit within 30 s") from None
    finally:
        group.stop_all()
    doc = read_status(status)
    table = dict(rows(doc))
    assert table["state"] == "quarantined, exited"
    assert "banned" in table["exit"] and "banned" in table["learner says"]
    assert _agrees(doc) == []
    log = (tmp_path / "w0.log").read_text()
    summary = log[log.rindex("echo-worker w0: summary") :]  # the table printed at exit
    assert "quarantined, exited" in summary and "active ·" not in summary


def _delivered(status) -> bool:
    try:
        account = read_status(status).account if status.exists() else None
        return account is not None and account.accepted > 0
    except (OSError, ValueError):
        return False


@pytest.mark.timeout(30)
@pytest.mark.parametrize("step", ["work", "join"])
def test_a_ban_met_by_a_work_request_or_a_join_is_a_ban(step):
    refusing = ScriptedClient(lambda msg: wire.Error(reason="banned", detail=BANNED, rid=msg.rid))
    g = make_generation(refusing)
    g.status.update(account={"state": "active", "message": "joined: active"})
    with pytest.raises(WorkerError, match="banned this worker's key"):
        asyncio.run(g.request_work() if step == "work" else g.session.join())
    doc = g.status.doc
    assert doc.account.state == "quarantined" and doc.account.message == BANNED
    assert _agrees(doc.model_copy(update={"exit": "banned"})) == []
