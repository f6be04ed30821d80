"""What the chain planner reasons with (docs/design.md §5): a plan's data (``PlanParams``,
``ChainPlan``), each worker's link rates (``LinkRates``), and ``ChainModel``, which rates and
times a chain and orders its members. ``echo_rl.broadcast.chain_search`` makes fresh plans with it,
``echo_rl.broadcast.replan`` repairs old ones; ``echo_rl.broadcast.planner`` is the entry point.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, overload

if TYPE_CHECKING:  # types only: broadcast.topology imports the planner
    import numpy as np
    import numpy.typing as npt

    from echo_rl.broadcast.topology.base import Peer

BYTES_PER_MBIT = 1e6 / 8  # 1 Mbit/s = 125,000 bytes/s (network units are decimal)
DEFAULT_CHUNK_BYTES = 1 << 20  # docs/design.md §5: 1 MiB chunks on shaped links
EPS = 1e-9


def mbit_to_bytes_per_s(mbit: float) -> float:
    """Mbit/s (decimal, as links are quoted) to bytes/s."""
    return mbit * BYTES_PER_MBIT


@overload
def predict_chain_s(
    M_bytes: float, chunk_bytes: int, rate_bytes_per_s: float, length: int, latency_s: float = 0.0
) -> float: ...
@overload
def predict_chain_s(
    M_bytes: float,
    chunk_bytes: int,
    rate_bytes_per_s: float,
    length: npt.NDArray[np.int_],
    latency_s: float = 0.0,
) -> npt.NDArray[np.float64]: ...
def predict_chain_s(
    M_bytes: float,
    chunk_bytes: int,
    rate_bytes_per_s: float,
    length: int | npt.NDArray[np.int_],
    latency_s: float = 0.0,
) -> object:  # the overloads above give each caller its type
    """docs/design.md §5: the tail gets the last chunk M/rate after the head started, plus one chunk time
    per extra hop (store-and-forward per chunk), plus the per-hop latency. ``length`` may be an
    array of positions (the simulator times a whole chain at once)."""
    c = min(chunk_bytes, M_bytes)
    if math.isinf(rate_bytes_per_s):
        return length * latency_s
    return (M_bytes + (length - 1) * c) / rate_bytes_per_s + length * latency_s


# ---------------------------------------------------------------------------- plan data


@dataclass(frozen=True)
class PlanParams:
    """Everything but the peers that a plan was made with, so ``replan`` can reuse it."""

    uplink_mbit: float | None = None  # learner uplink U; None: unknown / unlimited
    link_mbit: float | None = None  # nominal per-worker rate b; None: median of known downs
    snapshot_bytes: int = 0  # M, for predictions only
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    latency_s: float = 0.0  # per hop
    chains: int | None = None  # force this many chains (tests, experiments)
    extra_chains: bool = True  # try more chains when poor uploaders outnumber tails
    min_gain: float = 0.05  # ... and keep them only if that is this much faster


@dataclass(frozen=True)
class ChainPrediction:
    length: int
    rate_mbit: float | None  # None: unknown (no rates)
    time_s: float | None
    bottleneck: str | None  # "learner" (U/k share), a worker id, or None if unknown


@dataclass
class ChainPlan:
    """Who pulls from whom. ``parent[w] is None`` means w pulls from the learner."""

    chains: list[list[str]]
    parent: dict[str, str | None]
    child: dict[str, str | None]
    predictions: list[ChainPrediction]
    predicted_s: float | None  # slowest chain; None if rates are unknown
    k: int  # the paper's k = max(1, floor(U/b)) (before the unreachable/poor-upload extras)
    link_mbit: float | None  # the b that was used
    params: PlanParams
    peers: dict[str, Peer] = field(repr=False)

    @property
    def streams(self) -> int:
        """Learner streams = chains; learner egress per publication = streams * M."""
        return len(self.chains)

    def sources(self, endpoints: Mapping[str, str], source: str) -> dict[str, str]:
        """``{worker_id: endpoint to pull from}``: the parent's endpoint, or ``source`` (the
        learner) for chain heads. A parent without an endpoint is a planning error."""
        out: dict[str, str] = {}
        for w, p in self.parent.items():
            if p is None:
                out[w] = source
            elif endpoints.get(p):
                out[w] = endpoints[p]
            else:
                raise ValueError(f"worker {p!r} is {w!r}'s parent but has no endpoint")
        return out


def changed_parents(old: ChainPlan, new: ChainPlan) -> set[str]:
    """Workers present in both plans whose parent differs: only they need a new source."""
    return {w for w, p in new.parent.items() if w in old.parent and old.parent[w] != p}


# ---------------------------------------------------------------------------- rates


@dataclass(frozen=True)
class LinkRates:
    down: float  # bytes/s, math.inf when unknown and no b
    up: float
    relay: bool  # may be a parent
    direct: bool = True  # any child can connect to it (else only children that punch)
    needs_direct: bool = False  # cannot punch (symmetric NAT): its parent must be direct

    @property
    def as_relay(self) -> float:
        return min(self.down, self.up)


def nominal_link_mbit(peers: Iterable[Peer]) -> float | None:
    """The default b: median of the known download rates (robust to a few outliers)."""
    downs = [p.down_mbit for p in peers if p.down_mbit > 0]
    return float(statistics.median(downs)) if downs else None


def link_rates(peers: Iterable[Peer], b_mbit: float | None) -> dict[str, LinkRates]:
    default = mbit_to_bytes_per_s(b_mbit) if b_mbit else math.inf
    out: dict[str, LinkRates] = {}
    for p in peers:
        if p.worker_id in out:
            raise ValueError(f"worker {p.worker_id!r} listed twice")
        out[p.worker_id] = LinkRates(
            down=mbit_to_bytes_per_s(p.down_mbit) if p.down_mbit > 0 else default,
            up=mbit_to_bytes_per_s(p.up_mbit) if p.up_mbit > 0 else default,
            relay=p.reachable,
            direct=p.reachable and p.nat == "reachable",
            needs_direct=p.nat == "none",
        )
    return out


def paper_k(uplink_mbit: float | None, b_mbit: float | None, n_workers: int) -> int:
    """k = max(1, floor(U/b)), never more chains than workers; ceil(sqrt(N)) if U or b unknown."""
    if n_workers == 0:
        return 0
    if uplink_mbit and b_mbit and not math.isinf(uplink_mbit):
        k = max(1, math.floor(uplink_mbit / b_mbit + EPS))
    else:
        k = math.ceil(math.sqrt(n_workers))
    return min(k, n_workers)


# ---------------------------------------------------------------------------- chain evaluation


class ChainModel:
    """Rates and parameters for evaluating candidate chains."""

    def __init__(self, rates: dict[str, LinkRates], params: PlanParams):
        self.rates = rates
        self.params = params

    def share(self, streams: int) -> float:
        u = self.params.uplink_mbit
        return mbit_to_bytes_per_s(u) / streams if u and streams else math.inf

    def valid(self, chain: Sequence[str]) -> bool:
        """Every member but the tail relays, and a tail that cannot punch hangs from a
        directly reachable relay (or from the learner)."""
        if not all(self.rates[w].relay for w in chain[:-1]):
            return False
        return (
            len(chain) < 2 or not self.rates[chain[-1]].needs_direct or self.rates[chain[-2]].direct
        )

    def rate(self, chain: Sequence[str], share: float) -> tuple[float, str | None]:
        """(rate, bottleneck): the slowest of the learner share, every download, every upload
        but the tail's."""
        best, who = share, ("learner" if not math.isinf(share) else None)
        for i, w in enumerate(chain):
            r = self.rates[w]
            limit = r.down if i == len(chain) - 1 else r.as_relay
            if limit < best - EPS * max(1.0, limit):
                best, who = limit, w
        return best, who

    def time(self, chain: Sequence[str], share: float) -> float:
        if not chain:
            return 0.0
        if not self.valid(chain):
            return math.inf
        p = self.params
        return predict_chain_s(
            p.snapshot_bytes, p.chunk_bytes, self.rate(chain, share)[0], len(chain), p.latency_s
        )

    def order(self, members: Iterable[str]) -> list[str] | None:
        """Best order for a fresh chain: the tail is the member whose upload hurts most (the
        unreachable one, if any), the rest by relay rate. None if it cannot be valid."""
        members = list(members)
        unreachable = [w for w in members if not self.rates[w].relay]
        if len(unreachable) > 1:
            return None
        if unreachable:
            tail = unreachable[0]
        else:
            tail = self._best_tail(members)
        relays = sorted(
            (w for w in members if w != tail),
            key=lambda w: (-self.rates[w].as_relay, -self.rates[w].up, w),
        )
        if relays and self.rates[tail].needs_direct and not self.rates[relays[-1]].direct:
            direct = [w for w in relays if self.rates[w].direct]
            if not direct:
                return None
            relays.remove(direct[-1])  # the slowest direct relay feeds the tail
            relays.append(direct[-1])
        return relays + [tail]

    def _best_tail(self, members: list[str]) -> str:
        """The tail that gives the fastest chain (the others relay); among equals the worst
        uploader, so a good uploader stays available to relay later."""
        by_relay = sorted(members, key=lambda w: self.rates[w].as_relay)
        lowest = by_relay[0]
        second = self.rates[by_relay[1]].as_relay if len(by_relay) > 1 else math.inf

        def key(w: str) -> tuple[float, float, str]:
            others = second if w == lowest else self.rates[lowest].as_relay
            return (min(others, self.rates[w].down), -self.rates[w].up, w)

        return max(members, key=key)

    def known(self, chain: Sequence[str]) -> bool:
        """Are all rates that bound this chain known (else predictions are None)?"""
        last = len(chain) - 1
        return all(
            math.isfinite(self.rates[w].down) and (i == last or math.isfinite(self.rates[w].up))
            for i, w in enumerate(chain)
        )


def build_plan(
    chains: list[list[str]], model: ChainModel, peers: dict[str, Peer], k: int, b_mbit: float | None
) -> ChainPlan:
    chains = [list(c) for c in chains if c]
    share = model.share(len(chains))
    parent: dict[str, str | None] = {}
    child: dict[str, str | None] = {}
    preds: list[ChainPrediction] = []
    for chain in chains:
        for i, w in enumerate(chain):
            parent[w] = chain[i - 1] if i else None
            child[w] = chain[i + 1] if i + 1 < len(chain) else None
        rate, who = model.rate(chain, share)
        known = model.known(chain)
        preds.append(
            ChainPrediction(
                length=len(chain),
                rate_mbit=rate / BYTES_PER_MBIT if known else None,
                time_s=model.time(chain, share) if known else None,
                bottleneck=who,
            )
        )
    times = [p.time_s for p in preds if p.time_s is not None]
    predicted = max(times) if times and len(times) == len(preds) else None
    if not chains:
        predicted = 0.0
    return ChainPlan(
        chains=chains,
        parent=parent,
        child=child,
        predictions=preds,
        predicted_s=predicted,
        k=k,
        link_mbit=b_mbit,
        params=model.params,
        peers=peers,
    )
