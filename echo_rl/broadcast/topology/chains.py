"""Chains: the learner feeds k chains of workers; each worker pulls from its predecessor.

Thin adapter from ``Topology.plan(peers, source)`` to ``echo_rl.broadcast.planner``. A peer without an
``endpoint`` serves no chunks, so it is planned as if unreachable (a chain tail, never a parent):
with no endpoints at all this degrades to a star. The previous plan is kept and re-planned
(``planner.replan``) so edges stay put across publications while workers come and go.
"""

from __future__ import annotations

from dataclasses import replace

from echo_rl.broadcast.planner import DEFAULT_CHUNK_BYTES, ChainPlan, PlanParams, plan_with, replan
from echo_rl.broadcast.topology.base import Peer, Topology


class ChainsTopology(Topology):
    def __init__(
        self,
        uplink_mbit: float | None = None,
        link_mbit: float | None = None,
        *,
        chains: int | None = None,
        snapshot_bytes: int = 0,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        latency_s: float = 0.0,
        extra_chains: bool = True,
        tolerance: float = 0.1,
    ):
        self.params = PlanParams(
            uplink_mbit=uplink_mbit,
            link_mbit=link_mbit,
            snapshot_bytes=snapshot_bytes,
            chunk_bytes=chunk_bytes,
            latency_s=latency_s,
            chains=chains,
            extra_chains=extra_chains,
        )
        self.tolerance = tolerance
        self.last_plan: ChainPlan | None = None  # predictions for the learner's logs

    @classmethod
    def from_params(
        cls, *, uplink_mbit: float | None, link_mbit: float | None, chunk_bytes: int
    ) -> ChainsTopology:
        return cls(
            uplink_mbit=uplink_mbit or None, link_mbit=link_mbit or None, chunk_bytes=chunk_bytes
        )

    def plan(
        self,
        peers: list[Peer],
        source: str,
        *,
        uplink_mbit: float | None = None,
        snapshot_bytes: int | None = None,
    ) -> dict[str, str]:
        """``uplink_mbit`` / ``snapshot_bytes`` override the constructor's for this and later
        plans (the learner may only learn M once it has a snapshot)."""
        if uplink_mbit is not None:
            self.params = replace(self.params, uplink_mbit=uplink_mbit)
        if snapshot_bytes is not None:
            self.params = replace(self.params, snapshot_bytes=snapshot_bytes)
        planned = [p if p.endpoint else replace(p, reachable=False) for p in peers]
        if self.last_plan is None:
            result = plan_with(planned, self.params)
        else:
            result = replan(self.last_plan, planned, params=self.params, tolerance=self.tolerance)
        self.last_plan = result
        return result.sources({p.worker_id: p.endpoint for p in peers}, source)


__all__ = ["ChainsTopology"]
