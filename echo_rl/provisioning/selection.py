"""Choosing the active set of rollout workers (docs/design.md §4, "Provisioning").

Problem: given worker throughputs ``mu_i`` (trajectories/s) and prices ``c_i`` ($/h), pick the
set A minimising ``sum(c_i, A)`` subject to ``sum(mu_i, A) >= target`` (target =
``alpha * mu_req``). It is a covering knapsack, NP-hard in general, so three solvers:

* ``greedy`` -- the paper's rule: sort by unit cost ``u_i = c_i / mu_i``, take the shortest
  prefix that reaches the target. Fast, but the last worker it adds can overshoot badly (a big,
  pricey worker taken to cover a tiny remainder).
* ``exact`` -- a MILP solved by HiGHS through ``scipy.optimize.milp``: the yardstick. Seconds on
  large pools, so benchmarks and offline planning only.
* ``ours`` -- greedy's order plus three cheap repairs, all vectorised with numpy so a decision
  over 100,000 candidates stays in the tens of milliseconds. Never worse than greedy: greedy's
  own answer is one of its starting candidates and every later step only accepts strict savings.

All three share the conventions below so their results compare directly:

* a target of 0 or less needs nobody: the empty set, feasible;
* when the whole pool cannot reach the target, the result is every worker with ``mu > 0``
  (the most capacity there is) with ``feasible=False`` and a message saying by how much it
  falls short -- the caller decides whether to run short or wait for more workers;
* a set counts as reaching the target if it is short by at most ``RTOL * target``: the
  throughputs are estimates good to a few percent, the slack only absorbs float rounding.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from echo_rl.core.errors import EchoError

RTOL = 1e-9


class SelectionError(EchoError, ValueError):
    """The inputs cannot describe a pool of workers (shapes, NaNs, negative values)."""

    default_reason = "selection"


@dataclass(frozen=True, eq=False)  # eq on numpy arrays is ambiguous; compare fields instead
class Selection:
    """The chosen active set. ``indices`` index the caller's arrays, sorted ascending."""

    indices: np.ndarray
    cost: float  # sum of price over the chosen workers ($/h)
    mu: float  # sum of throughput over the chosen workers (trajectories/s)
    target: float
    feasible: bool
    method: str
    message: str = ""

    def __len__(self) -> int:
        return len(self.indices)


# ---------------------------------------------------------------------------------------------
# shared plumbing


def _as_pool(mu: np.ndarray, price: np.ndarray, target: float) -> tuple[np.ndarray, np.ndarray]:
    """Validate and convert; errors say which input is wrong and how to fix it."""
    mu = np.asarray(mu, dtype=np.float64)
    price = np.asarray(price, dtype=np.float64)
    if mu.ndim != 1 or price.ndim != 1 or mu.shape != price.shape:
        raise SelectionError(
            f"mu and price must be 1-D arrays of the same length, got shapes "
            f"{mu.shape} and {price.shape}"
        )
    for name, arr in (("mu", mu), ("price", price)):
        if not np.all(np.isfinite(arr)):
            raise SelectionError(
                f"{name} holds NaN or infinite values at indices "
                f"{np.flatnonzero(~np.isfinite(arr))[:10].tolist()}; "
                f"drop those workers or give them a measured value"
            )
        if np.any(arr < 0):
            raise SelectionError(
                f"{name} must be >= 0, negative at indices {np.flatnonzero(arr < 0)[:10].tolist()}"
            )
    if not np.isfinite(target):
        raise SelectionError(f"target must be a finite number of trajectories/s, got {target}")
    return mu, price


def _result(
    mask: np.ndarray, mu: np.ndarray, price: np.ndarray, target: float, method: str
) -> Selection:
    idx = np.flatnonzero(mask)
    total_mu = float(mu[idx].sum())
    return Selection(
        indices=idx,
        cost=float(price[idx].sum()),
        mu=total_mu,
        target=float(target),
        feasible=_reaches(total_mu, target),
        method=method,
    )


def _reaches(total_mu: float, target: float) -> bool:
    return total_mu >= target - RTOL * abs(target)


