"""Chain planner (docs/design.md §5): k, grouping, tails, predictions, bounds, re-planning."""

from __future__ import annotations

import math
import random

import pytest

from echo_rl.broadcast.planner import (
    BYTES_PER_MBIT,
    ChainPlan,
    PlanParams,
    changed_parents,
    lower_bound_s,
    mbit_to_bytes_per_s,
    nominal_link_mbit,
    paper_k,
    plan_chains,
    plan_with,
    predict_chain_s,
    replan,
    star_limited_s,
    star_unlimited_s,
)
from echo_rl.broadcast.topology import TOPOLOGIES, ChainsTopology, Peer, StarTopology, make_topology
from echo_rl.broadcast.topology.star_unlimited import StarUnlimitedTopology

MiB = 1 << 20
M = 64 * MiB  # 67,108,864 bytes
C = 1 * MiB


def peers(
    n: int,
    down: float = 100,
    up: float = 100,
    prefix: str = "w",
    reachable: bool = True,
    endpoints: bool = True,
) -> list[Peer]:
    return [
        Peer(
            f"{prefix}{i:02d}",
            down,
            up,
            reachable,
            f"tcp://{prefix}{i:02d}:7000" if endpoints else "",
        )
        for i in range(n)
    ]


def check_plan(plan: ChainPlan, ps: list[Peer]) -> None:
    """The structural invariants every plan must keep."""
    byid = {p.worker_id: p for p in ps}
    flat = [w for c in plan.chains for w in c]
    assert sorted(flat) == sorted(byid), "every worker exactly once"
    assert all(plan.chains), "no empty chain"
    for chain in plan.chains:
        assert plan.parent[chain[0]] is None
        for up, down in zip(chain, chain[1:]):
            assert plan.parent[down] == up and plan.child[up] == down
            assert byid[up].reachable, f"{up} is unreachable but has a child"
        assert plan.child[chain[-1]] is None
        assert sum(not byid[w].reachable for w in chain) <= 1
    assert set(plan.parent) == set(plan.child) == set(byid)
    assert len(plan.predictions) == len(plan.chains)


# ------------------------------------------------------------------ units, bounds, baselines


def test_units():
    assert BYTES_PER_MBIT == 125_000
    assert mbit_to_bytes_per_s(100) == 12_500_000
    assert mbit_to_bytes_per_s(400) == 50_000_000


def test_lower_bound_and_stars_design_example():
    # N=16, M=64 MiB=67,108,864 B, U=400 Mbit/s=50e6 B/s, every worker 100/100 Mbit/s=12.5e6 B/s
    #   M/min(b_down)         = 67,108,864 / 12.5e6                 = 5.36870912 s
    #   M/U                   = 67,108,864 / 50e6                   = 1.34217728 s
    #   N*M/(U + sum b_up)    = 1,073,741,824 / (50e6 + 16*12.5e6)  = 4.294967296 s
    #   LB = 5.36870912 s (the lower bound of docs/design.md §5; a prototype's "5.37 s bound")
    downs, ups = [100.0] * 16, [100.0] * 16
    assert lower_bound_s(M, 400, downs, ups) == pytest.approx(5.36870912, rel=1e-12)
    # star-unlimited = M/b = 5.36870912 s; star-limited = max(M/b, N*M/U)
    #   N*M/U = 1,073,741,824 / 50e6 = 21.47483648 s (the prototype's star took 22.3 s)
    assert star_unlimited_s(M, 100) == pytest.approx(5.36870912, rel=1e-12)
    assert star_limited_s(M, 100, 400, 16) == pytest.approx(21.47483648, rel=1e-12)


