"""A SIGTERM or Ctrl-C is taken at a safe point (echo_rl/core/stopping.py): raised at once only
while the learner waits (``interruptible()``), else at the next step boundary; never inside
the write-ahead log's compaction. Cut between the rename and the reopen, the compaction left
the log's writer thread a closed file, so the learner refused every later batch with
internal_error and ended in a traceback instead of its summary (the README lab caught it in
CI); a stop landing elsewhere in a step's bookkeeping made it exit 1 instead of 130."""

from __future__ import annotations

import signal
import threading

import pytest

import echo_rl.data.durable as durable
from echo_rl.core import stopping
from echo_rl.data.buffer import ReplayBuffer
from echo_rl.data.durable import BufferLog, read_log
from echo_rl.data.records import Record

pytestmark = pytest.mark.timeout(30)


@pytest.fixture(autouse=True)
def _fresh():
    stopping.reset()
    yield
    stopping.reset()


def _record(group: str, i: int) -> Record:
    return Record(group, i, [4, 14, 5, 17], [11, 1 + i], [-1.0, -0.5], 1.0, 0, "w0")


def test_a_stop_during_compaction_waits_for_the_swap_and_the_log_goes_on(tmp_path, monkeypatch):
    path = tmp_path / "buffer.log"
    log = BufferLog(path, fsync=False)
    kept = [_record("g0", 0), _record("g0", 1)]
    log.admitted(kept).result(timeout=10)
    real_fsync_dir = durable._fsync_dir

    def stop_arrives(folder):  # SIGTERM, twice (insisting), lands inside the swap
        stopping.on_signal(signal.SIGTERM)
        stopping.on_signal(signal.SIGTERM)
        real_fsync_dir(folder)

    monkeypatch.setattr(durable, "_fsync_dir", stop_arrives)
    with pytest.raises(stopping.Terminated):
        with stopping.interruptible():
            log.compact(lambda: kept)
    later = [_record("g1", 0)]
    log.admitted(later).result(timeout=10)  # the writer still has an open file
    log.close()
    admitted, _ = read_log(path)
    assert [(r.group_id, r.sample_idx) for r in admitted] == [("g0", 0), ("g0", 1), ("g1", 0)]


def test_a_stop_outside_a_wait_is_raised_at_the_next_step_boundary_and_keeps_its_kind():
    stopping.on_signal(signal.SIGTERM)  # inside a step's bookkeeping: nothing raised here
    done = True
    with pytest.raises(stopping.Terminated):
        stopping.check()
    assert done
    stopping.check()  # raised once, then forgotten
    stopping.on_signal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt) as ctrl_c:
        stopping.check()
    assert not isinstance(ctrl_c.value, stopping.Terminated)


def test_a_stop_while_waiting_is_raised_at_once():
    with pytest.raises(stopping.Terminated):
        with stopping.interruptible():
            stopping.on_signal(signal.SIGTERM)
            pytest.fail("the stop should have been raised inside the wait")


def test_a_wait_that_begins_after_a_stop_raises_it_before_waiting():
    stopping.on_signal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        with stopping.interruptible():
            pytest.fail("the section should not have begun")


def test_a_second_signal_stops_at_once_outside_a_wait():
    stopping.on_signal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        stopping.on_signal(signal.SIGINT)  # the operator insists


def test_the_first_stop_in_a_section_is_the_one_raised_after_it():
    with pytest.raises(KeyboardInterrupt) as stop:
        with stopping.interruptible(), stopping.uninterrupted():
            stopping.on_signal(signal.SIGINT)
            stopping.on_signal(signal.SIGTERM)
            reached = True
    assert reached and not isinstance(stop.value, stopping.Terminated)
    with stopping.interruptible(), stopping.uninterrupted():  # nothing pending is left behind
        pass


def test_a_real_sigterm_cuts_the_wait_for_a_batch_and_leaves_the_buffer_usable():
    """The learner's wait (ReplayBuffer.take inside interruptible()) ends on the signal,
    delivered by the kernel to this (main) thread while it is blocked."""
    buffer = ReplayBuffer(staleness=2, capacity_groups=8, group_size=2)
    old = signal.signal(signal.SIGTERM, stopping.on_signal)
    timer = threading.Timer(
        0.2, lambda: signal.pthread_kill(threading.main_thread().ident, signal.SIGTERM)
    )
    try:
        timer.start()
        with pytest.raises(stopping.Terminated):
            with stopping.interruptible():
                buffer.take(1, timeout=20)
    finally:
        timer.cancel()
        signal.signal(signal.SIGTERM, old)
    assert buffer.take(1, timeout=0) is None  # the lock was given back