def _trivial(mu: np.ndarray, price: np.ndarray, target: float, method: str) -> Selection | None:
    """Answers shared by every method: nothing needed, or not enough in the whole pool."""
    if target <= 0:
        return _result(np.zeros(mu.shape, bool), mu, price, target, method)
    useful = mu > 0
    total = float(mu[useful].sum())
    if not _reaches(total, target):
        sel = _result(useful, mu, price, target, method)
        msg = (
            f"infeasible: all {int(useful.sum())} workers together give {total:.6g} "
            f"trajectories/s, short of the target {target:.6g} by {target - total:.6g}; "
            f"add workers or lower the requirement (fewer rollouts per step, longer T_train)"
        )
        return Selection(sel.indices, sel.cost, sel.mu, sel.target, False, method, msg)
    return None


def unit_cost_order(mu: np.ndarray, price: np.ndarray) -> np.ndarray:
    """Indices of the workers with ``mu > 0`` by unit cost ``c/mu``.

    Ties are broken arbitrarily but deterministically: introsort is 5x faster than a stable
    sort at 100,000 workers, and equal unit costs are interchangeable for every solver here.
    """
    useful = np.flatnonzero(mu > 0)
    return useful[np.argsort(price[useful] / mu[useful])]


# ---------------------------------------------------------------------------------------------
# greedy: the paper's rule


def greedy(mu: np.ndarray, price: np.ndarray, target: float) -> Selection:
    """Shortest prefix of the unit-cost order whose throughput reaches ``target``."""
    mu, price = _as_pool(mu, price, target)
    trivial = _trivial(mu, price, target, "greedy")
    if trivial is not None:
        return trivial
    return _result(_greedy_mask(mu, price, target), mu, price, target, "greedy")


def _greedy_mask(mu: np.ndarray, price: np.ndarray, target: float) -> np.ndarray:
    order = unit_cost_order(mu, price)
    cum = np.cumsum(mu[order])
    k = min(int(np.searchsorted(cum, target - RTOL * target)) + 1, len(order))
    mask = np.zeros(mu.shape, bool)
    mask[order[:k]] = True
    return mask


# ---------------------------------------------------------------------------------------------
# exact: MILP yardstick


def exact(
    mu: np.ndarray,
    price: np.ndarray,
    target: float,
    time_limit_s: float | None = None,
    quiet: bool = True,
) -> Selection:
    """Optimal set by MILP (HiGHS via ``scipy.optimize.milp``), for benchmarks and planning.

    ``mip_rel_gap=0`` because the default 1e-4 stops early and would flatter the heuristics.
    HiGHS may return a set that misses the constraint by up to ~1e-6 relative (its feasibility
    tolerance after scaling); when that happens the bound is tightened by the miss and the
    problem solved again, so the answer reaches the target in exact arithmetic up to ``RTOL``.
    ``quiet`` silences a stray debug line that HiGHS 1.12 writes straight to file descriptor 1
    (ERGO-Code/HiGHS#2783) by pointing fd 1 at /dev/null during the solve -- output from other
    threads in that window is lost too, hence the switch.
    """
    mu, price = _as_pool(mu, price, target)
    trivial = _trivial(mu, price, target, "exact")
    if trivial is not None:
        return trivial
    useful = np.flatnonzero(mu > 0)
    scaled = mu[useful] / target  # constraint sum(x * mu / target) >= 1: well scaled for HiGHS
    bound = 1.0
    for _ in range(5):
        x = _solve_milp(price[useful], scaled, bound, time_limit_s, quiet)
        got = float(scaled[x].sum())
        if got >= 1.0 - RTOL:
            mask = np.zeros(mu.shape, bool)
            mask[useful[x]] = True
            return _result(mask, mu, price, target, "exact")
        bound += (1.0 - got) + 1e-12
    raise RuntimeError(
        f"HiGHS kept returning sets below the target (last: {got:.12f} of it) "
        f"after 5 tightened solves; rescale mu to O(1) values and retry"
    )


