"""The device's arbiter for a worker joined to several runs (echo_rl/worker/sharing.py): shares,
hand-over when a run cannot use the device, residency and its switches, on a fake clock."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from fakes import FakeClock

from echo_rl.control.deliveries import Deliveries
from echo_rl.control.sessions import WorkerState
from echo_rl.control.staleness import Staleness
from echo_rl.core import wire
from echo_rl.data.records import Record
from echo_rl.worker.sharing import Turns

pytestmark = pytest.mark.timeout(30)


async def _generate(turns: Turns, clock: FakeClock, run: str, seconds: float, times: int) -> None:
    """A run that always has work: each grant takes ``seconds`` of device time."""
    for _ in range(times):
        async with turns.turn(run):
            await turns.bring_on(run)  # the grant had work
            clock.t += seconds
            await asyncio.sleep(0)  # the other runs queue up meanwhile


async def _both(turns: Turns, clock: FakeClock, a: int, b: int) -> None:
    async with asyncio.TaskGroup() as tg:
        tg.create_task(_generate(turns, clock, "a", 1.0, a))
        tg.create_task(_generate(turns, clock, "b", 1.0, b))


def test_runs_that_both_want_the_device_get_it_in_proportion_to_their_shares():
    clock = FakeClock()
    turns = Turns(resident=2, clock=clock)
    turns.add("a", share=2.0)
    turns.add("b", share=1.0)

    async def main():
        async with asyncio.TaskGroup() as tg:  # both always waiting, until a has had 40 turns
            ta = tg.create_task(_generate(turns, clock, "a", 1.0, 40))
            tb = tg.create_task(_generate(turns, clock, "b", 1.0, 1000))
            await ta
            tb.cancel()

    asyncio.run(main())
    used = {n: r.used_s for n, r in turns.runs.items()}
    assert used["a"] == 40 and 19 <= used["b"] <= 21  # 2:1, give or take the last turn


def test_a_paying_run_weighs_more_at_equal_shares():
    turns = Turns()
    a, b = turns.add("a", share=1.0, price=1.0), turns.add("b", share=1.0)
    assert a.weight == 2 * b.weight


def test_a_run_that_does_not_ask_leaves_the_device_to_the_other_without_idling():
    clock = FakeClock()
    turns = Turns(resident=1, clock=clock)
    turns.add("a")
    turns.add("b")  # its gate is closed: it never asks
    asyncio.run(_generate(turns, clock, "a", 1.0, 10))
    assert turns.runs["a"].used_s == 10 and turns.runs["b"].used_s == 0
    assert turns.idle_fraction() == 0.0
    assert turns.shares() == {"a": 1.0, "b": 0.0}


def test_idle_time_between_turns_is_counted():
    clock = FakeClock()
    turns = Turns(clock=clock)
    turns.add("a")

    async def main():
        await _generate(turns, clock, "a", 1.0, 1)
        clock.t += 3.0  # nothing to generate: the device idles
        await _generate(turns, clock, "a", 1.0, 1)

    asyncio.run(main())
    assert turns.idle_fraction() == pytest.approx(3.0 / 5.0)


def test_one_resident_model_is_parked_and_brought_back_at_each_switch():
    clock, moves = FakeClock(), []
    turns = Turns(
        resident=1,
        clock=clock,
        park=lambda run: moves.append(("park", run)),
        unpark=lambda run: moves.append(("unpark", run)),
    )
    turns.add("a")
    turns.add("b")
    asyncio.run(_both(turns, clock, 3, 3))
    parks = [m for m in moves if m[0] == "park"]
    assert len(parks) >= 4  # the runs alternate: each turn after the first two swaps models
    assert moves[0] == ("unpark", "a") or moves[0] == ("unpark", "b")
    unparks = [m for m in moves if m[0] == "unpark"]
    # every unpark but each run's first load is a switch
    assert turns.runs["a"].switches + turns.runs["b"].switches == len(unparks) - 2


def test_a_turn_that_ends_in_an_empty_grant_moves_no_model():
    clock, moves = FakeClock(), []
    turns = Turns(resident=1, clock=clock, park=moves.append, unpark=moves.append)
    turns.add("a")
    turns.add("b")

    async def main():
        await _generate(turns, clock, "a", 1.0, 1)  # a's model is on the device
        for _ in range(5):  # b's learner has nothing for it: empty grants
            async with turns.turn("b"):
                clock.t += 0.01

    asyncio.run(main())
    assert moves == ["a"] and turns.on_device("a") and not turns.on_device("b")
    assert turns.runs["b"].switches == 0


def test_two_resident_models_never_switch():
    clock, moves = FakeClock(), []
    turns = Turns(resident=2, clock=clock, park=lambda run: moves.append(run))
    turns.add("a")
    turns.add("b")
    asyncio.run(_both(turns, clock, 3, 3))
    assert moves == [] and turns.runs["a"].switches == turns.runs["b"].switches == 0


def test_a_run_cancelled_while_waiting_does_not_hold_up_the_others():
    clock = FakeClock()
    turns = Turns(clock=clock)
    for name in ("a", "b", "c"):
        turns.add(name)

    async def main():
        async with turns.turn("a"):  # a holds the device; b and c queue
            b = asyncio.create_task(_generate(turns, clock, "b", 1.0, 1))
            c = asyncio.create_task(_generate(turns, clock, "c", 1.0, 1))
            await asyncio.sleep(0)
            b.cancel()  # b's run ended while it waited
            await asyncio.sleep(0)
        await asyncio.wait_for(c, 5)
        assert b.cancelled()

    asyncio.run(main())
    assert turns.runs["c"].turns == 1


def test_a_forgotten_run_leaves_the_books():
    turns = Turns()
    turns.add("a")
    turns.add("b")
    turns.forget("a")
    assert list(turns.runs) == ["b"]


@pytest.mark.parametrize("bad", [{"resident": 0}])
def test_bad_settings_name_the_flag(bad):
    with pytest.raises(ValueError, match="--resident"):
        Turns(**bad)
    with pytest.raises(ValueError, match="--share"):
        Turns().add("a", share=0)


# ------------------------------------------------------------------ the learner's side


def _deliveries(observed: list) -> Deliveries:
    """Deliveries' crediting alone, with a controller that records what it is told."""
    d = Deliveries.__new__(Deliveries)
    d.staleness = Staleness(bound=2, discount=0.5)
    d.buffer = SimpleNamespace(version=0)
    d.work = SimpleNamespace(affinity=None)  # learner.affinity off
    d.members = SimpleNamespace(
        controller=SimpleNamespace(observe=lambda *a, **kw: observed.append((a, kw)))
    )
    return d


