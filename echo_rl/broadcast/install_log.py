"""When each snapshot version was published and installed, and ``T_bcast``: the coordinator's
clock of the broadcast. Also where a joiner fetches from (a peer that installed the version).

Reads the coordinator's live peers (``PeerState``, each holding its install times) and its
relay reports; owns the publication times and the holders of recent versions.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

from echo_rl.broadcast.reports import ReportBook

if TYPE_CHECKING:
    from echo_rl.broadcast.coordinator import PeerState

KEEP = 4  # recent versions whose holders are remembered (``joiner_source``)


def quantile_rank(q: float, n: int) -> int:
    """How many of ``n`` installs ``T_bcast`` at quantile ``q`` waits for: ceil(q * n), at least
    1, with float noise ignored (0.9 * 10 is 9.000000000000002 and means 9). The one rule for
    the learner, the broadcast benchmark and the simulator (echo_rl/provisioning/sim/)."""
    return max(1, math.ceil(q * n - 1e-9))


class InstallLog:
    def __init__(self, peers: dict[str, PeerState], reports: ReportBook, root: str, q: float):
        self.peers, self.reports, self.root, self.q = peers, reports, root, q
        self.published: dict[int, float] = {}  # version -> monotonic publication time
        self._holders: dict[int, list[str]] = {}  # version -> relays that installed it, in order
        self._turn = 0  # round robin over them (``joiner_source``)

    def publish(self, version: int, now: float | None = None) -> None:
        self.published[version] = time.monotonic() if now is None else now

    def installed(self, worker_id: str, version: int, now: float | None = None) -> float | None:
        t0 = self.published.get(version)
        peer = self.peers.get(worker_id)
        if t0 is None or peer is None:
            return None
        dt = (time.monotonic() if now is None else now) - t0
        if version not in peer.installed and peer.endpoint:
            held = self._holders.setdefault(version, [])
            held.append(worker_id)
            for old in sorted(self._holders)[:-KEEP]:
                del self._holders[old]
        peer.installed.setdefault(version, dt)
        return dt

    def joiner_source(self, worker_id: str, version: int, tries: int = 8) -> str:
        """A peer that installed ``version`` for a worker the plan has not placed yet (a
        joiner pulls from a peer, not the learner: its egress is the cost), round robin over
        the holders, in O(1): a join must not cost O(fleet). The learner when none fits."""
        held = self._holders.get(version, [])
        avoided = self.reports.avoided(worker_id, time.monotonic())
        for _ in range(min(tries, len(held))):
            self._turn += 1
            p = self.peers.get(held[self._turn % len(held)])
            if (
                p is not None
                and p.worker_id != worker_id
                and p.alive
                and not p.corrupt
                and p.nat == "reachable"
                and p.endpoint not in avoided
            ):
                return p.endpoint
        return self.root

    def install_times(self, version: int) -> dict[str, float]:
        return {
            p.worker_id: p.installed[version] for p in self.peers.values() if version in p.installed
        }

    def t_bcast(self, version: int, q: float | None = None) -> float | None:
        """Seconds from publication until a fraction q of the live workers installed it.
        Only workers that had joined when it was published count: one that joined later (the
        fleet starting up, a late joiner loading its model) measures its own start-up, not the
        broadcast, and a start-up of 29 s would pass for a 29 s broadcast. None when no worker
        was there to receive it."""
        q = self.q if q is None else q
        t0 = self.published.get(version)
        live = [p for p in self.peers.values() if p.alive and (t0 is None or p.joined <= t0)]
        times = sorted(p.installed[version] for p in live if version in p.installed)
        need = quantile_rank(q, len(live))
        return times[need - 1] if len(times) >= need else None