def _solve_milp(
    price: np.ndarray, scaled_mu: np.ndarray, bound: float, time_limit_s: float | None, quiet: bool
) -> np.ndarray:
    from scipy.optimize import Bounds, LinearConstraint, milp  # heavy import, only when needed

    options: dict[str, float | bool] = {"mip_rel_gap": 0.0}
    if time_limit_s is not None:
        options["time_limit"] = float(time_limit_s)
    with _stdout_to_devnull(quiet):
        res = milp(
            price,
            constraints=LinearConstraint(scaled_mu[None, :], bound, np.inf),
            integrality=np.ones_like(price),
            bounds=Bounds(0, 1),
            options=options,
        )
    if res.status != 0 or res.x is None:
        raise RuntimeError(
            f"HiGHS did not prove an optimum (status {res.status}: {res.message}); "
            f"raise time_limit_s or use ours() for a fast near-optimal answer"
        )
    chosen: np.ndarray[Any, Any] = np.asarray(res.x) > 0.5
    return chosen


@contextmanager
def _stdout_to_devnull(enabled: bool) -> Iterator[None]:
    if not enabled:
        yield
        return
    sys.stdout.flush()
    saved = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)


# ---------------------------------------------------------------------------------------------
# ours: greedy order + repairs


def ours(
    mu: np.ndarray,
    price: np.ndarray,
    target: float,
    *,
    max_swaps: int = 16,
    core_width: int = 16,
    core_fillers: int = 64,
    cost_grid: int = 4096,
) -> Selection:
    """Near-optimal set in O(n log n) numpy work; never costs more than ``greedy``.

    Two candidates, each polished by local search; the cheaper one wins.

    A. Best "prefix + one closer": for every worker w, the shortest unit-cost prefix *before* w
       that reaches the target together with w. Greedy's own prefix is kept as a candidate, so
       this already fixes greedy's typical failure -- covering a small remainder with a large,
       pricey worker when a small one (or one big one instead of the tail) would do.
    B. Exact-up-to-rounding solve of a *core*: the unit-cost prefix up to ``core_width``
       workers before greedy's break point is fixed; the ``2*core_width`` workers around the
       break plus the ``core_fillers`` cheapest remaining workers (small gap-fillers) go into a
       knapsack DP over cost buckets (the textbook FPTAS, on a core). Throughputs are never
       rounded, so feasibility is exact; costs are rounded *up* to ``cost_grid`` buckets of the
       budget A left for the core, so B errs only by a few buckets' worth.
    Local search on each: drop redundant members (most expensive first), then up to
    ``max_swaps`` improving 1-for-1 swaps. Every step accepts strict savings only and A
    starts from greedy's answer or better: hence "never worse than greedy".
    """
    if min(max_swaps, core_width, core_fillers) < 0 or cost_grid < 1:
        raise SelectionError(
            f"ours() tuning knobs out of range: max_swaps={max_swaps}, "
            f"core_width={core_width}, core_fillers={core_fillers} must be "
            f">= 0 and cost_grid={cost_grid} >= 1"
        )
    mu, price = _as_pool(mu, price, target)
    trivial = _trivial(mu, price, target, "ours")
    if trivial is not None:
        return trivial
    pool = _Sorted.of(mu, price)
    best = _polish(pool, target, _prefix_plus_closer(pool, target), max_swaps)
    best_cost = float(price[best].sum())
    core = _core_dp(pool, target, best_cost, core_width, core_fillers, cost_grid)
    if core is not None:
        core = _polish(pool, target, core, max_swaps)
        if float(price[core].sum()) < best_cost:
            best = core
    return _result(best, mu, price, target, "ours")


def _polish(pool: _Sorted, target: float, mask: np.ndarray, max_swaps: int) -> np.ndarray:
    mask = _drop_redundant(pool.mu, pool.price, target, mask)
    return _improve_by_swaps(pool, target, mask, max_swaps)


@dataclass(frozen=True)
class _Sorted:
    """The two orders ``ours`` works in, computed once (the sorts are most of its time)."""

    mu: np.ndarray
    price: np.ndarray
    by_unit_cost: np.ndarray  # useful workers (mu > 0), cheapest per trajectory first
    rank: np.ndarray  # rank[w]: position of worker w in by_unit_cost
    unit_sorted: np.ndarray  # unit costs in that order
    by_mu: np.ndarray  # useful workers, smallest mu first

    @classmethod
    def of(cls, mu: np.ndarray, price: np.ndarray) -> _Sorted:
        order = unit_cost_order(mu, price)
        rank = np.full(mu.shape, -1, dtype=np.int64)
        rank[order] = np.arange(len(order))
        useful = np.flatnonzero(mu > 0)
        by_mu = useful[np.argsort(mu[useful])]
        return cls(mu, price, order, rank, price[order] / mu[order], by_mu)


