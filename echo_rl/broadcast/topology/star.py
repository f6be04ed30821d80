"""Star: every worker pulls every chunk straight from the learner."""

from __future__ import annotations

from echo_rl.broadcast.topology.base import Peer, Topology


class StarTopology(Topology):
    def plan(self, peers: list[Peer], source: str) -> dict[str, str]:
        return {p.worker_id: source for p in peers}
