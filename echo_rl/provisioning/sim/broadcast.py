"""The simulator's broadcast model: per-publication arrival times from ``echo_rl.broadcast.planner``
(docs/simulator.md, "The model"). Used by ``echo_rl.provisioning.sim``."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from echo_rl.broadcast import planner
from echo_rl.broadcast.topology.base import Peer
from echo_rl.provisioning.sim.population import Pool
from echo_rl.provisioning.sim.scenario import Scenario


@dataclass
class BcastPlan:
    """Per-recipient arrival offsets (seconds after publication, before reload) and context."""

    idx: np.ndarray  # recipients (worker indices)
    offsets: np.ndarray  # aligned with idx
    chains: list[np.ndarray] | None  # worker indices per chain, head first (chains only)
    predicted_s: float  # slowest recipient (planner's / star formula's prediction)
    lower_bound_s: float | None
    streams: int  # learner streams
    egress_bytes: float  # what the learner sends
    mode: str  # "planner", "binned", "star", "star-unlimited", "fixed"


class BroadcastModel:
    """Turns a recipient set into per-worker arrival times with ``echo_rl.broadcast.planner``."""

    def __init__(self, sc: Scenario, pool: Pool):
        self.b = sc.broadcast
        self.pool = pool
        self.M = float(self.b.snapshot_bytes)
        self.c = self.b.chunk_bytes
        self.lat = self.b.latency_ms / 1000.0
        self._cache: dict[bytes, BcastPlan] = {}
        self.plan_wall_s = 0.0

    def pull_s(self, i: int) -> float:
        """Pull-on-join: a late joiner fetches the whole snapshot from one peer at its own rate
        (topology "fixed": the replayed install time, like every other install)."""
        if self.b.topology == "fixed":
            return self.b.fixed_s
        return float(planner.star_unlimited_s(self.M, self.pool.down[i])) + self.lat

    def plan(self, idx: np.ndarray) -> BcastPlan:
        idx = np.asarray(idx, dtype=np.int64)
        key = idx.tobytes()
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        t0 = time.perf_counter()
        out = self._plan(idx)
        self.plan_wall_s += time.perf_counter() - t0
        if len(self._cache) > 64:
            self._cache.clear()
        self._cache[key] = out
        return out

    def _lower_bound(self, idx: np.ndarray) -> float | None:
        if not len(idx) or not self.b.uplink_mbit:
            return None
        return planner.lower_bound_s(
            self.M, self.b.uplink_mbit, self.pool.down[idx].tolist(), self.pool.up[idx].tolist()
        )

    def _plan(self, idx: np.ndarray) -> BcastPlan:
        n, b, M = len(idx), self.b, self.M
        lb = self._lower_bound(idx)
        if n == 0:
            return BcastPlan(idx, np.zeros(0), None, 0.0, lb, 0, 0.0, b.topology)
        if b.topology == "fixed":
            off = np.full(n, b.fixed_s)
            return BcastPlan(idx, off, None, b.fixed_s, lb, n, n * M, "fixed")
        down = self.pool.down[idx]
        if b.topology == "star-unlimited":
            off = np.asarray(planner.star_unlimited_s(M, down), dtype=float) + self.lat
            return BcastPlan(idx, off, None, float(off.max()), lb, n, n * M, "star-unlimited")
        if b.topology == "star":
            U = b.uplink_mbit
            assert U is not None  # the scenario's check: star needs the learner's uplink
            uniq, inv = np.unique(down, return_inverse=True)
            per = np.array([planner.star_limited_s(M, float(d), U, n) for d in uniq])
            off = per[inv] + self.lat
            return BcastPlan(idx, off, None, float(off.max()), lb, n, n * M, "star")
        return self._chains(idx, lb)

    def _chains(self, idx: np.ndarray, lb: float | None) -> BcastPlan:
        pool, b = self.pool, self.b
        binned = len(idx) > b.plan_max_peers
        members: dict[str, np.ndarray] = {}
        if not binned:
            peers = [
                Peer(pool.ids[i], float(pool.down[i]), float(pool.up[i]), bool(pool.reachable[i]))
                for i in idx
            ]
            for i in idx:
                members[pool.ids[i]] = np.array([i])
        else:
            peers = self._binned_peers(idx, members)
        plan = planner.plan_chains(
            peers,
            uplink_mbit=b.uplink_mbit,
            snapshot_bytes=int(self.M),
            chunk_bytes=self.c,
            latency_s=self.lat,
            extra_chains=b.extra_chains,
        )
        pos_of = {int(w): j for j, w in enumerate(idx)}
        off = np.zeros(len(idx))
        chains = []
        for chain, pred in zip(plan.chains, plan.predictions):
            workers = np.concatenate([members[w] for w in chain])
            assert pred.rate_mbit is not None  # every simulated peer has its rates
            rate = planner.mbit_to_bytes_per_s(pred.rate_mbit)
            positions = np.arange(1, len(workers) + 1)
            t = planner.predict_chain_s(self.M, self.c, rate, positions, self.lat)
            off[[pos_of[int(w)] for w in workers]] = t
            chains.append(workers)
        return BcastPlan(
            idx,
            off,
            chains,
            float(off.max()),
            lb,
            plan.streams,
            plan.streams * self.M,
            "binned" if binned else "planner",
        )

    def _binned_peers(self, idx: np.ndarray, members: dict[str, np.ndarray]) -> list[Peer]:
        pool = self.pool
        reach = pool.reachable[idx]
        unreachable, relays = idx[~reach], idx[reach]
        peers = [
            Peer(pool.ids[i], float(pool.down[i]), float(pool.up[i]), False) for i in unreachable
        ]
        for i in unreachable:
            members[pool.ids[i]] = np.array([i])
        if len(relays):
            relay_rate = np.minimum(pool.down[relays], pool.up[relays])
            order = relays[np.lexsort((-pool.down[relays], -relay_rate))]
            blocks = max(1, min(len(order), self.b.plan_max_peers - len(unreachable)))
            for j, block in enumerate(np.array_split(order, blocks)):
                wid = f"#block{j}"
                members[wid] = block
                peers.append(
                    Peer(wid, float(pool.down[block].min()), float(pool.up[block].min()), True)
                )
        return peers


# ============================================================================ results