def _prefix_plus_closer(pool: _Sorted, target: float) -> np.ndarray:
    """Cheapest of: greedy's prefix, and (prefix of length j_w) + worker w for every w."""
    mu, price, order = pool.mu, pool.price, pool.by_unit_cost
    n = len(order)
    cum_mu = np.concatenate(([0.0], np.cumsum(mu[order])))  # cum_mu[j]: the first j together
    cum_price = np.concatenate(([0.0], np.cumsum(price[order])))
    need = target - RTOL * target
    # j_w: shortest prefix reaching the target together with w. Workers are visited largest mu
    # first so the queries ascend: same answer, but searchsorted runs cache-friendly.
    closers = pool.by_mu[::-1]
    j = np.searchsorted(cum_mu, need - mu[closers], side="left")
    usable = j <= pool.rank[closers]  # w must lie outside its own prefix (else: plain greedy)
    cost = np.where(usable, cum_price[np.minimum(j, n)] + price[closers], np.inf)
    k = int(np.searchsorted(cum_mu, need, side="left"))  # greedy's prefix length
    best = int(np.argmin(cost))
    mask = np.zeros(mu.shape, bool)
    if cost[best] < cum_price[k]:
        mask[order[: j[best]]] = True
        mask[closers[best]] = True
    else:
        mask[order[:k]] = True
    return mask


def _core_dp(
    pool: _Sorted, target: float, budget: float, width: int, fillers: int, grid: int
) -> np.ndarray | None:
    """Candidate B of ``ours``: fixed prefix + DP over a core; None if it cannot beat ``budget``.

    ``dp[g]`` is the largest throughput reachable with core workers whose rounded-up costs sum
    to exactly ``g`` buckets; the answer is the smallest ``g`` whose throughput covers what the
    fixed prefix leaves. O(core * grid) with one numpy pass per core worker, independent of n.
    """
    mu, price, order = pool.mu, pool.price, pool.by_unit_cost
    need = target - RTOL * target
    cum_mu = np.concatenate(([0.0], np.cumsum(mu[order])))
    k = int(np.searchsorted(cum_mu, need, side="left"))  # greedy's prefix length
    fixed = max(0, k - width)
    left_mu = need - float(cum_mu[fixed])
    left_budget = budget - float(price[order[:fixed]].sum())
    if left_budget <= 0:
        return None
    core = _core_members(order[fixed:], price, width, fillers)
    buckets = np.ceil(price[core] * grid / left_budget).astype(np.int64)
    within = buckets <= grid  # a worker pricier than the whole budget cannot be in a better set
    core, buckets = core[within], buckets[within]
    took = _knapsack_by_cost(mu[core], buckets, grid)
    reach = np.flatnonzero(took.best_mu >= left_mu)
    if len(reach) == 0:
        return None
    mask = np.zeros(mu.shape, bool)
    mask[order[:fixed]] = True
    mask[core[took.members(int(reach[0]), buckets)]] = True
    return mask


def _core_members(rest: np.ndarray, price: np.ndarray, width: int, fillers: int) -> np.ndarray:
    """Workers around the break point (in unit-cost order) plus the cheapest of the others."""
    near, far = rest[: 2 * width], rest[2 * width :]
    if len(far) > fillers:
        far = far[np.argpartition(price[far], fillers)[:fillers]]
    return np.concatenate((near, far))


@dataclass(frozen=True)
class _Knapsack:
    best_mu: np.ndarray  # best_mu[g]: most throughput for exactly g cost buckets (-inf: none)
    took: np.ndarray  # took[i, g]: the optimum for g after item i includes item i

    def members(self, g: int, buckets: np.ndarray) -> np.ndarray:
        """Walk the decisions back from bucket ``g``: which items make that optimum."""
        chosen = []
        for i in range(len(buckets) - 1, -1, -1):
            if self.took[i, g]:
                chosen.append(i)
                g -= int(buckets[i])
        return np.array(chosen[::-1], dtype=np.int64)