def test_lower_bound_other_terms():
    # upload-starved: ups 10 Mbit/s = 1.25e6 B/s each
    #   N*M/(U + sum up) = 1,073,741,824 / (50e6 + 16*1.25e6 = 70e6) = 15.3391689... s
    assert lower_bound_s(M, 400, [100.0] * 16, [10.0] * 16) == pytest.approx(1073741824 / 70e6)
    # one slow downloader at 20 Mbit/s = 2.5e6 B/s: M/2.5e6 = 26.8435456 s
    assert lower_bound_s(M, 400, [100.0] * 15 + [20.0], [100.0] * 16) == pytest.approx(26.8435456)
    # a thin learner: U=10 Mbit/s -> M/U = 67,108,864/1.25e6 = 53.6870912 s
    assert lower_bound_s(M, 10, [100.0] * 2, [100.0] * 2) == pytest.approx(53.6870912)
    assert lower_bound_s(M, 400, [], []) == 0.0
    with pytest.raises(ValueError):
        lower_bound_s(M, 400, [0.0], [1.0])
    # star-limited when the learner is not the bottleneck: N*M/U = 2*M/50e6 < M/b
    assert star_limited_s(M, 100, 400, 2) == star_unlimited_s(M, 100)


def test_predict_chain():
    # (M + (L-1)*c)/rate + L*latency: (67,108,864 + 3*1,048,576)/12.5e6 + 4*0.01
    assert predict_chain_s(M, C, 12.5e6, 4, 0.01) == pytest.approx(70254592 / 12.5e6 + 0.04)
    # a snapshot smaller than a chunk pipelines in whole-snapshot steps
    assert predict_chain_s(1000, C, 1000.0, 3) == pytest.approx(3.0)
    assert predict_chain_s(M, C, math.inf, 4, 0.5) == 2.0


# ------------------------------------------------------------------ k


def test_paper_k():
    assert paper_k(400, 100, 16) == 4
    assert paper_k(450, 100, 16) == 4  # floor
    assert paper_k(50, 100, 16) == 1  # max(1, ...)
    assert paper_k(400, 100, 3) == 3  # never more chains than workers
    assert paper_k(300, 100, 16) == 3  # 300/100 is exactly 3 despite float noise
    assert paper_k(None, 100, 10) == 4  # unknown U: ceil(sqrt(N))
    assert paper_k(math.inf, 100, 16) == 4
    assert paper_k(400, 100, 0) == 0


def test_nominal_b_is_median_of_known_downs():
    ps = [Peer("a", 50), Peer("b", 100), Peer("c", 100), Peer("d", 1000), Peer("e", 0)]
    assert nominal_link_mbit(ps) == 100
    assert nominal_link_mbit([Peer("a")]) is None
    # b = median(50, 100, 200, 1000) = 150 -> k = floor(600/150) = 4
    ps = [Peer(f"w{i}", d, d) for i, d in enumerate([50, 100, 200, 1000] * 2)]
    assert plan_chains(ps, 600).k == 4


# ------------------------------------------------------------------ fresh plans


def test_homogeneous_design_example():
    ps = peers(16)
    plan = plan_chains(ps, 400, snapshot_bytes=M, chunk_bytes=C)
    check_plan(plan, ps)
    assert plan.k == 4 and plan.streams == 4
    assert sorted(len(c) for c in plan.chains) == [4, 4, 4, 4]
    # each chain at min(U/k = 100, 100) Mbit/s: (M + 3c)/12.5e6 = 70,254,592/12.5e6 = 5.62036736 s
    assert plan.predicted_s == pytest.approx(5.62036736)
    assert all(p.rate_mbit == pytest.approx(100) for p in plan.predictions)
    lb = lower_bound_s(M, 400, [100.0] * 16, [100.0] * 16)
    assert plan.predicted_s / lb == pytest.approx(70254592 / 67108864)  # 1.047x the bound


def test_learner_share_bounds_rate():
    # U=250, b=100 -> k=2, each chain gets U/2 = 125 Mbit/s > 100: the workers bind.
    plan = plan_chains(peers(6), 250, snapshot_bytes=M)
    assert plan.streams == 2 and all(p.rate_mbit == pytest.approx(100) for p in plan.predictions)
    assert all(p.bottleneck != "learner" for p in plan.predictions)
    # workers faster than the nominal b: U=2500, b=1000 -> k=2, U/2 = 1250 < 2000: learner binds
    ps = peers(6, down=2000, up=2000)
    plan = plan_chains(ps, 2500, link_mbit=1000, snapshot_bytes=M)
    assert plan.streams == 2
    assert all(
        p.bottleneck == "learner" and p.rate_mbit == pytest.approx(1250) for p in plan.predictions
    )


