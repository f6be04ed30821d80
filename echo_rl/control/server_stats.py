"""The learner server's statistics for the trainer's metrics row, the dashboard and /metrics
(names and labels: docs/observability.md). Built on the server's loop, from the objects that
own each number; nothing here changes them.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from typing import NamedTuple

from echo_rl.broadcast.source import ChunkServer
from echo_rl.control.accounts import Accounts
from echo_rl.control.cpu import CpuBook
from echo_rl.control.gate import Gate
from echo_rl.control.handbacks import Handbacks
from echo_rl.control.intake import Intake
from echo_rl.control.members import Members
from echo_rl.control.reputation import Reputation
from echo_rl.control.routes import SnapshotRoutes
from echo_rl.control.sessions import SessionTable
from echo_rl.control.staleness import Staleness
from echo_rl.control.work import WorkQueue
from echo_rl.core.control_stats import ControlStats, WorkerRow
from echo_rl.core.jsontypes import JsonObject
from echo_rl.data.buffer import ReplayBuffer

# The per-worker tables in the stats (dashboard rows, /metrics labels) of a fleet larger than
# PER_WORKER_FRESH_UP_TO are rebuilt at most every PER_WORKER_EVERY_S: each costs the loop time
# in proportion to the fleet, and stats are asked for at every step (docs/scale.md).
PER_WORKER_EVERY_S = 2.0
PER_WORKER_FRESH_UP_TO = 256


@dataclass
class StatSources:
    """Every object a stats row reads (each owns its numbers; the row only copies them)."""

    table: SessionTable
    members: Members
    routes: SnapshotRoutes
    gate: Gate
    buffer: ReplayBuffer
    work: WorkQueue
    intake: Intake
    returns: Handbacks
    reputation: Reputation
    staleness: Staleness
    accounts: Accounts
    cpu: CpuBook
    rejected: Counter[str]  # the server's refusals by reason
    noticed: Counter[str]  # snapshot notices sent / deferred to heartbeats


class ServerStats:
    def __init__(self, src: StatSources):
        self.src = src
        self.chunks: ChunkServer | None = None  # the learner's chunk socket, once bound
        self._per_worker_cache: tuple[float, PerWorker] | None = None  # (built at, tables)

    def row(self, ack_queue: int) -> ControlStats:
        """The whole statistics row, with the loop's CPU per kind of work."""
        cpu = self.src.cpu
        t0 = time.thread_time()
        out = self.now(ack_queue)
        cpu.add("stats", time.thread_time() - t0)
        out.control_cpu = dict(cpu.snapshot())
        return out

    def now(self, ack_queue: int) -> ControlStats:
        s = self.src
        now = time.monotonic()
        live = [w for w in s.table.workers.values() if s.table.live(w, now)]
        active = [w for w in live if s.members.is_active(w.worker_id)]
        busy_s = sum(w.busy_s for w in active)
        out = ControlStats(
            active_workers=len(active),
            standby_workers=len(live) - len(active),
            fleet_price_per_hour=sum(w.price for w in active),
            # what the active workers report they generate per busy second (heartbeats)
            worker_rate_mean=(
                sum(w.claimed_throughput for w in active) / len(active) if active else 0.0
            ),
            # whole-run average busy-time rate per active worker
            worker_busy_rate=(
                sum(w.busy_samples for w in active) / busy_s if active and busy_s > 0 else 0.0
            ),
            rejected=dict(s.rejected + s.buffer.stats.rejected),
            handbacks={
                **s.returns.counts,
                "continued_samples": s.intake.continued,
                "held": len(s.work.held),
            },
            reward_audit=s.intake.reward_audit.stats() if s.intake.reward_audit else {},
            affinity=_affinity(s.work),
            sessions=len(s.table.sessions),
            # docs/security.md, "Sybils": joined keys not yet members, notices sent and left
            # to heartbeat replies
            pending_workers=sum(not w.member for w in s.table.workers.values()),
            notices=dict(s.noticed),
            ack_queue=ack_queue,
            in_flight_groups=s.work.in_flight,
            # echo_rl.control.grants: leases kept across a restart, and what was admitted under them
            restored_leases=len(s.work.restored),
            restored_admitted=s.intake.restored_admitted,
            reissued_groups=s.work.reissued,
        )
        self._door(out)
        self._snapshots(out)
        self.per_worker(out, now)
        return out

    def _door(self, out: ControlStats) -> None:
        """docs/security.md: refused joins and connections, rate-limited or banned messages,
        refused chunk requests (this socket's), by reason."""
        s = self.src
        out.join_refused, out.limited = dict(s.gate.refused), dict(s.gate.limited)
        out.chunk_rejected = dict(self.chunks.rejected) if self.chunks else {}
        out.chunk_parked = self.chunks.parked if self.chunks else 0

    def _snapshots(self, out: ControlStats) -> None:
        """What publication and installs cost: bytes served, installs, relay reports."""
        s = self.src
        co = s.routes.coordinator
        # echo_rl.broadcast.reports: relay reports by "reason:outcome", the learner's probes by
        # outcome, and the relays kept out now (docs/security.md, "Relay reports")
        out.relay_reports = dict(co.reports.counts) if co else {}
        out.relays_marked = len(co.reports.marks) if co else 0
        out.snapshot_path = s.routes.path.verdict(len(s.table.workers)) or ""
        out.snapshot_path_reporters = len(s.routes.path.reporters()) if out.snapshot_path else 0
        out.learner_bytes_sent = s.routes.store.bytes_sent
        out.decode_s, out.keyframes = s.routes.install_stats()
        out.t_bcast = s.routes.last_t_bcast()
        out.installs = {v: co.install_times(v) for v in sorted(co.published)[-20:]} if co else {}

    def per_worker(self, out: ControlStats, now: float) -> None:
        """The per-worker tables (the dashboard's and /metrics' rows); for a large fleet,
        rebuilt at most every PER_WORKER_EVERY_S (docs/scale.md)."""
        s = self.src
        cached = self._per_worker_cache
        if not (
            cached
            and len(s.table.workers) > PER_WORKER_FRESH_UP_TO
            and now - cached[0] < PER_WORKER_EVERY_S
        ):
            cached = self._per_worker_cache = (now, self._tables(now))
        out.workers, out.reputation, out.checks, out.accounts = cached[1]

    def _tables(self, now: float) -> PerWorker:
        s = self.src
        co = s.routes.coordinator
        workers: dict[str, WorkerRow] = {
            w.worker_id: {
                "price": w.price,
                "version": w.version,
                "state": w.state,
                "active": s.members.is_active(w.worker_id),
                "reachable": s.table.live(w, now),
                # docs/nat.md: the reflector's verdict, and how its snapshot link is carried now
                "nat": w.nat,
                "transport": co.transport(w.worker_id) if co else "tcp",
                "throughput": round(w.measured_throughput, 3),
                "runs": w.runs,  # docs/multirun.md: a device shared with other runs
                "admitted": w.admitted,
                "granted": s.work.granted[w.worker_id],
                "returned": s.work.returned[w.worker_id],
                "taken_back": s.work.taken_back[w.worker_id],
                # echo_rl.control.handbacks, learner.staleness
                **s.returns.per_worker(w.worker_id),
                **s.staleness.view(w.worker_id),
            }
            for w in s.table.workers.values()
        }
        # per worker id, quarantined ones included: checks made, failed, quarantined; and
        # echo_rl.control.accounts: each worker's books, departed ones included (bounded)
        return PerWorker(
            workers, s.reputation.per_worker(), dict(s.reputation.by_check), s.accounts.export()
        )


class PerWorker(NamedTuple):
    """The per-worker tables of a ControlStats, rebuilt together."""

    workers: dict[str, WorkerRow]
    reputation: dict[str, dict[str, int]]
    checks: dict[str, int]
    accounts: dict[str, JsonObject]


def _affinity(work: WorkQueue) -> dict[str, int]:
    """learner.affinity's counts (docs/scheduling.md, "Affinity"); empty when off."""
    if work.affinity is None:
        return {}
    return {
        "routed": work.picker.routed,
        "aged": work.picker.aged,
        "prompts_known": len(work.affinity.book),
        "window": work.picker.depth(),
    }
