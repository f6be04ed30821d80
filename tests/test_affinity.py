"""Hardware-affinity routing (echo_rl/control/affinity.py, docs/scheduling.md "Affinity"): long tasks
to fast workers, nothing held back, and the task budgets it routes by kept by workers and
checked by the learner."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
from pydantic import ValidationError

from echo_rl.control.affinity import Affinity, LengthBook, Picker, SpeedBook
from echo_rl.control.work import WorkQueue
from echo_rl.core import wire
from echo_rl.data.adapter import AdapterError, Prompt

pytestmark = pytest.mark.timeout(120)


def _prompts():
    """Prompt k is [k]; its budget says how long it is: k % 4 == 0 long (64), else short (4)."""
    return (
        Prompt([k], {"k": k}, max_new_tokens=64 if k % 4 == 0 else 4) for k in itertools.count()
    )


def test_without_affinity_prompts_go_out_in_the_adapter_s_order():
    picker = Picker(_prompts(), window=8, book=None)
    assert [picker.take(r).prompt_ids[0] for r in (1.0, 0.0, None, 0.5)] == [0, 1, 2, 3]
    assert picker.routed == 0


def test_fast_workers_take_the_long_tasks_and_slow_ones_the_short():
    picker = Picker(_prompts(), window=8, book=LengthBook())
    fast = [picker.take(1.0) for _ in range(2)]
    slow = [picker.take(0.0) for _ in range(2)]
    assert all(p.max_new_tokens == 64 for p in fast)
    assert all(p.max_new_tokens == 4 for p in slow)
    assert [p.prompt_ids[0] for p in fast + slow] == [0, 4, 1, 2]  # oldest of each kind
    assert picker.take(None).prompt_ids == [3]  # not measured yet: the oldest waiting
    assert picker.routed > 0


def test_learned_lengths_override_the_budget():
    book = LengthBook()
    for _ in range(5):
        book.observe([1], 50)  # prompt 1 has a short budget but runs long
        book.observe([0], 2)  # prompt 0 a long budget but ends at once
    assert book.expect(Prompt([1], max_new_tokens=4)) == pytest.approx(50, rel=0.2)
    assert book.expect(Prompt([9], max_new_tokens=4)) == 4.0  # nothing seen: its budget
    assert book.expect(Prompt([9])) is None
    picker = Picker(_prompts(), window=4, book=book)
    assert picker.take(1.0).prompt_ids == [1]
    assert picker.take(0.0).prompt_ids == [0]


def test_the_length_book_is_bounded():
    book = LengthBook(max_prompts=3)
    for k in range(10):
        book.observe([k], k)
    assert len(book) == 3
    assert book.expect(Prompt([9])) == 9.0 and book.expect(Prompt([0])) is None


def test_lying_lengths_cannot_hold_a_prompt_back():
    """Workers that make prompt 3 look like the middle of every window (the place no fast or
    slow worker picks) cannot keep it out: a prompt passed over ``2 x window`` times is taken
    by whoever asks next."""
    book = LengthBook()
    for k in range(200):
        book.observe([k], 0 if k % 2 else 1000)
    book.observe([3], 500)
    picker = Picker(_prompts(), window=6, book=book)
    taken = []
    for i in range(40):
        taken.append(picker.take(float(i % 2)).prompt_ids[0])
        if 3 in taken:
            break
    assert 3 in taken and len(taken) <= 4 + 2 * 6 + 1
    assert picker.aged >= 1
    # and in a long run every prompt drawn is granted within 2 x window grants of its drawing
    picker = Picker(_prompts(), window=6, book=book)
    when = {picker.take(float(i % 2)).prompt_ids[0]: i for i in range(300)}
    assert all(when[k] <= k + 2 * 6 for k in range(280))


def test_speed_ranks_come_from_the_learner_s_clock():
    now = [0.0]
    speeds = SpeedBook(clock=lambda: now[0], fresh_s=100.0, every_s=0.0)
    speeds.admitted("a", 100)  # the first batch starts the clock
    now[0] = 1.0
    speeds.admitted("a", 100)
    assert speeds.rank("a") is None  # alone: no one to rank against
    for w in ("b", "c"):
        speeds.admitted(w, 100)
    now[0] = 2.0
    speeds.admitted("b", 400)
    assert speeds.rank("b") == 1.0
    assert speeds.rank("a") == 0.0
    assert speeds.rank("c") is None  # not measured yet
    now[0] = 150.0  # a left long ago: the fastest of those still delivering is b alone
    speeds.admitted("c", 100)
    speeds.admitted("c", 50)
    assert speeds.rank("c") is None and speeds.rank("b") is None
    capped = SpeedBook(max_workers=2)
    for w in "wxyz":
        capped.admitted(w, 1)
    assert capped.rate("w") is None and len(capped._last) == 2


def test_a_grant_carries_the_task_budget_and_routes_by_rank():
    aff = Affinity(LengthBook(), SpeedBook(), window=8)
    q = WorkQueue(
        _prompts(),
        group_size=2,
        max_outstanding=100,
        lease_timeout_s=30,
        prefix="t",
        affinity=aff,
    )
    long = q.grant("fast", 2, 0, rank=1.0)
    short = q.grant("slow", 2, 0, rank=0.0)
    assert [g.max_new_tokens for g in long] == [64, 64]
    assert [g.max_new_tokens for g in short] == [4, 4]
    # the grant rules are the queue's: the outstanding bound still holds
    q2 = WorkQueue(
        _prompts(), group_size=2, max_outstanding=3, lease_timeout_s=30, prefix="u",
        affinity=aff,
    )  # fmt: skip
    assert len(q2.grant("fast", 10, 0, rank=1.0)) == 3


def test_a_group_budget_out_of_range_is_refused_by_the_wire():
    for bad in (0, -1, 70000, 1.5):
        with pytest.raises(ValidationError, match="max_new_tokens"):
            wire.Group(group_id="g", prompt_ids=[1], n=1, seed=0, max_new_tokens=bad)


def test_the_worker_stops_each_group_at_its_own_budget(tokenizer):
    from echo_rl.core.config import ModelConfig
    from echo_rl.worker.backends.transformers import TransformersBackend

    backend = TransformersBackend(ModelConfig(max_positions=128))
    backend.restrict_answers(None)
    eos = backend.tokenizer.eos_token_id
    short = wire.Group(group_id="s", prompt_ids=[3, 4], n=16, seed=1, max_new_tokens=3)
    long = wire.Group(group_id="l", prompt_ids=[3, 4], n=16, seed=1)
    backend.tokens_sampled = 0
    out = backend.generate([short, long], 40, 1.0)
    assert all(len(s.completion_ids) <= 3 for s in out[0])
    assert max(len(s.completion_ids) for s in out[1]) > 3
    # the short rows stopped sampling at 3 tokens: no more tokens were sampled than kept,
    # plus the end-of-sequence of rows that ended
    kept = sum(len(s.completion_ids) for g in out for s in g)
    assert backend.tokens_sampled <= kept + 32
    assert all(s.completion_ids[-1] == eos or len(s.completion_ids) <= 40 for s in out[1])


def test_toy_add_short_tasks_carry_a_budget_and_bad_options_are_named(tokenizer):
    import random

    from echo_rl.adapters.toy_add import ToyAddAdapter

    a = ToyAddAdapter({"short_tokens": 4, "long_share": 0.25}, tokenizer)
    got = Counter()
    for p in itertools.islice(a.prompts(random.Random(0)), 2000):
        got[p.max_new_tokens] += 1
    assert set(got) == {4, None} and 0.15 < got[None] / 2000 < 0.35
    assert all(p.max_new_tokens is None for p in itertools.islice(
        ToyAddAdapter({}, tokenizer).prompts(random.Random(0)), 50))  # fmt: skip
    for bad, word in (({"short_tokens": 0}, "short_tokens"), ({"short_tokens": "4"}, "short_tokens"),
                      ({"short_tokens": 4, "long_share": 2}, "long_share")):  # fmt: skip
        with pytest.raises(AdapterError, match=word):
            ToyAddAdapter(bad, tokenizer)


def test_a_live_learner_routes_grants_and_refuses_samples_over_a_task_budget(small_cfg, tokenizer):
    """A control plane with affinity on and every toy-add task given a budget of one token:
    a delivery of two-token completions is refused as over_budget (a strike, as any lie the
    learner catches), a one-token one admitted, and the step row's counts show the routing."""
    import zmq
    from test_control import ask, batch, connect, control_plane, records

    lc = small_cfg.learner
    plane = control_plane(
        small_cfg,
        tokenizer,
        {"short_tokens": 1, "long_share": 0.0},
        affinity=Affinity(LengthBook(), SpeedBook(), window=4),
    )
    plane.start()
    ctx = zmq.Context()
    try:
        client = connect(plane, ctx)
        ask(client, wire.Join(worker_id="w1"))
        g0, g1 = ask(client, wire.WorkRequest(worker_id="w1", max_groups=2)).groups
        assert g0.max_new_tokens == g1.max_new_tokens == 1
        over = ask(client, batch(records(g0)))  # completions [11, 1]: two tokens
        assert over.rejected == {"over_budget": lc.group_size}
        ok = ask(client, batch(records(g1, completion_ids=[11], logprobs=[-1.0]), bid="b2"))
        assert ok.accepted == lc.group_size and not ok.rejected
        stats = plane.stats()
        assert stats.rejected["over_budget"] == lc.group_size
        assert stats.affinity["prompts_known"] == 1  # the admitted group taught its length
        assert stats.affinity["window"] == 3  # refilled to 4 at the next grant, less its pick
    finally:
        plane.shutdown("test over")
        ctx.destroy(linger=0)


