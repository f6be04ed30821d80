import itertools

from fakes import FakeClock

from echo_rl.control.work import WorkQueue
from echo_rl.data.adapter import Prompt


def make(clock, cap=4):
    prompts = (Prompt([i], {"i": i}) for i in itertools.count())
    return WorkQueue(
        prompts, group_size=3, max_outstanding=cap, lease_timeout_s=10, prefix="run", clock=clock
    )


def test_grant_respects_outstanding_cap():
    wq = make(FakeClock(), cap=4)
    assert len(wq.grant("w1", 3, buffered_groups=0)) == 3
    [g] = wq.grant("w2", 3, buffered_groups=0)
    assert wq.grant("w2", 3, buffered_groups=0, holding=[g.group_id]) == []
    wq.fulfilled("run-0")
    assert len(wq.grant("w2", 3, buffered_groups=1, holding=[g.group_id])) == 0  # buffered
    assert len(wq.grant("w2", 3, buffered_groups=0, holding=[g.group_id])) == 1


def test_dead_worker_groups_are_handed_out_again_first():
    wq = make(FakeClock())
    first = wq.grant("w1", 2, 0)
    assert wq.release_worker("w1") == 2
    again = wq.grant("w2", 3, 0)
    assert [g.group_id for g in again[:2]] == [g.group_id for g in first]
    assert again[0].prompt_ids == first[0].prompt_ids and wq.reissued == 2


def test_expired_leases_requeue_with_fake_clock():
    clock = FakeClock()
    wq = make(clock)
    [g] = wq.grant("w1", 1, 0)
    clock.t = 5
    assert wq.expire() == 0
    clock.t = 11
    assert wq.expire() == 1
    assert wq.grant("w2", 1, 0)[0].group_id == g.group_id


def test_fulfilled_group_is_not_reissued():
    wq = make(FakeClock())
    [g] = wq.grant("w1", 1, 0)
    wq.requeue(g.group_id)
    wq.fulfilled(g.group_id)
    assert all(x.group_id != g.group_id for x in wq.grant("w2", 4, 0))


def test_a_lost_grant_is_handed_to_the_same_worker_at_its_next_request():
    """The worker asks for work again without holding the groups it was granted: the reply
    was lost on the way. It gets them again at once (same groups, fresh lease), not after the
    lease expires; groups it holds undelivered are left alone."""
    clock = FakeClock()
    wq = make(clock, cap=8)
    lost = wq.grant("w1", 2, 0)
    clock.t = 3
    again = wq.grant("w1", 2, 0)
    assert [g.group_id for g in again] == [g.group_id for g in lost] and wq.reissued == 2
    clock.t = 12  # 13 s after the first grant, 9 s after the second: the lease was renewed
    assert wq.expire() == 0
    held = wq.grant("w1", 2, 0, holding=[g.group_id for g in lost])
    assert {g.group_id for g in held}.isdisjoint(g.group_id for g in lost)
    assert wq.grant("w2", 2, 0)[0].group_id not in {g.group_id for g in lost + held}
