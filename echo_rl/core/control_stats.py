"""The learner server's statistics (``LearnerServer.stats()``), as one declared type: the
trainer copies some into each step row (``echo_rl.core.steprow``), ``echo_rl.core.metrics`` turns the rest into
gauges and the dashboard's tables. Built on the server's loop by ``echo_rl.control.server_stats``;
the names are in docs/observability.md.

The per-worker tables (``workers``, ``reputation``, ``accounts``) stay mappings keyed by worker
id, which the dashboard sends on as they are; a worker's row is declared as ``WorkerRow``, an
account is a ``wire.Account`` dumped.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from types import SimpleNamespace
from typing import Any, TypedDict

from echo_rl.core.jsontypes import JsonObject

Counts = dict[str, int]  # {reason or kind: n}


class WorkerRow(TypedDict, total=False):
    """One worker in ``ControlStats.workers`` (the dashboard's workers table, /metrics' labels):
    built by ``echo_rl.control.server_stats``, with ``echo_rl.control.handbacks``' and ``learner.staleness``'
    views of the worker."""

    price: float  # $/h, as declared
    version: int  # snapshot version it runs (-1: none)
    state: str  # what its heartbeats say (idle, generating, installing, ...)
    active: bool  # active (True) or standby
    reachable: bool  # heartbeats within the timeout
    nat: str  # the reflector's verdict (docs/nat.md)
    transport: str  # how its snapshot link is carried now
    throughput: float  # trajectories/s, measured by the learner (EWMA)
    runs: int  # docs/multirun.md: runs sharing its device
    admitted: int  # its records admitted, so far
    granted: int  # groups handed to it, so far
    returned: int  # groups it returned, so far
    taken_back: int  # groups taken back from it (lease expired, left), so far
    handed_back: int  # echo_rl.control.handbacks: groups it handed back
    prefixes_kept: int
    prefixes_refused: int
    forged: int  # groups whose prefixes failed the check
    limited: int  # groups taken back past a bound
    returns_pct: float | None  # mean reward percentile of the groups it handed back
    returns_n: int
    delivered_pct: float | None  # ... of the groups it delivered
    cherry_pick: str  # "low" | "high": it returns the groups it does not like; "" otherwise
    staleness_mean: float | None  # learner.staleness: versions, over its last deliveries
    at_edge: float | None  # share of those at the staleness bound
    credit_per_trajectory: float | None
    gen_s_mean: float | None  # s: mean busy time of its batches


@dataclass
class ControlStats:
    """One snapshot of the server's numbers. Counters marked "so far" are cumulative."""

    active_workers: int = 0  # live active workers now
    standby_workers: int = 0  # live standby workers now
    fleet_price_per_hour: float = 0.0  # $/h: sum of the active workers' prices
    worker_rate_mean: float = 0.0  # trajectories/s per busy second, as active workers report
    worker_busy_rate: float = 0.0  # trajectories per busy second, measured over the run
    rejected: Counts = field(default_factory=dict)  # records/frames refused by reason, so far
    handbacks: dict[str, Any] = field(default_factory=dict)  # returned work (docs/preemption.md)
    # expensive rewards recomputed off the step (echo_rl.control.reward_audit); empty when inline
    reward_audit: dict[str, float] = field(default_factory=dict)
    affinity: dict[str, int] = field(default_factory=dict)  # learner.affinity; empty when off
    join_refused: Counts = field(default_factory=dict)  # joins/connections refused by reason
    limited: Counts = field(default_factory=dict)  # messages refused (rate limit, ban) by reason
    chunk_rejected: Counts = field(default_factory=dict)  # learner chunk requests refused
    chunk_parked: int = 0  # chunk requests waiting for a sending slot now
    relay_reports: Counts = field(default_factory=dict)  # relay reports by "reason:outcome"
    relays_marked: int = 0  # relays kept out of plans now
    # workers (one per witness) whose fetches from the learner's own snapshot port failed in the
    # last 30 s, and what the learner says of it ("": nothing; echo_rl/control/snapshot_path.py)
    snapshot_path_reporters: int = 0
    snapshot_path: str = ""
    sessions: int = 0  # open sessions now
    pending_workers: int = 0  # joined keys not yet members (docs/security.md, "Sybils")
    notices: Counts = field(default_factory=dict)  # snapshot notices: sent / left to heartbeats
    learner_bytes_sent: int = 0  # bytes of snapshots the learner served, so far
    ack_queue: int = 0  # acknowledgements waiting for the write-ahead log's fsync now
    decode_s: float | None = None  # s: median time workers took to rebuild the newest delta
    keyframes: int = 0  # installs that needed a keyframe, so far
    t_bcast: float | None = None  # s: broadcast time of the latest measured publication
    in_flight_groups: int = 0  # groups handed out and not yet returned
    restored_leases: int = 0  # leases kept across a restart (echo_rl.control.grants)
    restored_admitted: int = 0  # records admitted under them
    reissued_groups: int = 0  # groups handed out again after a lease expired, so far
    installs: dict[int, dict[str, float]] = field(default_factory=dict)  # {version: {worker: s}}
    workers: dict[str, WorkerRow] = field(default_factory=dict)  # {worker: its row}
    reputation: dict[str, dict[str, Any]] = field(default_factory=dict)  # {worker: checks}
    checks: Counts = field(default_factory=dict)  # checks by "check:outcome", so far
    # echo_rl.control.accounts' books
    accounts: dict[str, JsonObject] = field(default_factory=dict)  # {worker: Account dumped}
    control_cpu: dict[str, Any] = field(default_factory=dict)  # s of loop CPU by kind, so far
    slow: Counts = field(default_factory=dict)  # calls the loop did not answer in time

    @classmethod
    def from_json(cls, doc: JsonObject) -> ControlStats:
        """From a mapping (a recorded row's numbers, a test's): missing fields keep their
        defaults, unknown keys are ignored (nothing writes them back). Tolerant, not a
        validator: a field takes the value as read."""
        stats = cls()
        for k, v in doc.items():
            if k in _NAMES:
                setattr(stats, k, v)
        return stats


# The statistics' names as constants, like the step row's COL (a gauge names its field).
STAT = SimpleNamespace(**{f.name: f.name for f in fields(ControlStats)})
_NAMES = frozenset(f.name for f in fields(ControlStats))


def as_stats(stats: ControlStats | JsonObject | None) -> ControlStats:
    """Statistics given either way (None: none yet)."""
    if isinstance(stats, ControlStats):
        return stats
    return ControlStats.from_json(stats or {})