def test_slow_workers_grouped_not_spread():
    # 12 fast (100/100) + 4 slow (20/20): spreading the slow ones would slow all four chains
    # to 20 Mbit/s; grouping keeps three chains fast.
    ps = peers(12) + peers(4, 20, 20, prefix="s")
    plan = plan_chains(ps, 400, link_mbit=100, snapshot_bytes=M)
    check_plan(plan, ps)
    slow_chains = [c for c in plan.chains if any(w.startswith("s") for w in c)]
    assert len(slow_chains) == 1 and all(w.startswith("s") for w in slow_chains[0])
    times = sorted(p.time_s for p in plan.predictions)
    assert times[:3] == pytest.approx([5.62036736] * 3)
    assert times[3] == pytest.approx(70254592 / 2.5e6)  # 28.1018368 s at 20 Mbit/s


def test_poor_uploaders_go_to_tails():
    # 12 symmetric + 4 with 100 down / 10 up: each chain ends with one poor uploader, so no
    # chain is capped by a 10 Mbit/s upload
    ps = peers(12) + peers(4, 100, 10, prefix="p")
    plan = plan_chains(ps, 400, snapshot_bytes=M)
    check_plan(plan, ps)
    assert plan.streams == 4
    assert sorted(c[-1] for c in plan.chains) == ["p00", "p01", "p02", "p03"]
    assert plan.predicted_s == pytest.approx(5.62036736)


def test_many_poor_uploaders_extra_chains():
    # 8 symmetric + 8 poor uploaders, U=400, b=100: with the paper's k=4 only 4 tails exist, so
    # some chain relays through a 10 Mbit/s upload: (M + 3c)/1.25e6 = 56.2036736 s.
    ps = peers(8) + peers(8, 100, 10, prefix="p")
    strict = plan_chains(ps, 400, snapshot_bytes=M, extra_chains=False)
    check_plan(strict, ps)
    assert strict.streams == 4 and strict.predicted_s == pytest.approx(56.2036736)
    # 8 chains [fast, poor]: U/8 = 50 Mbit/s = 6.25e6 B/s; (M + c)/6.25e6 = 10.9051904 s
    plan = plan_chains(ps, 400, snapshot_bytes=M)
    check_plan(plan, ps)
    assert plan.k == 4 and plan.streams == 8
    assert all(c[-1].startswith("p") and len(c) == 2 for c in plan.chains)
    assert plan.predicted_s == pytest.approx(10.9051904)


def test_unreachable_at_tails():
    ps = peers(12) + peers(3, reachable=False, prefix="n")
    plan = plan_chains(ps, 400, snapshot_bytes=M)
    check_plan(plan, ps)
    assert plan.streams == 4
    for chain in plan.chains:
        assert all(not w.startswith("n") for w in chain[:-1])
    assert sum(c[-1].startswith("n") for c in plan.chains) == 3


def test_more_unreachable_than_chains_get_more_learner_streams():
    # 6 NAT'd workers, k=4: the extras get the learner as parent, i.e. 6 chains, each ending
    # in at most one NAT'd worker, and the 10 reachable workers spread over all 6.
    ps = peers(10) + peers(6, reachable=False, prefix="n")
    plan = plan_chains(ps, 400, snapshot_bytes=M)
    check_plan(plan, ps)
    assert plan.k == 4 and plan.streams == 6
    assert all(c[-1].startswith("n") for c in plan.chains)
    assert sorted(len(c) for c in plan.chains) == [2, 2, 3, 3, 3, 3]
    # slowest: a 3-chain at U/6 = 66.67 Mbit/s = 8.333e6 B/s: (M + 2c)/(50e6/6)
    assert plan.predicted_s == pytest.approx((M + 2 * C) / (50e6 / 6))


def test_all_unreachable_is_a_star():
    ps = peers(5, reachable=False)
    plan = plan_chains(ps, 400)
    check_plan(plan, ps)
    assert plan.streams == 5 and all(p is None for p in plan.parent.values())


