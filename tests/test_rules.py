"""The data plane's shared rules (echo_rl/data/rules.py), and that the learner's buffer and the
simulator's counting queue, driven by the same events, agree on every count."""

from __future__ import annotations

import random

import pytest

from echo_rl.data import rules
from echo_rl.data.buffer import ReplayBuffer
from echo_rl.data.records import Record
from echo_rl.data.rules import ReadyQueue


def test_admission_window_is_inclusive_at_both_ends():
    assert rules.admission(7, 7, 2) == rules.OK and rules.admission(5, 7, 2) == rules.OK
    assert rules.admission(4, 7, 2) == rules.STALE and rules.admission(8, 7, 2) == rules.FUTURE
    assert rules.admission(7, 7, 0) == rules.OK and rules.admission(6, 7, 0) == rules.STALE


def test_grant_size_is_the_least_of_ask_fair_share_and_room():
    assert rules.grant_size(8, 64, 0, 0, 4) == 8
    assert rules.grant_size(100, 64, 0, 0, 4) == 16  # fair share ceil(64 / 4)
    assert rules.grant_size(100, 64, 40, 20, 4) == 4  # room left
    assert rules.grant_size(5, 64, 60, 10, 4) == 0  # over the bound: nothing, never negative
    assert rules.fair_share(10, 0) == 10 and rules.fair_share(10, 3) == 4


def test_ready_queue_merges_counts_evicts_and_takes_oldest_first():
    q: ReadyQueue[None] = ReadyQueue()
    for v, n in [(1, 3), (1, 2), (2, 4), (3, 1)]:
        q.push(v, count=n)
    assert len(q) == 10 and q.oldest_version() == 1
    assert q.evict(4, 2) == (5, [])  # version 1 < 4 - 2
    assert len(q) == 5
    assert q.take(2, 4) == (2, []) and len(q) == 3
    assert q.take(3, 4) == (2, []) and len(q) == 0


def test_ready_queue_items_stay_whole_and_can_be_removed():
    q: ReadyQueue[str] = ReadyQueue()
    for v, item in [(1, "a"), (1, "b"), (2, "c")]:
        q.push(v, item)
    assert len(q) == 3 and list(q.items()) == ["a", "b", "c"]
    assert q.remove(lambda it: it == "b") == ["b"] and len(q) == 2
    assert q.take(1, 5) == (1, ["a"])
    assert q.evict(5, 1) == (1, ["c"]) and len(q) == 0


def rec(gid: str, i: int, version: int) -> Record:
    return Record(
        group_id=gid,
        sample_idx=i,
        prompt_ids=[1],
        completion_ids=[2],
        logprobs=[-1.0],
        reward=0.0,
        version=version,
        worker_id="w",
    )


@pytest.mark.parametrize("seed", range(5))
def test_learner_buffer_and_simulator_queue_agree_on_every_count(seed):
    """Random deliveries, version steps and takes: the learner's ReplayBuffer (records, whole
    groups) and the simulator's ReadyQueue of counts admit, drop and hand out the same."""
    rng = random.Random(seed)
    S = rng.randint(0, 3)
    buf = ReplayBuffer(staleness=S, capacity_groups=10_000, group_size=1)
    sim: ReadyQueue[None] = ReadyQueue()
    version, sim_dropped, n = 0, 0, 0
    for _ in range(300):
        op = rng.random()
        if op < 0.6:
            u = version - rng.randint(0, S + 2)
            verdict = rules.admission(u, version, S)
            got = buf.admit(rec(f"g{n}", 0, u))
            n += 1
            if verdict == rules.OK:
                sim.push(u)
                assert got == "completed"
            else:
                sim_dropped += verdict == rules.STALE
                assert got in ("stale", "future_version")
        elif op < 0.8:
            version += 1
            buf.set_version(version)
            sim_dropped += sim.evict(version, S)[0]
        else:
            k = rng.randint(1, 4)
            if len(sim) >= k:
                oldest, _ = sim.take(k, version)
                groups = buf.take(k, timeout=0)
                assert groups is not None and min(r.version for g in groups for r in g) == oldest
        assert buf.depth().ready_groups == len(sim)
        assert buf.stats.dropped_stale == sim_dropped
