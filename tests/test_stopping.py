"""A SIGTERM or Ctrl-C is held back while the write-ahead log compacts (learner/stopping.py):
cut between the rename and the reopen, the log's writer thread was left a closed file, so the
learner refused every later batch with internal_error and ended in a traceback instead of its
summary (the README lab caught it in CI)."""

from __future__ import annotations

import signal

import pytest

import learner.durable as durable
from dataplane.records import Record
from learner import stopping
from learner.durable import BufferLog, read_log

pytestmark = pytest.mark.timeout(30)


def _record(group: str, i: int) -> Record:
    return Record(group, i, [4, 14, 5, 17], [11, 1 + i], [-1.0, -0.5], 1.0, 0, "w0")


def test_a_stop_during_compaction_waits_for_the_swap_and_the_log_goes_on(tmp_path, monkeypatch):
    path = tmp_path / "buffer.log"
    log = BufferLog(path, fsync=False)
    kept = [_record("g0", 0), _record("g0", 1)]
    log.admitted(kept).result(timeout=10)
    real_fsync_dir = durable._fsync_dir

    def stop_arrives(folder):  # SIGTERM lands inside the swap, where it used to cut it
        stopping.on_signal(signal.SIGTERM)
        real_fsync_dir(folder)

    monkeypatch.setattr(durable, "_fsync_dir", stop_arrives)
    with pytest.raises(stopping.Terminated):
        log.compact(lambda: kept)
    later = [_record("g1", 0)]
    log.admitted(later).result(timeout=10)  # the writer still has an open file
    log.close()
    admitted, _ = read_log(path)
    assert [(r.group_id, r.sample_idx) for r in admitted] == [("g0", 0), ("g0", 1), ("g1", 0)]


def test_a_stop_outside_a_section_is_raised_at_once_and_keeps_its_kind():
    with pytest.raises(stopping.Terminated):
        stopping.on_signal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt) as ctrl_c:
        stopping.on_signal(signal.SIGINT)
    assert not isinstance(ctrl_c.value, stopping.Terminated)


def test_the_first_stop_in_a_section_is_the_one_raised_after_it():
    with pytest.raises(KeyboardInterrupt) as stop:
        with stopping.uninterrupted():
            stopping.on_signal(signal.SIGINT)
            stopping.on_signal(signal.SIGTERM)
            reached = True
    assert reached and not isinstance(stop.value, stopping.Terminated)
    with stopping.uninterrupted():  # nothing pending is left behind
        pass
