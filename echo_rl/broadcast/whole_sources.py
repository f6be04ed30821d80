"""Where a worker fetches a whole payload from: a version's rebuilt (full) payload when it lacks
the base of a delta (a keyframe), or the run's base model (a LoRA run). A live, reachable peer
that holds it and has been sent the fewest such fetches (spreading them off the chains' heads),
else the root; a peer a fetch failed at is not asked again.

Reads the coordinator's live peers and its relay reports; owns the fetch counts and failures.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from echo_rl.broadcast.nat.links import plain
from echo_rl.broadcast.reports import ReportBook

if TYPE_CHECKING:
    from echo_rl.broadcast.coordinator import PeerState

KEEP = 4  # versions back a failed keyframe fetch is remembered


class WholeSources:
    def __init__(self, peers: dict[str, PeerState], reports: ReportBook, root: str):
        self.peers, self.reports, self.root = peers, reports, root
        self.served: dict[str, int] = {}  # endpoint -> whole-payload fetches sent there
        # (endpoint, version) a keyframe fetch failed at: that peer is not asked again for it
        # (a worker that reported an install it cannot serve, or that went away)
        self.keyframe_failed: set[tuple[str, int]] = set()
        self.base_failed: set[str] = set()  # endpoints a base fetch failed at: not asked again

    def keyframe(self, worker_id: str, version: int, bad_source: str, newest: int) -> str:
        """For ``version``'s full payload: a peer that installed it."""
        if bad_source:
            self.keyframe_failed.add((bad_source, version))
            self.keyframe_failed = {(e, v) for e, v in self.keyframe_failed if v > newest - KEEP}
        return self._least_served(
            worker_id,
            lambda p: version in p.installed and (p.endpoint, version) not in self.keyframe_failed,
        )

    def base(self, worker_id: str, bad_source: str = "") -> str:
        """For the base model: a peer that holds it whole (it says so in its heartbeats)."""
        if bad_source:
            self.base_failed.add(plain(bad_source))
        return self._least_served(
            worker_id, lambda p: p.base and p.endpoint not in self.base_failed
        )

    def forget(self, endpoint: str) -> None:
        """A peer left: its counts go (bounded by the live peers)."""
        self.served.pop(endpoint, None)
        self.base_failed.discard(endpoint)

    def _least_served(self, worker_id: str, holds: Callable[[PeerState], bool]) -> str:
        avoided = self.reports.avoided(worker_id, time.monotonic())  # relays it reported
        held = [
            p.endpoint
            for p in self.peers.values()
            if p.alive
            and p.endpoint
            and not p.corrupt
            and p.nat == "reachable"
            and holds(p)
            and p.endpoint not in avoided
            and p.worker_id != worker_id
        ]
        best = min(held, key=lambda ep: self.served.get(ep, 0), default=self.root)
        self.served[best] = self.served.get(best, 0) + 1
        return best