# ----------------------------------------------------------------------------- simulator


def _sim_lengths(affinity: bool, speed: list[float]):
    import numpy as np

    from echo_rl.provisioning.sim.scenario import RolloutSection
    from echo_rl.provisioning.sim.tail import Lengths

    ro = RolloutSection(
        groups_per_request=1, length_mean=400, length_cap=2000, long_share=0.25,
        short_mean=20, affinity=affinity, affinity_window=16,
    )  # fmt: skip
    return Lengths(ro, 8, np.random.default_rng(3), len(speed), speed)


def test_the_simulator_routes_long_tasks_to_fast_workers_by_the_learner_s_picker():
    """echo_rl/provisioning/sim/tail.py with two kinds of task: without affinity every worker's
    requests are a quarter long; with it the fast worker's are mostly long and the slow
    one's short, and the mix over the fleet is unchanged (nothing dropped, nothing added)."""
    speed = [3.0, 1.0]  # worker 0 fast, worker 1 slow

    def mean_share(affinity: bool) -> list[float]:
        L = _sim_lengths(affinity, speed)
        shares: list[list[float]] = [[], []]
        for _ in range(1500):
            for i in (0, 1):
                shares[i].append(L.request(i, 1, 0)[0])
        return [sum(s) / len(s) for s in shares]

    off, on = mean_share(False), mean_share(True)
    assert abs(off[0] - off[1]) < 0.15 * off[0]  # same mix for both
    assert on[0] > 1.5 * off[0] and on[1] < 0.6 * off[1]  # long to the fast, short to the slow
    L = _sim_lengths(True, speed)
    kinds = [L.tasks.take(i % 2) for i in range(4000)]
    assert 0.2 < sum(kinds) / len(kinds) < 0.3  # the drawn mix, routed, not changed


