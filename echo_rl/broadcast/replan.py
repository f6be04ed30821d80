"""Re-planning (docs/design.md §5): after joins, leaves and changed rates, keep the old plan's
edges where possible, unless a fresh plan would be more than a tolerance faster."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from echo_rl.broadcast.chain_model import (
    ChainModel,
    ChainPlan,
    PlanParams,
    build_plan,
    link_rates,
    nominal_link_mbit,
    paper_k,
)
from echo_rl.broadcast.chain_search import chain_counts, plan_with

if TYPE_CHECKING:  # a type only: broadcast.topology imports the planner
    from echo_rl.broadcast.topology.base import Peer


def replan(
    old: ChainPlan,
    peers: Sequence[Peer],
    *,
    params: PlanParams | None = None,
    tolerance: float = 0.1,
) -> ChainPlan:
    """Re-plan after joins, leaves or changed rates, keeping edges where possible.

    * A worker that left is cut out of its chain: its child re-attaches to the nearest live
      ancestor (the previous live worker in the chain, or the learner).
    * A worker whose ``Peer`` changed so that it can no longer relay (now unreachable, or its
      upload became its chain's bottleneck) is taken out and re-attached like a joiner.
    * Joiners open new chains while there are fewer than the planner's minimum, else attach at
      the tail of the chain where they slow things least: after the tail, or just before it when
      the tail is unreachable or a poor uploader (then only that tail gets a new parent). An
      unreachable joiner with no reachable tail anywhere gets its own chain from the learner.
    * Chain counts and lengths are then repaired (split the longest chain's tail off, merge the
      shortest chain, move tails until lengths differ by at most one).
    * If this stable plan predicts more than ``tolerance`` slower than a fresh plan, the chains
      "must be rebalanced" and the fresh plan is returned instead.
    Untouched workers keep their parent unless one of those repairs moves them.
    """
    params = params or old.params
    fresh = plan_with(peers, params)
    b = params.link_mbit or nominal_link_mbit(peers)
    model = ChainModel(link_rates(peers, b), params)
    byid = {p.worker_id: p for p in peers}
    chains, demoted = _prune(old, byid, model)
    n = len(byid)
    minimum = chain_counts(model, paper_k(params.uplink_mbit, b, n), n, b)[0] if n else 0
    placed = {w for c in chains for w in c}
    joiners = [
        p.worker_id for p in peers if p.worker_id not in placed and p.worker_id not in demoted
    ]
    joiners = sorted(
        joiners + demoted, key=lambda w: (not model.rates[w].relay, -model.rates[w].as_relay, w)
    )
    for w in joiners:
        _attach(chains, w, model, minimum)
    _repair_counts(chains, model, minimum, max(minimum, fresh.streams))
    _repair_lengths(chains, model)
    stable = build_plan(chains, model, byid, fresh.k, b)
    if (
        stable.predicted_s is not None
        and fresh.predicted_s is not None
        and stable.predicted_s > fresh.predicted_s * (1 + tolerance)
    ):
        return fresh
    return stable


def _prune(
    old: ChainPlan, byid: dict[str, Peer], model: ChainModel
) -> tuple[list[list[str]], list[str]]:
    """Drop leavers (children fall back to the nearest live ancestor) and demote changed workers
    that can no longer relay well."""
    chains = [[w for w in c if w in byid] for c in old.chains]
    demoted: list[str] = []
    share = model.share(max(1, len([c for c in chains if c])))
    for chain in chains:
        for w in list(chain[:-1]):
            if byid[w] == old.peers.get(w):
                continue
            if not model.rates[w].relay or _upload_binds(chain, w, model, share):
                chain.remove(w)
                demoted.append(w)
    return [c for c in chains if c], demoted


def _upload_binds(chain: list[str], w: str, model: ChainModel, share: float) -> bool:
    """Is w's upload what limits its chain (as a relay), below what the chain would do without it?"""
    without = [x for x in chain if x != w]
    rate_without = model.rate(without, share)[0] if without else share
    r = model.rates[w]
    return r.up < min(rate_without, r.down) * (1 - 1e-6)


def _placements(chain: list[str], w: str, model: ChainModel) -> list[tuple[int, list[str]]]:
    """Where w may join an existing chain, with how many existing workers get a new parent:
    after the tail (if the tail can relay: nobody moves), or just before the tail (if w can
    relay: the old tail, e.g. unreachable or a poor uploader, moves behind w)."""
    out = []
    if model.rates[chain[-1]].relay:
        out.append((0, chain + [w]))
    if model.rates[w].relay:
        out.append((1, chain[:-1] + [w, chain[-1]]))
    return out


def _attach(chains: list[list[str]], w: str, model: ChainModel, minimum: int) -> None:
    if len(chains) < minimum:
        chains.append([w])
        return
    share = model.share(len(chains))
    base = [model.time(c, share) for c in chains]
    best_key, best = None, None
    for i, chain in enumerate(chains):
        for moved, cand in _placements(chain, w, model):
            t = model.time(cand, share)
            key = (max([t] + base[:i] + base[i + 1 :]), t, moved, len(cand), i)
            if best_key is None or key < best_key:
                best_key, best = key, (i, cand)
    if best is None:
        chains.append([w])  # an unreachable joiner and only unreachable tails: learner parent
    else:
        chains[best[0]] = best[1]


def _repair_counts(chains: list[list[str]], model: ChainModel, minimum: int, maximum: int) -> None:
    """Split off the longest chain's tail while below ``minimum`` chains; merge the shortest
    chain onto a chain with a reachable tail while above ``maximum``."""
    while len(chains) < minimum:
        longest = max(range(len(chains)), key=lambda i: (len(chains[i]), -i))
        if len(chains[longest]) < 2:
            break
        chains.append([chains[longest].pop()])
    while len(chains) > maximum:
        short = min(range(len(chains)), key=lambda i: (len(chains[i]), -i))
        moving = chains[short]
        if not all(model.rates[w].relay for w in moving[:-1]):
            break
        hosts = [i for i, c in enumerate(chains) if i != short and model.rates[c[-1]].relay]
        if not hosts:
            break
        host = min(hosts, key=lambda i: (len(chains[i]), i))
        chains[host] = chains[host] + moving
        del chains[short]


def _repair_lengths(chains: list[list[str]], model: ChainModel, max_moves: int = 10_000) -> None:
    """Move single workers from the longest to the shortest chain until lengths differ by at
    most one, preferring moves that re-parent the fewest workers."""
    for _ in range(max_moves):
        if not chains:
            return
        lo = min(range(len(chains)), key=lambda i: (len(chains[i]), i))
        hi = max(range(len(chains)), key=lambda i: (len(chains[i]), -i))
        if len(chains[hi]) - len(chains[lo]) <= 1:
            return
        move = _length_move(chains[hi], chains[lo], model, model.share(len(chains)))
        if move is None:
            return
        chains[hi], chains[lo] = move


def _length_move(
    src: list[str], dst: list[str], model: ChainModel, share: float
) -> tuple[list[str], list[str]] | None:
    options = []
    for pos in (len(src) - 1, len(src) - 2):
        if pos < 0:
            continue
        w = src[pos]
        rest = src[:pos] + src[pos + 1 :]
        if not model.valid(rest):
            continue
        for moved, cand in _placements(dst, w, model):
            cost = (len(src) - 1 - pos) + moved + 1  # workers that get a new parent
            t = max(model.time(rest, share), model.time(cand, share))
            options.append((t, cost, rest, cand))
    if not options:
        return None
    t, cost, rest, cand = min(options, key=lambda o: (o[0], o[1]))
    return rest, cand