def test_unknown_rates_and_edge_cases():
    ps = [Peer(f"w{i}") for i in range(10)]
    plan = plan_chains(ps)
    check_plan(plan, ps)
    assert plan.streams == 4 and plan.predicted_s is None
    assert all(p.time_s is None and p.rate_mbit is None for p in plan.predictions)
    # known U, unknown worker rates and no b: still sqrt(N), and no made-up prediction
    assert plan_chains(ps, 400).streams == 4 and plan_chains(ps, 400).predicted_s is None
    # unknown rates take the nominal b
    plan = plan_chains(ps, 400, link_mbit=100, snapshot_bytes=M)
    assert plan.streams == 4 and plan.predicted_s == pytest.approx((M + 2 * C) / 12.5e6)
    empty = plan_chains([], 400)
    assert empty.chains == [] and empty.predicted_s == 0.0
    one = plan_chains(peers(1), 400, snapshot_bytes=M)
    assert one.chains == [["w00"]] and one.parent == {"w00": None}
    with pytest.raises(ValueError, match="twice"):
        plan_chains(peers(2) + peers(1), 400)


def test_forced_chain_count():
    ps = peers(9)
    assert plan_chains(ps, 400, chains=3).streams == 3
    assert plan_chains(ps, 400, chains=20).streams == 9
    # forcing fewer chains than NAT'd workers is impossible: raised to the NAT count
    ps = peers(4) + peers(3, reachable=False, prefix="n")
    plan = plan_chains(ps, 400, chains=1)
    check_plan(plan, ps)
    assert plan.streams == 3


def test_random_plans_keep_invariants_and_beat_star():
    rng = random.Random(7)
    for n in (1, 2, 5, 16, 40):
        ps = [
            Peer(
                f"w{i}",
                rng.choice([20, 50, 100, 200]),
                rng.choice([5, 50, 100, 300]),
                rng.random() > 0.25,
                f"e{i}",
            )
            for i in range(n)
        ]
        plan = plan_chains(ps, 400, snapshot_bytes=M)
        check_plan(plan, ps)
        lb = lower_bound_s(
            M, 400, [p.down_mbit for p in ps], [p.up_mbit if p.reachable else 0.0 for p in ps]
        )
        assert plan.predicted_s >= lb * (1 - 1e-9)
        # never worse than a star through the same learner uplink (predicted; the star's
        # workers each at their own download rate)
        star = max(
            max(M / mbit_to_bytes_per_s(p.down_mbit) for p in ps), n * M / mbit_to_bytes_per_s(400)
        )
        assert plan.predicted_s <= star * 1.05 + 1e-9


def test_swap_scoring_matches_ordering_the_chain():
    """The local search scores swaps with ``_Members`` (no sorting); every score must equal the
    rate of the swapped chain in the order the planner would give it, or the search would take
    swaps that do not help."""
    from echo_rl.broadcast.chain_model import ChainModel, link_rates
    from echo_rl.broadcast.chain_search import _Members

    rng = random.Random(11)
    for trial in range(400):
        n = rng.randint(2, 9)
        ps = [
            Peer(
                f"w{i}",
                rng.choice([0, 20, 50, 100, rng.uniform(1, 500)]),
                rng.choice([0, 5, 50, 100, rng.uniform(1, 500)]),
                rng.random() > 0.3,
                f"e{i}",
            )
            for i in range(n)
        ]
        model = ChainModel(link_rates(ps, rng.choice([None, 100.0])), PlanParams(uplink_mbit=400))
        ids = [p.worker_id for p in ps]
        members, add = ids[:-1], ids[-1]
        drop = rng.choice([None, *members])
        share = rng.choice([math.inf, mbit_to_bytes_per_s(rng.uniform(10, 400))])
        got = _Members(model, members).rate_with(add, drop, share)
        ordered = model.order([w for w in members if w != drop] + [add])
        if ordered is None:
            assert got is None, trial
        else:
            assert got == model.rate(ordered, share)[0], trial


# ------------------------------------------------------------------ sources, topologies


def test_sources_map_parents_to_endpoints():
    ps = peers(8)
    plan = plan_chains(ps, 200)
    src = plan.sources({p.worker_id: p.endpoint for p in ps}, "tcp://learner:6000")
    for chain in plan.chains:
        assert src[chain[0]] == "tcp://learner:6000"
        for up, down in zip(chain, chain[1:]):
            assert src[down] == f"tcp://{up}:7000"
    with pytest.raises(ValueError, match="no endpoint"):
        plan.sources({}, "tcp://learner:6000")


