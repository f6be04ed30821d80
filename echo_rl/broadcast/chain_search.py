"""Fresh chain plans (docs/design.md §5): try the candidate chain counts, deal the workers
into chains by rate with the poor uploaders and unreachable workers at the tails, then swap
workers between chains while the slower chain gets faster (``_improve``, scored in O(1) by
``_Members``). See ``echo_rl.broadcast.planner`` for the choices made and what they cost.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from echo_rl.broadcast.chain_model import (
    DEFAULT_CHUNK_BYTES,
    EPS,
    ChainModel,
    ChainPlan,
    LinkRates,
    PlanParams,
    build_plan,
    link_rates,
    mbit_to_bytes_per_s,
    nominal_link_mbit,
    paper_k,
    predict_chain_s,
)

if TYPE_CHECKING:  # a type only: broadcast.topology imports the planner
    from echo_rl.broadcast.topology.base import Peer


def plan_chains(
    peers: Sequence[Peer],
    uplink_mbit: float | None = None,
    link_mbit: float | None = None,
    *,
    snapshot_bytes: int = 0,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    latency_s: float = 0.0,
    chains: int | None = None,
    extra_chains: bool = True,
    min_gain: float = 0.05,
) -> ChainPlan:
    """Plan chains from scratch, with ``PlanParams``' fields (what each means is said there)."""
    params = PlanParams(
        uplink_mbit,
        link_mbit,
        snapshot_bytes,
        chunk_bytes,
        latency_s,
        chains,
        extra_chains,
        min_gain,
    )
    return plan_with(peers, params)


def plan_with(peers: Sequence[Peer], params: PlanParams) -> ChainPlan:
    """Plan chains from scratch with explicit parameters (tries the candidate chain counts,
    keeps the fastest by ``min_gain``)."""
    b = params.link_mbit or nominal_link_mbit(peers)
    model = ChainModel(link_rates(peers, b), params)
    byid = {p.worker_id: p for p in peers}
    n = len(peers)
    k = paper_k(params.uplink_mbit, b, n)
    if n == 0:
        return build_plan([], model, byid, 0, b)
    candidates = chain_counts(model, k, n, b)
    best: ChainPlan | None = None
    for count in candidates:
        chains = _improve(_initial(model, count, b), model)
        plan = build_plan(chains, model, byid, k, b)
        if best is None or _better(plan, best, params.min_gain):
            best = plan
    assert best is not None
    return best


def chain_counts(model: ChainModel, k: int, n: int, b: float | None) -> list[int]:
    """The counts to try: the paper's k raised to the number of unreachable workers, plus (when
    allowed) up to one more per extra poor uploader, at most 9 counts evenly spread."""
    p = model.params
    unreachable = sum(not r.relay for r in model.rates.values())
    if p.chains:
        return [max(min(p.chains, n), min(n, unreachable))]
    base = min(n, max(k, unreachable))
    if not p.extra_chains:
        return [base]
    nominal = mbit_to_bytes_per_s(b) if b else math.inf
    poor = sum(_poor_upload(r, nominal) for r in model.rates.values())
    top = min(n, base + max(0, unreachable + poor - base))
    if top - base <= 8:
        return list(range(base, top + 1))
    return sorted({base + round((top - base) * i / 8) for i in range(9)})


def _better(plan: ChainPlan, best: ChainPlan, min_gain: float) -> bool:
    """More chains cost learner egress: take them only for a real gain."""
    if plan.predicted_s is None or best.predicted_s is None:
        return False
    return plan.predicted_s < best.predicted_s * (1 - min_gain)


