"""The first install's progress and time, as the volunteer sees them (issue 30, item 5): the
status names what the install waits on (the model, the snapshot's chunks) and for how long,
and after it how long each part took. A fake clock."""

from __future__ import annotations

from fakes import FakeClock

from echo_rl.worker.status import InstallProgress, StatusBoard, plain_line, rows


def _installed_row(board: StatusBoard) -> str:
    return dict(rows(board.doc))["installed snapshot"]


def test_the_status_says_what_the_first_install_waits_on_then_what_it_took():
    clock, board = FakeClock(), StatusBoard("w0", "tcp://127.0.0.1:5555", 0.0, None)
    p = InstallProgress(clock)
    assert p.phase(None) is None  # not joined yet: the join's own words say what happens
    clock.t = 0.5
    p.joined()
    clock.t = 2.0
    board.update(install_phase=p.phase((0, 1, 2)))
    assert _installed_row(board) == (
        "none yet: loading the model; fetching snapshot v0: 1/2 chunks (2 s since joining)"
    )
    clock.t = 3.0
    p.received()
    p.loaded()
    board.update(install_phase=p.phase(None))
    assert (
        "model loaded in 2.5 s; snapshot received, installing (2 s since joining)"
        in _installed_row(board)
    )
    clock.t = 3.5
    first = p.installed()
    assert first == {"since_start_s": 3.5, "since_join_s": 3.0, "model_s": 2.5, "snapshot_s": 2.5}
    assert p.installed() is None and p.phase(None) is None  # once
    board.update(installed_version=0, install_s=0.01, install_phase=None, first_install=first)
    assert _installed_row(board) == (
        "v0 (loaded in 0.01 s); first install 3.0 s after joining (model 2.5 s, snapshot 2.5 s)"
    )


def test_a_worker_waiting_for_a_snapshot_that_never_comes_says_so():
    clock = FakeClock()
    p = InstallProgress(clock)
    p.joined()
    p.loaded()
    clock.t = 40.0
    assert p.phase(None) == (
        "model loaded in 0.0 s; waiting for the learner's snapshot (40 s since joining)"
    )


def test_the_plain_log_line_carries_the_install_s_progress():
    board = StatusBoard("w0", "tcp://127.0.0.1:5555", 0.0, None)
    board.update(
        account={"state": "active"},
        install_phase="loading the model; waiting for the learner's snapshot (3 s since joining)",
    )
    assert (
        "; first snapshot: loading the model; waiting for the learner's snapshot (3 s since "
        "joining);" in plain_line(board.doc)
    )
    board.update(installed_version=2, install_phase=None)
    assert "; snapshot v2;" in plain_line(board.doc)