def test_affinity_at_scale_is_cheaper_on_a_mixed_fleet_and_keeps_s(tmp_path):
    """examples/sim/affinity-1k.toml cut to 200 workers and 14 steps: with half the fleet
    3x slower, affinity lowers the cost per step; every run keeps its staleness bound."""
    from pathlib import Path

    from echo_rl.provisioning.sim.core import Sim
    from echo_rl.provisioning.sim.scenario import apply_overrides, read_toml, scenario_from_dict

    path = Path(__file__).resolve().parents[1] / "examples/sim/affinity-1k.toml"
    cost = {}
    for aff in (False, True):
        data = apply_overrides(
            read_toml(path),
            [
                f"rollout.affinity={str(aff).lower()}",
                "run.steps=14",
                "learner.prompts_per_step=200",
            ],
        )
        for c in data["pool"]["classes"]:
            c["count"] = 100
        sc = scenario_from_dict(data, path.parent)
        s = Sim(sc).run()["summary"]
        assert not s["stalled"] and s["staleness_max"] <= sc.learner.staleness
        cost[aff] = s["cost_per_step_usd"]
    assert cost[True] < 0.95 * cost[False]


def test_two_speeds_asking_alike_split_the_kinds_with_none_taken_by_age():
    """A fast and a slow worker asking in turn, a quarter of the tasks long: every long task
    goes to the fast worker and no grant is forced by age (the age bound is twice the window;
    with the window itself most grants were)."""
    import random

    rng = random.Random(0)

    def stream():
        for k in itertools.count():
            yield Prompt([k], max_new_tokens=100 if rng.random() < 0.25 else 8)

    picker = Picker(stream(), window=64, book=LengthBook())
    got = {1.0: Counter(), 0.0: Counter()}
    for i in range(4000):
        rank = float(i % 2)
        got[rank][picker.take(rank).max_new_tokens] += 1
    assert got[0.0][100] == 0 and got[1.0][100] > 0.4 * 2000
    assert picker.aged == 0
