import threading

from echo_rl.data.buffer import ACCEPTED, COMPLETED, DUPLICATE, STALE, ReplayBuffer
from echo_rl.data.records import Record


def rec(gid="g", idx=0, version=0, reward=0.0):
    return Record(
        group_id=gid,
        sample_idx=idx,
        prompt_ids=[1],
        completion_ids=[2],
        logprobs=[-1.0],
        reward=reward,
        version=version,
        worker_id="w",
    )


def fill(buf, gid, version=0, n=2):
    return [buf.admit(rec(gid, i, version)) for i in range(n)]


def test_whole_groups_only_and_completion():
    buf = ReplayBuffer(staleness=2, capacity_groups=4, group_size=2)
    assert buf.admit(rec("a", 0)) == ACCEPTED
    assert buf.take(1, timeout=0) is None  # half a group is not a batch
    assert buf.admit(rec("a", 1)) == COMPLETED
    [group] = buf.take(1, timeout=0)
    assert [r.sample_idx for r in group] == [0, 1]


def test_dedupe_before_and_after_completion():
    buf = ReplayBuffer(staleness=2, capacity_groups=4, group_size=2)
    buf.admit(rec("a", 0))
    assert buf.admit(rec("a", 0)) == DUPLICATE
    buf.admit(rec("a", 1))
    buf.take(1, timeout=0)
    assert buf.admit(rec("a", 1)) == DUPLICATE  # late resend of a trained group
    assert buf.stats.duplicates == 2 and buf.stats.admitted == 2


def test_admission_window():
    buf = ReplayBuffer(staleness=2, capacity_groups=8, group_size=2)
    buf.set_version(5)
    assert buf.admit(rec("future", 0, version=6)) == "future_version"
    assert buf.admit(rec("old", 0, version=2)) == STALE
    assert buf.admit(rec("edge", 0, version=3)) == ACCEPTED  # u = v - S is admissible
    assert buf.stats.dropped_stale == 1
    assert buf.stats.rejected["future_version"] == 1


def test_ready_groups_go_stale_while_waiting():
    buf = ReplayBuffer(staleness=1, capacity_groups=8, group_size=2)
    fill(buf, "a", version=0)
    buf.set_version(1)
    fill(buf, "b", version=1)
    buf.set_version(2)  # "a" (u=0) is now older than v - S = 1
    [group] = buf.take(1, timeout=0)
    assert group[0].group_id == "b"
    assert buf.stats.dropped_stale == 2
    assert buf.take(1, timeout=0) is None


def test_capacity_overflow_rejects_new_groups_but_completes_started_ones():
    buf = ReplayBuffer(staleness=2, capacity_groups=2, group_size=2)
    buf.admit(rec("a", 0))
    fill(buf, "b")
    assert buf.admit(rec("c", 0)) == "buffer_full"
    assert buf.admit(rec("a", 1)) == COMPLETED  # a started group can still finish
    assert buf.stats.rejected["buffer_full"] == 1
    assert buf.depth() == (2, 0)  # (ready_groups, partial_groups)


def test_take_wakes_when_group_completes_in_another_thread():
    buf = ReplayBuffer(staleness=2, capacity_groups=4, group_size=2)
    result = []
    started = threading.Event()

    def consumer():
        started.set()
        result.append(buf.take(1, timeout=30))

    t = threading.Thread(target=consumer)
    t.start()
    started.wait()
    fill(buf, "a")
    t.join(30)
    assert result and result[0][0][0].group_id == "a"


def test_group_version_is_oldest_sample():
    buf = ReplayBuffer(staleness=1, capacity_groups=4, group_size=2)
    buf.set_version(1)
    buf.admit(rec("a", 0, version=0))
    buf.admit(rec("a", 1, version=1))
    buf.set_version(2)  # sample 0 (u=0) makes the whole group stale
    assert buf.take(1, timeout=0) is None
    assert buf.stats.dropped_stale == 2