def test_topologies_registered():
    assert TOPOLOGIES["star"] is StarTopology
    assert TOPOLOGIES["star-unlimited"] is StarUnlimitedTopology
    assert TOPOLOGIES["chains"] is ChainsTopology
    ps = peers(3)
    assert make_topology("star-unlimited").plan(ps, "L") == make_topology("star").plan(ps, "L")
    assert StarUnlimitedTopology.uplink_capped is False


def test_chains_topology_without_endpoints_degrades_to_star():
    # what the learner sends today: Peer(worker_id) only, nobody serves chunks
    topo = make_topology("chains")
    assert topo.plan([Peer(f"w{i}") for i in range(5)], "L") == {f"w{i}": "L" for i in range(5)}


def test_chains_topology_plans_then_replans_stably():
    topo = ChainsTopology(uplink_mbit=400, snapshot_bytes=M)
    ps = peers(16)
    first = topo.plan(ps, "L")
    plan1 = topo.last_plan
    assert plan1 is not None and plan1.streams == 4
    assert sum(v == "L" for v in first.values()) == 4
    gone = plan1.chains[0][1]
    second = topo.plan([p for p in ps if p.worker_id != gone], "L")
    assert changed_parents(plan1, topo.last_plan) == {plan1.chains[0][2]}
    assert second[plan1.chains[0][2]] == f"tcp://{plan1.chains[0][0]}:7000"
    # the uplink can be given per call
    topo.plan(ps, "L", uplink_mbit=800)
    assert topo.last_plan.streams == 8


# ------------------------------------------------------------------ re-planning


def base_plan(n: int = 16) -> tuple[list[Peer], ChainPlan]:
    ps = peers(n)
    return ps, plan_chains(ps, 400, snapshot_bytes=M)


def test_replan_unchanged_is_identity():
    ps, old = base_plan()
    new = replan(old, list(reversed(ps)))
    assert new.chains == old.chains and changed_parents(old, new) == set()


def test_relay_leaves_child_reattaches_to_nearest_live_ancestor():
    ps, old = base_plan()
    a, b, c, d = old.chains[0]
    new = replan(old, [p for p in ps if p.worker_id != b])
    check_plan(new, [p for p in ps if p.worker_id != b])
    assert new.parent[c] == a and new.parent[d] == c
    assert changed_parents(old, new) == {c}
    # two consecutive relays gone: d goes up to a; the head gone: its child pulls from the learner
    new = replan(old, [p for p in ps if p.worker_id not in (b, c)])
    assert new.parent[d] == a
    new = replan(old, [p for p in ps if p.worker_id != a])
    assert new.parent[b] is None and changed_parents(old, new) == {b}


def test_whole_chain_leaving_rebalances_from_tails():
    ps, old = base_plan()
    gone = set(old.chains[0])
    live = [p for p in ps if p.worker_id not in gone]
    new = replan(old, live)
    check_plan(new, live)
    # 12 workers, k=4 still: tails split off into a new chain, lengths within one
    assert new.streams == 4 and max(map(len, new.chains)) - min(map(len, new.chains)) <= 1
    assert len(changed_parents(old, new)) <= 3


def test_joiner_attaches_at_a_tail():
    ps, old = base_plan()
    joiner = Peer("j00", 100, 100, True, "tcp://j00:7000")
    new = replan(old, ps + [joiner])
    check_plan(new, ps + [joiner])
    assert new.child["j00"] is None and new.parent["j00"] in {c[-1] for c in old.chains}
    assert changed_parents(old, new) == set()  # nobody else moved


