"""Link rates measured at both ends of every snapshot link, not declared (docs/security.md).

A worker's ``--down-mbit`` / ``--up-mbit`` is a claim; the chain planner used to believe it, so a
worker declaring 10x its real uplink became a chain head and slowed its whole chain. Now every
worker reports, with each install (``wire.Installed``), what it measured for that version:

* ``down_mbit``: bytes it received / seconds its fetch took (``echo_rl.broadcast.fetch.FetchStats``);
* ``up_mbit``: bytes its chunk server sent / seconds a reply was waiting to go out
  (``echo_rl.broadcast.source.ChunkServer.upload_mbit``), i.e. its upload while it had something to send.

``LinkMeter`` combines both ends of a link parent -> child of that version's plan::

    r = min(parent's up_mbit, child's down_mbit)     (the learner as parent: child's alone)

so neither end can raise the link above what the other reports. Then, with ``D_p`` the parent's
own download rate for that version (for the learner: its per-chain share of U, if known):

* ``r >= starved * D_p``: the child went as fast as its parent received (starved upstream): the
  link proved only that both ends are *at least* ``r`` (a floor; it raises, never lowers).
* else the link was the bottleneck, and one end is to blame. The end with other evidence of
  being faster (its estimate or floor >= ``r / starved``) is cleared (floored at ``r``) and the
  other end is measured at ``r`` (EWMA, ``alpha``; the first measurement replaces the claim).
  With no evidence either way the *parent's uplink* is measured: a relay's place in a chain is
  earned by its uplink, and an uplink claim is what a liar inflates. With evidence for both
  (one of them changed), both are measured.

A parent that lies about its download to look starved lowers its own measured download instead,
and the planner rates a relay by ``min(down, up)``: either way a liar's relay rate ends up near
what its honest child measured. A child can *lower* its parent's estimate by under-reporting
(the planner then moves that parent down a chain until another child measures it again): the
harm is bounded to a slower plan, never a liar at a head.

Until a worker has been measured, its declared rates are capped at the fleet's median measured
rate in that direction (before any measurement: the median declared rate), so a declaration
alone cannot lift it above the typical worker. Reports are sanitised: non-finite or negative
values count as "not measured", values are clamped to ``MAX_MBIT``, and only the first report
per worker and version counts.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from dataclasses import dataclass

from echo_rl.core.ewma import ewma

MAX_MBIT = 100_000.0  # 100 Gbit/s: no report above this is believed
KEEP_VERSIONS = 4  # reports kept per version while links are still being combined


@dataclass
class _Report:
    down: float  # Mbit/s, 0 = not measured
    up: float


def clean(value: float) -> float:
    """A reported rate as a number the planner can use: 0 if absent or absurd, else clamped."""
    if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        return 0.0
    return min(float(value), MAX_MBIT)


class LinkMeter:
    def __init__(self, alpha: float = 0.5, starved: float = 0.9):
        self.alpha = alpha  # EWMA weight of a new link-limited measurement
        self.starved = starved  # r >= starved * D_p: the child was starved upstream
        self.down: dict[str, float] = {}  # measured Mbit/s per worker (absent: unmeasured)
        self.up: dict[str, float] = {}
        self.down_floor: dict[str, float] = {}  # proved at least this fast (unmeasured ones)
        self.up_floor: dict[str, float] = {}
        self._reports: dict[int, dict[str, _Report]] = {}
        self._done: dict[int, set[str]] = {}  # version -> children whose inbound link counted

    # ------------------------------------------------------------------ reports

    def report(
        self,
        version: int,
        worker: str,
        down_mbit: float,
        up_mbit: float,
        plan: Mapping[str, str | None],
        root_mbit: float = math.inf,
    ) -> bool:
        """One worker's measurements for ``version``. ``plan``: worker -> its parent's worker
        id in that version's plan (None: the learner). False if ignored (a repeat)."""
        reports = self._reports.setdefault(version, {})
        if worker in reports:
            return False
        reports[worker] = _Report(clean(down_mbit), clean(up_mbit))
        for old in sorted(self._reports)[:-KEEP_VERSIONS]:
            self._reports.pop(old, None)
            self._done.pop(old, None)
        self._try(version, plan.get(worker), worker, root_mbit)
        for child in [c for c, p in plan.items() if p == worker]:
            self._try(version, worker, child, root_mbit)
        return True

    def _try(self, version: int, parent: str | None, child: str, root_mbit: float) -> None:
        reports = self._reports.get(version, {})
        done = self._done.setdefault(version, set())
        if child in done or child not in reports or (parent is not None and parent not in reports):
            return
        done.add(child)
        r = reports[child].down
        if parent is not None and reports[parent].up > 0:
            r = min(r, reports[parent].up) if r > 0 else 0.0
        if r <= 0:
            return
        d_p = root_mbit if parent is None else (reports[parent].down or math.inf)
        if r >= self.starved * d_p:  # starved upstream: a floor for both ends
            self._floor(self.down, self.down_floor, child, r)
            if parent is not None:
                self._floor(self.up, self.up_floor, parent, r)
            return
        child_fast = self._known(self.down, self.down_floor, child) >= r / self.starved
        if parent is None:  # the learner is trusted: the child's link it is
            self._measure(self.down, child, r)
            return
        parent_fast = self._known(self.up, self.up_floor, parent) >= r / self.starved
        if parent_fast and not child_fast:
            self._measure(self.down, child, r)
            self._floor(self.up, self.up_floor, parent, r)
        elif child_fast and not parent_fast or not (child_fast or parent_fast):
            self._measure(self.up, parent, r)
            self._floor(self.down, self.down_floor, child, r)
        else:  # both were faster before: one of them changed, measure both
            self._measure(self.up, parent, r)
            self._measure(self.down, child, r)

    @staticmethod
    def _known(est: dict[str, float], floor: dict[str, float], worker: str) -> float:
        return est.get(worker, floor.get(worker, 0.0))

    def _measure(self, est: dict[str, float], worker: str, r: float) -> None:
        est[worker] = ewma(est.get(worker), r, self.alpha)

    @staticmethod
    def _floor(est: dict[str, float], floor: dict[str, float], worker: str, r: float) -> None:
        if worker in est:
            est[worker] = max(est[worker], r)
        else:
            floor[worker] = max(floor.get(worker, 0.0), r)

    def forget(self, worker: str) -> None:
        for est in (self.down, self.up, self.down_floor, self.up_floor):
            est.pop(worker, None)

    # ------------------------------------------------------------------ planner input

    def rates(self, declared: Mapping[str, tuple[float, float]]) -> dict[str, tuple[float, float]]:
        """(down, up) Mbit/s per worker for the planner: measured where measured, else the
        declared rate capped at the median measured one, raised to any proved floor (a
        declared 0 stays 'unknown' unless a floor is known)."""
        out: dict[str, list[float]] = {w: [0.0, 0.0] for w in declared}
        for i, (est, floor) in enumerate(((self.down, self.down_floor), (self.up, self.up_floor))):
            known = list(est.values()) + list(floor.values())
            cap = _median(known or [rates[i] for rates in declared.values() if rates[i] > 0])
            for w, rates in declared.items():
                out[w][i] = est[w] if w in est else max(floor.get(w, 0.0), min(rates[i], cap))
        return {w: (d, u) for w, (d, u) in out.items()}

    def measured(self, worker: str) -> bool:
        return worker in self.down or worker in self.up


def _median(values: list[float]) -> float:
    return float(statistics.median(values)) if values else math.inf