def _knapsack_by_cost(mu: np.ndarray, buckets: np.ndarray, grid: int) -> _Knapsack:
    best = np.full(grid + 1, -np.inf)
    best[0] = 0.0
    took = np.zeros((len(mu), grid + 1), bool)
    with_item = np.empty(grid + 1)
    for i, (m, w) in enumerate(zip(mu, buckets)):
        with_item[:w] = -np.inf
        with_item[w:] = best[: grid + 1 - w] + m
        took[i] = with_item > best
        np.maximum(best, with_item, out=best)
    return _Knapsack(best, took)


def _drop_redundant(
    mu: np.ndarray, price: np.ndarray, target: float, mask: np.ndarray
) -> np.ndarray:
    """Remove chosen workers the surplus can spare, highest price first (largest saving)."""
    surplus = float(mu[mask].sum()) - target
    spare = np.flatnonzero(mask & (mu <= surplus))
    if len(spare) == 0:
        return mask
    mask = mask.copy()
    spare = spare[np.argsort(-price[spare], kind="stable")]
    smallest = float(mu[spare].min())
    for i in spare:  # sequential by nature (each drop shrinks the surplus), and short
        if mu[i] <= surplus:
            mask[i] = False
            surplus -= float(mu[i])
            if surplus < smallest:
                break
    return mask


def _improve_by_swaps(pool: _Sorted, target: float, mask: np.ndarray, max_swaps: int) -> np.ndarray:
    """Best improving 1-for-1 swap per round, then drop what the new surplus spares."""
    for _ in range(max_swaps):
        swap = _best_swap(pool, target, mask)
        if swap is None:
            break
        out, into = swap
        mask = mask.copy()
        mask[out], mask[into] = False, True
        mask = _drop_redundant(pool.mu, pool.price, target, mask)
    return mask


def _best_swap(pool: _Sorted, target: float, mask: np.ndarray) -> tuple[int, int] | None:
    """(chosen, unchosen) pair with the largest saving that keeps the target, or None.

    Replacing chosen r by unchosen a keeps the target iff ``mu_a >= mu_r - surplus``; the
    cheapest such a is a suffix minimum of price over the candidates sorted by mu.
    Exact pruning keeps a round cheap on huge pools: a saving needs ``price_a < price_r`` and
    ``mu_a >= mu_r - surplus``, hence ``u_a < price_r / (mu_r - surplus)`` (the r's "ceiling").
    Only r whose ceiling is above the cheapest unchosen unit cost can gain, and only unchosen a
    below the highest such ceiling can serve: both sets sit near greedy's break point.
    """
    mu, price, order = pool.mu, pool.price, pool.by_unit_cost
    surplus = float(mu[mask].sum()) - target
    first_free = int(np.argmin(mask[order]))  # first unchosen in unit-cost order
    if mask[order[first_free]]:
        return None  # everyone is chosen
    chosen = np.flatnonzero(mask)
    slack = mu[chosen] - surplus
    ceiling = np.full(len(chosen), np.inf)  # slack <= 0: r is spare, any a keeps the target
    np.divide(price[chosen], slack, out=ceiling, where=slack > 0)
    gains = ceiling > pool.unit_sorted[first_free]
    out = chosen[gains]
    if len(out) == 0:
        return None
    stop = int(np.searchsorted(pool.unit_sorted, ceiling[gains].max(), side="left"))
    into = order[:stop]
    into = into[~mask[into]]
    into = into[np.argsort(mu[into])]
    suffix_min, suffix_arg = _suffix_argmin(price[into])
    pos = np.searchsorted(mu[into], mu[out] - surplus, side="left")
    ok = pos < len(into)
    saving = np.full(len(out), -np.inf)
    saving[ok] = price[out[ok]] - suffix_min[pos[ok]]
    best = int(np.argmax(saving))
    if not saving[best] > 1e-12 * max(1.0, float(price[out[best]])):
        return None
    return int(out[best]), int(into[suffix_arg[pos[best]]])


def _suffix_argmin(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For every k: min(values[k:]) and the index where it sits."""
    rev = values[::-1]
    run_min = np.minimum.accumulate(rev)
    # the position in `rev` where the running minimum was last set
    is_new = np.concatenate(([True], rev[1:] < run_min[:-1]))
    last_set = np.maximum.accumulate(np.where(is_new, np.arange(len(rev)), 0))
    arg = (len(values) - 1 - last_set)[::-1]
    return run_min[::-1], arg