def _initial(model: ChainModel, count: int, b: float | None) -> list[list[str]]:
    """Contiguous blocks of workers sorted by download rate (grouping), longer blocks first
    (to the faster groups); then at most one unreachable worker per chain, and poor uploaders
    spread so each lands on a chain tail where possible."""
    ids = sorted(model.rates, key=lambda w: (-model.rates[w].down, -model.rates[w].up, w))
    n = len(ids)
    sizes = [n // count + (1 if j < n % count else 0) for j in range(count)]
    chains, start = [], 0
    for size in sizes:
        chains.append(ids[start : start + size])
        start += size
    nominal = mbit_to_bytes_per_s(b) if b else math.inf
    _spread(chains, model, lambda w: not model.rates[w].relay)
    _spread(
        chains, model, lambda w: not model.rates[w].relay or _poor_upload(model.rates[w], nominal)
    )
    _feed_directly(chains, model)
    return [model.order(c) or c for c in chains]


def _feed_directly(chains: list[list[str]], model: ChainModel) -> None:
    """A tail that cannot punch needs a directly reachable relay in its chain: swap one in
    from a chain that can spare it (for a punchable relay of this chain), else the tail pulls
    from the learner on a chain of its own (docs/nat.md)."""
    r = model.rates

    def spare(d: list[str]) -> int:
        needs = any(r[w].needs_direct for w in d)
        return sum(r[w].direct for w in d) - (1 if needs else 0)

    for i in range(len(chains)):
        c = chains[i]
        tail = next((w for w in c if r[w].needs_direct), None)
        if tail is None or len(c) == 1 or any(r[w].direct for w in c if w != tail):
            continue
        donor = next((d for j, d in enumerate(chains) if j != i and spare(d) > 0), None)
        mine = [w for w in c if w != tail and r[w].relay]
        if donor is not None and mine:
            give = min(
                (w for w in donor if r[w].direct and not r[w].needs_direct),
                key=lambda w: (r[w].as_relay, w),
            )
            take = mine[-1]
            donor[donor.index(give)], c[c.index(take)] = take, give
        else:
            c.remove(tail)
            chains.append([tail])


def _poor_upload(r: LinkRates, nominal: float) -> bool:
    """Upload below both its own download and the nominal rate: it would slow a chain as relay."""
    return r.relay and r.up < min(r.down, nominal) * 0.99


def _spread(chains: list[list[str]], model: ChainModel, tail_only: Callable[[str], bool]) -> None:
    """Swap surplus tail-only workers (all but the worst uploader of a chain) with a worker of
    the nearest chain that has none, closest in download rate, while such a chain exists. With
    tail_only = unreachable this always succeeds (count >= #unreachable)."""

    def marked(c: list[str]) -> list[str]:
        return sorted(
            (w for w in c if tail_only(w)),
            key=lambda w: (model.rates[w].relay, model.rates[w].up, w),
        )

    # chains without a marked worker, kept up to date across swaps (recounting every chain
    # per swap made this quadratic: seconds for 1,000 workers)
    free = {j for j, c in enumerate(chains) if not any(tail_only(w) for w in c)}
    for i, chain in enumerate(chains):
        while len(mine := marked(chain)) > 1:
            if not free:
                return
            u = mine[-1]
            j = min(free, key=lambda j: (abs(j - i), j))
            other = chains[j]
            v = min(other, key=lambda w: (abs(model.rates[w].down - model.rates[u].down), w))
            chain[chain.index(u)], other[other.index(v)] = v, u
            free.discard(j)  # it now holds u; chain i still holds at least one marked worker


def _improve(chains: list[list[str]], model: ChainModel, max_passes: int = 20) -> list[list[str]]:
    """Local search: swap the bottleneck worker of a chain with any worker of another chain
    whenever the slower of the two chains gets faster (or, equally slow, their sum drops). The
    sorted vector of chain times strictly decreases, so this terminates; max_passes bounds the
    cost (O(k * N * L) per pass)."""
    share = model.share(len(chains))
    times = [model.time(c, share) for c in chains]
    for _ in range(max_passes):
        improved = False
        for a in sorted(range(len(chains)), key=lambda j: -times[j]):
            rate, who = model.rate(chains[a], share)
            if who is None or who == "learner":
                continue
            move = _best_swap(chains, times, a, who, model, share)
            if move is not None:
                b, new_a, new_b = move
                chains[a], chains[b] = new_a, new_b
                times[a], times[b] = model.time(new_a, share), model.time(new_b, share)
                improved = True
        if not improved:
            break
    return chains


def _best_swap(
    chains: list[list[str]], times: list[float], a: int, x: str, model: ChainModel, share: float
) -> tuple[int, list[str], list[str]] | None:
    """The swap of x (chain a's bottleneck) that most improves (max, sum) of the two times.

    Candidates are scored with ``_Members`` (the rate of a member set in its best order, O(1)
    per swap) instead of ordering and timing both new chains: this loop is the planner's whole
    cost. Only the winning swap is ordered."""
    limit = model.rate(chains[a], share)[0] * (1 + EPS)
    p = model.params
    a_rest = _Members(model, [w for w in chains[a] if w != x])
    best_key: tuple[float, float] | None = None
    best = None
    for b, other in enumerate(chains):
        if b == a:
            continue
        current = (max(times[a], times[b]), times[a] + times[b])
        b_all = _Members(model, other)
        seen: set[LinkRates] = set()
        for y in other:
            ry = model.rates[y]
            if ry.down <= limit or ry in seen:
                continue  # chain a would still be this slow / the same rates scored already
            seen.add(ry)
            ra, rb = a_rest.rate_with(y, None, share), b_all.rate_with(x, y, share)
            if ra is None or rb is None:
                continue
            ta = predict_chain_s(p.snapshot_bytes, p.chunk_bytes, ra, len(chains[a]), p.latency_s)
            tb = predict_chain_s(p.snapshot_bytes, p.chunk_bytes, rb, len(other), p.latency_s)
            key = (max(ta, tb), ta + tb)
            if _less(key, current) and (best_key is None or _less(key, best_key)):
                best_key, best = key, (b, y)
    if best is None:
        return None
    b, y = best
    new_a = model.order([w for w in chains[a] if w != x] + [y])
    new_b = model.order([w for w in chains[b] if w != y] + [x])
    assert new_a is not None and new_b is not None
    return b, new_a, new_b


class _Members:
    """A chain's members, ready to answer "the rate of this set, with ``add`` in and ``drop``
    out, in its best order" without sorting.

    In the best order (``ChainModel.order``) the tail is the unreachable member if there is one,
    else the member with the lowest relay rate min(down, up); everyone else relays. So the rate
    is min(share, tail's download, lowest relay rate among the others), and only the three
    lowest relay rates (one may be dropped, one may be the tail) and the unreachable member are
    needed."""

    def __init__(self, model: ChainModel, members: Sequence[str]):
        self.rates = model.rates
        self.low = sorted(members, key=lambda w: self.rates[w].as_relay)[:3]
        self.unreachable = [w for w in members if not self.rates[w].relay]

    def rate_with(self, add: str, drop: str | None, share: float) -> float | None:
        """None: the set would hold two unreachable workers (no valid order)."""
        r = self.rates
        unreachable = [w for w in self.unreachable if w != drop]
        if not r[add].relay:
            unreachable.append(add)
        if len(unreachable) > 1:
            return None
        tail = unreachable[0] if unreachable else None
        # the two lowest relay rates of the new set, the tail's excepted (if it is known)
        first = second = math.inf
        first_w = None
        for w in (*self.low, add):
            if w == drop or w == tail:
                continue
            v = r[w].as_relay
            if v < first:
                first, second, first_w = v, first, w
            elif v < second:
                second = v
        if tail is None:  # the lowest relay rate takes the tail, the next one bounds the rest
            tail, first = first_w, second
        assert tail is not None
        return min(share, r[tail].down, first)


def _less(x: tuple[float, float], y: tuple[float, float]) -> bool:
    """Lexicographic x < y with a relative tolerance, so float noise never counts as progress."""

    def lt(p: float, q: float) -> bool:
        return p < q - EPS * max(1.0, abs(q)) if math.isfinite(q) else p < q

    def eq(p: float, q: float) -> bool:
        return not lt(p, q) and not lt(q, p)

    return lt(x[0], y[0]) or (eq(x[0], y[0]) and lt(x[1], y[1]))