@pytest.mark.parametrize("runs, busy", [(1, 2.5), (2, None)])
def test_a_shared_worker_is_counted_at_the_capacity_it_delivers_here(runs, busy):
    """Alone, a worker's busy seconds measure its capacity. Sharing its device with other
    runs, it is counted per wall second (busy_s None): what this run receives, not what the
    device could do if it were all this run's."""
    observed: list = []
    w = WorkerState("w0", b"i", "k", price=0.0, last_seen=0.0, runs=runs)
    recs = [Record("g", i, [1, 2], [3], [-0.5], 1.0, 0, "w0", gen_s=2.5) for i in range(4)]
    _deliveries(observed)._credit(w, recs)
    ((args, kw),) = observed
    assert args == ("w0", 4) and kw["busy_s"] == busy


def test_a_heartbeat_carries_the_runs_a_device_serves():
    beat = wire.Heartbeat(worker_id="w0", version=3, runs=2, resident=False)
    back = wire.decode(wire.encode(beat), 1 << 20)
    assert back.runs == 2 and back.resident is False
    with pytest.raises(ValueError, match="runs"):  # pydantic's ValidationError
        wire.Heartbeat(worker_id="w0", version=3, runs=0)


def test_a_run_s_nested_turn_does_not_wait_for_itself():
    """A rollout holds the device from its grant on, and generating inside it asks again."""
    clock = FakeClock()
    turns = Turns(clock=clock)
    turns.add("a")
    turns.add("b")

    async def main():
        async with turns.turn("a"):
            async with turns.turn("a"):
                clock.t += 1.0

    asyncio.run(asyncio.wait_for(main(), 5))
    assert turns.runs["a"].used_s == 1.0 and turns.runs["a"].turns == 1


# ------------------------------------------------------------------ need and recent books


def test_a_run_whose_learner_needs_more_gets_more_turns():
    clock = FakeClock()
    turns = Turns(resident=2, clock=clock)
    turns.add("a")
    turns.add("b")
    turns.set_need("a", 3.0)  # a's learner has a third of the capacity it requires
    turns.set_need("b", 1.0)

    async def main():
        async with asyncio.TaskGroup() as tg:
            ta = tg.create_task(_generate(turns, clock, "a", 1.0, 30))
            tb = tg.create_task(_generate(turns, clock, "b", 1.0, 1000))
            await ta
            tb.cancel()

    asyncio.run(main())
    assert turns.runs["a"].used_s == 30 and 9 <= turns.runs["b"].used_s <= 11  # 3:1


@pytest.mark.parametrize("claimed, kept", [(1e9, 4.0), (0.0, 0.25), (float("nan"), 1.0)])
def test_a_learner_s_claimed_need_is_clamped(claimed, kept):
    """A hostile learner cannot take the device from the volunteer's other runs: its need
    weighs its turns by at most 4 (and a run is never starved below a quarter of its share)."""
    turns = Turns()
    turns.add("a")
    turns.set_need("a", claimed)
    assert turns.runs["a"].need == kept


def test_the_books_follow_recent_turns_not_the_whole_day():
    clock = FakeClock()
    turns = Turns(clock=clock)
    turns.add("a")
    turns.add("b")

    async def main():
        await _generate(turns, clock, "a", 100.0, 1)  # a ran long, an hour ago
        clock.t += 3600.0
        await _generate(turns, clock, "b", 10.0, 1)  # b ran a little, just now

    asyncio.run(main())
    assert turns.runs["a"].used_s > turns.runs["b"].used_s  # all told
    assert turns.runs["a"].deficit() < turns.runs["b"].deficit()  # recently: a is owed


def test_the_learner_s_need_is_its_requirement_over_its_capacity():
    from echo_rl.provisioning.controller import NEED_MAX, Controller, Policy

    c = Controller(Policy(alpha=1.0, delta=0.5, window_s=10, warmup_s=0), tau_s=10)
    assert c.need() == 1.0  # no requirement yet: nothing to ask for
    c.set_requirement(2.0)
    assert c.need() == NEED_MAX  # nobody active
    c.add_worker("w", price=1.0, state="active", mu_prior=1.0)
    c.tick()
    assert c.need() == pytest.approx(2.0, rel=1e-3)  # the measured capacity: about 1
    ack = wire.HeartbeatAck(instance_id="i", version=1, need=2.0)
    assert wire.decode(wire.encode(ack), 1 << 20).need == 2.0
    with pytest.raises(ValueError, match="need"):
        wire.HeartbeatAck(instance_id="i", version=1, need=-1.0)
