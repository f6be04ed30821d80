"""Staleness is not free (docs/security.md, "Staleness is not free"; issue 31).

A trajectory is admissible while its version is at most ``learner.staleness`` (S) behind the
learner's. Inside that window it is not worth the same: the older the policy that sampled it,
the more the loss's importance weights are truncated and the less it teaches, and it takes a
buffer slot a fresh one could have had. So the provisioner's throughput credit counts an
admitted trajectory ``s`` versions behind as ``credit(s) = 1 - d * s / S`` (``d`` =
``provisioning.staleness_discount``, 0.5: fresh 1, at the edge 0.5). A worker that holds its
groups until the edge (or lags its installs, or claims long generation times) earns half the
credit of a fresh one at the same rate: its unit cost doubles, so it is swapped and released
before an equal fresh worker, and activated after it.

Why every stale trajectory and not only "avoidable" staleness: the learner cannot tell a
holder from a slow link without trusting the worker's own timings (its reported generation
time, its install times), which a holder would report to excuse itself. Charging usefulness
is exact and needs no accusation: an honest worker on a slow link is discounted by exactly
what its data is worth (at most ``d``, never to zero), is never struck, and is still chosen
when the fleet needs its capacity. Nothing here is a verdict; nobody is flagged.

The continuer of a handed-back prefix answers for its own tokens' version only (a record's
newest run), never for the prefix's. Only the control-plane thread writes; views are plain data.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import TypedDict

from echo_rl.data.records import Record


class StalenessView(TypedDict):
    """One worker's staleness books as its row in the stats shows them (``WorkerRow``; the
    step row's names, ``echo_rl.core.steprow``, for the same means)."""

    staleness_mean: float | None
    at_edge: float | None
    credit_per_trajectory: float | None
    gen_s_mean: float | None


WINDOW = 256  # a worker's last admitted trajectories its view is computed over
KEEP = 65536  # workers whose books are kept (least recently delivering dropped)


def credit(staleness: int, bound: int, discount: float) -> float:
    """What one admitted trajectory counts for in its worker's throughput credit."""
    if bound <= 0:
        return 1.0
    return 1.0 - discount * min(max(staleness, 0), bound) / bound


def own_version(r: Record) -> int:
    """The version the sender generated under: its newest run (a continued record's oldest
    tokens are the prefix author's)."""
    return r.versions[-1][0] if r.versions else r.version


@dataclass
class _Window:
    staleness: deque[int] = field(default_factory=lambda: deque(maxlen=WINDOW))
    gen_s: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))


class Staleness:
    def __init__(self, bound: int, discount: float):
        self.bound, self.discount = bound, discount
        self._workers: OrderedDict[str, _Window] = OrderedDict()

    def admitted(self, worker_id: str, recs: list[Record], version: int) -> float:
        """The credit of ``recs`` admitted from this worker at learner ``version``."""
        if not recs:
            return 0.0
        w = self._workers.pop(worker_id, None) or _Window()
        self._workers[worker_id] = w
        while len(self._workers) > KEEP:
            self._workers.popitem(last=False)
        total = 0.0
        for r in recs:
            s = max(0, version - own_version(r))
            w.staleness.append(s)
            w.gen_s.append(r.gen_s)
            total += credit(s, self.bound, self.discount)
        return total

    def view(self, worker_id: str) -> StalenessView:
        """Mean staleness, share at the edge, credit per trajectory and mean generation
        seconds over the worker's last deliveries (None: nothing delivered yet)."""
        w = self._workers.get(worker_id)
        if w is None or not w.staleness:
            return {
                "staleness_mean": None,
                "at_edge": None,
                "credit_per_trajectory": None,
                "gen_s_mean": None,
            }
        n = len(w.staleness)
        # the step row's names: the same means, over this worker's deliveries
        return {
            "staleness_mean": round(sum(w.staleness) / n, 3),
            "at_edge": round(sum(1 for s in w.staleness if s >= self.bound) / n, 3),
            "credit_per_trajectory": round(
                sum(credit(s, self.bound, self.discount) for s in w.staleness) / n, 3
            ),
            "gen_s_mean": round(sum(w.gen_s) / n, 3),
        }
