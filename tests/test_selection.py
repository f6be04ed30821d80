"""Active-set selection: greedy (paper), exact (MILP yardstick) and ours."""

import numpy as np
import pytest

from echo_rl.provisioning.selection import SelectionError, exact, greedy, ours
from echo_rl.provisioning.sim.pools import random_pool

SOLVERS = (greedy, exact, ours)
EPS = 1e-9


def test_greedy_hand_computed():
    # unit costs c/mu: 2/4 = 0.5, 3/3 = 1.0, 1.2/2 = 0.6, 5/1 = 5 -> order 0, 2, 1, 3
    # target 6: cumulative mu 4, 6 -> prefix {0, 2}, cost 2 + 1.2 = 3.2
    mu, price = np.array([4.0, 3.0, 2.0, 1.0]), np.array([2.0, 3.0, 1.2, 5.0])
    sel = greedy(mu, price, 6.0)
    assert sel.indices.tolist() == [0, 2]
    assert sel.cost == pytest.approx(3.2) and sel.mu == pytest.approx(6.0) and sel.feasible
    assert exact(mu, price, 6.0).cost == pytest.approx(3.2)  # the optimum here, too


def test_greedy_failure_case_ours_strictly_wins():
    # unit costs 1/10 = 0.1, 20/100 = 0.2, 0.5/1 = 0.5; target 11.
    # greedy: 10 < 11, then the big one: {0, 1}, mu 110, cost 21.
    # optimum: {0, 2}, mu 11, cost 1.5 -- the cheap small worker closes the gap.
    mu, price = np.array([10.0, 100.0, 1.0]), np.array([1.0, 20.0, 0.5])
    g, o, e = greedy(mu, price, 11.0), ours(mu, price, 11.0), exact(mu, price, 11.0)
    assert g.indices.tolist() == [0, 1] and g.cost == pytest.approx(21.0)
    assert o.indices.tolist() == [0, 2] and o.cost == pytest.approx(1.5)
    assert e.cost == pytest.approx(1.5)
    assert o.cost < g.cost


def test_one_big_worker_replaces_greedys_tail():
    # unit costs: 1/2 = 0.5 for each small one, 7/10 = 0.7 for the big one; target 10.5.
    # greedy: five small (mu 10 < 10.5), then the big one: cost 5 + 7 = 12.
    # optimum: big + one small, mu 12, cost 7 + 1 = 8.
    mu = np.array([2.0] * 5 + [10.0])
    price = np.array([1.0] * 5 + [7.0])
    assert greedy(mu, price, 10.5).cost == pytest.approx(12.0)
    assert ours(mu, price, 10.5).cost == pytest.approx(8.0)
    assert exact(mu, price, 10.5).cost == pytest.approx(8.0)


def test_exact_target_reached_with_equality():
    # integer data, optimum hits the target exactly: {0, 1} mu 3 + 3 = 6 cost 6; {0, 2} costs 8
    mu, price = np.array([3.0, 3.0, 4.0]), np.array([3.0, 3.0, 5.0])
    for solve in SOLVERS:
        sel = solve(mu, price, 6.0)
        assert sel.feasible and sel.mu >= 6.0
    assert exact(mu, price, 6.0).indices.tolist() == [0, 1]


@pytest.mark.parametrize("solve", SOLVERS)
def test_infeasible_pool_returns_everyone_useful_and_says_so(solve):
    # all together: 1 + 2 = 3 < 5; the worker with mu 0 adds nothing and is left out
    mu, price = np.array([1.0, 2.0, 0.0]), np.array([1.0, 1.0, 9.0])
    sel = solve(mu, price, 5.0)
    assert not sel.feasible
    assert sel.indices.tolist() == [0, 1] and sel.mu == pytest.approx(3.0)
    assert "short of the target 5 by 2" in sel.message


@pytest.mark.parametrize("solve", SOLVERS)
def test_no_target_needs_nobody(solve):
    sel = solve(np.array([1.0, 2.0]), np.array([1.0, 1.0]), 0.0)
    assert sel.feasible and len(sel) == 0 and sel.cost == 0.0


@pytest.mark.parametrize("solve", SOLVERS)
def test_free_workers_are_used(solve):
    sel = solve(np.array([1.0, 1.0]), np.array([0.0, 1.0]), 1.0)
    assert sel.indices.tolist() == [0] and sel.cost == 0.0


@pytest.mark.parametrize("solve", SOLVERS)
@pytest.mark.parametrize(
    "mu, price, match",
    [
        (np.ones(3), np.ones(2), "same length"),
        (np.array([1.0, np.nan]), np.ones(2), "NaN"),
        (np.ones(2), np.array([1.0, -1.0]), "price must be >= 0"),
        (np.ones((2, 2)), np.ones((2, 2)), "1-D"),
    ],
)
def test_bad_inputs(solve, mu, price, match):
    with pytest.raises(SelectionError, match=match):
        solve(mu, price, 1.0)


def _pools(seed: int, count: int):
    """Realistic pools (GPU classes) and plain uniform ones, small enough for the MILP."""
    rng = np.random.default_rng(seed)
    for i in range(count):
        n = int(rng.integers(3, 60))
        if i % 2:
            mu, price = random_pool(rng, n)
        else:
            mu, price = rng.uniform(0.1, 5, n), rng.uniform(0.1, 3, n)
        yield mu, price, float(rng.uniform(0.05, 0.95) * mu.sum())


def test_exact_le_ours_le_greedy_on_random_pools():
    strictly_better = 0
    for mu, price, target in _pools(seed=7, count=80):
        e, o, g = exact(mu, price, target), ours(mu, price, target), greedy(mu, price, target)
        for sel in (e, o, g):
            assert sel.feasible and sel.mu >= target * (1 - EPS)
            assert np.all(np.diff(sel.indices) > 0)  # sorted, no duplicates
            assert sel.cost == pytest.approx(price[sel.indices].sum())
            assert sel.mu == pytest.approx(mu[sel.indices].sum())
        assert e.cost <= o.cost * (1 + EPS)
        assert o.cost <= g.cost * (1 + EPS)
        strictly_better += o.cost < g.cost * (1 - EPS)
    assert strictly_better > 0  # the repairs do something on realistic pools


def test_ours_never_worse_than_greedy_on_large_pools():
    # too large for the MILP in a unit test; the property must still hold
    rng = np.random.default_rng(3)
    for n in (1000, 20_000):
        mu, price = random_pool(rng, n)
        for frac in (0.05, 0.5, 0.99):
            target = frac * float(mu.sum())
            o, g = ours(mu, price, target), greedy(mu, price, target)
            assert o.feasible and o.mu >= target * (1 - EPS)
            assert o.cost <= g.cost * (1 + EPS)


def test_ties_and_identical_workers():
    # 10 identical workers, target 3.5 -> any 4 of them, cost 4, for every solver
    mu, price = np.ones(10), np.ones(10)
    for solve in SOLVERS:
        sel = solve(mu, price, 3.5)
        assert len(sel) == 4 and sel.cost == pytest.approx(4.0)