def test_joiner_goes_before_unreachable_or_poor_tail():
    ps = peers(12) + peers(4, reachable=False, prefix="n")
    old = plan_chains(ps, 400, snapshot_bytes=M)
    assert all(c[-1].startswith("n") for c in old.chains)
    joiner = Peer("j00", 100, 100, True, "tcp://j00:7000")
    new = replan(old, ps + [joiner])
    check_plan(new, ps + [joiner])
    moved = changed_parents(old, new)
    assert len(moved) == 1 and next(iter(moved)).startswith("n")
    assert new.parent[next(iter(moved))] == "j00"
    # poor-upload tails: fast joiners go in front of them rather than behind
    ps = peers(12) + peers(4, 100, 10, prefix="p")
    old = plan_chains(ps, 400, snapshot_bytes=M)
    joiners = peers(4, prefix="j")
    new = replan(old, ps + joiners)
    check_plan(new, ps + joiners)
    assert all(c[-1].startswith("p") for c in new.chains)
    assert new.predicted_s == pytest.approx((M + 4 * C) / 12.5e6)


def test_unreachable_joiner_without_reachable_tail_gets_learner():
    ps = peers(4) + peers(4, reachable=False, prefix="n")
    old = plan_chains(ps, 400, snapshot_bytes=M)
    assert old.streams == 4 and all(c[-1].startswith("n") for c in old.chains)
    nat = Peer("n99", 100, 100, False, "")
    new = replan(old, ps + [nat])
    check_plan(new, ps + [nat])
    assert new.parent["n99"] is None and new.streams == 5


def test_joiners_fill_missing_chains_first():
    ps = peers(2)
    old = plan_chains(ps, 400, snapshot_bytes=M)
    assert old.streams == 2
    more = ps + peers(2, prefix="j")
    new = replan(old, more)
    check_plan(new, more)
    assert new.streams == 4 and all(len(c) == 1 for c in new.chains)


def test_relay_turning_unreachable_moves_to_a_tail():
    ps, old = base_plan()
    a, b, c, d = old.chains[0]
    changed = [Peer(p.worker_id, 100, 100, False, "") if p.worker_id == b else p for p in ps]
    new = replan(old, changed)
    check_plan(new, changed)
    assert new.child[b] is None and new.parent[c] == a


def test_relay_whose_upload_collapses_moves_to_a_tail():
    ps, old = base_plan()
    a, b, c, d = old.chains[1]
    changed = [Peer(p.worker_id, 100, 5, True, p.endpoint) if p.worker_id == b else p for p in ps]
    new = replan(old, changed)
    check_plan(new, changed)
    # it re-joins where it hurts least, the tail of its own chain; only it and its child move
    assert new.chains[1] == [a, c, d, b] and changed_parents(old, new) == {b, c}
    assert new.predicted_s == pytest.approx(5.62036736)


def test_replan_falls_back_to_fresh_plan_beyond_tolerance():
    ps, old = base_plan()
    gone = old.chains[0][1]
    live = [p for p in ps if p.worker_id != gone]
    stable = replan(old, live)
    assert changed_parents(old, stable) == {old.chains[0][2]}
    # a negative tolerance means "always prefer the fresh plan": it is what comes back
    fresh = replan(old, live, tolerance=-0.5)
    assert fresh.chains == plan_with(live, old.params).chains


def test_replan_random_churn_keeps_invariants():
    rng = random.Random(3)
    pool = [
        Peer(
            f"w{i:02d}",
            rng.choice([50, 100, 200]),
            rng.choice([10, 100, 200]),
            rng.random() > 0.2,
            f"e{i}",
        )
        for i in range(40)
    ]
    live = pool[:16]
    plan = plan_chains(live, 400, snapshot_bytes=M)
    for _ in range(30):
        if rng.random() < 0.5 and len(live) > 1:
            live = [p for p in live if p is not rng.choice(live)]
        else:
            spare = [p for p in pool if p not in live]
            if spare:
                live = live + [rng.choice(spare)]
        new = replan(plan, live)
        check_plan(new, live)
        lb = lower_bound_s(
            M, 400, [p.down_mbit for p in live], [p.up_mbit if p.reachable else 0.0 for p in live]
        )
        assert new.predicted_s >= lb * (1 - 1e-9)
        plan = new


def test_replan_can_change_params():
    ps, old = base_plan()
    new = replan(old, ps, params=PlanParams(uplink_mbit=800, snapshot_bytes=M))
    check_plan(new, ps)
    assert new.streams == 8
