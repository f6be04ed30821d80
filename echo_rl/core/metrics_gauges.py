"""The learner's Prometheus gauges, one group per source of numbers: the step row
(``StepGauges``), the control plane's stats (``FleetGauges``), the workers' books
(``AccountGauges``) and the install timeline (``InstallGauges``). Each group owns its gauges
and what it remembers between updates; ``echo_rl.core.metrics.LearnerMetrics`` composes them on one
registry and holds the lock. The names are documented in docs/observability.md.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Mapping
from typing import SupportsFloat, SupportsIndex

from prometheus_client import CollectorRegistry, Gauge, Histogram

from echo_rl.core.control_stats import STAT, ControlStats
from echo_rl.core.jsontypes import JsonObject
from echo_rl.core.steprow import COL, StepRow

STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 16)
KEEP_VERSIONS = 20  # broadcast gauges/timeline keep this many recent versions

# Row fields sent to the dashboard (the rest stay in metrics.jsonl), in the order its rows
# have always had; each dashboard row adds ``cost_usd``, the running cost (DASHBOARD_COST).
ROW_FIELDS = (
    COL.step,
    COL.version,
    COL.reward_mean,
    COL.staleness_max,
    COL.staleness_mean,
    COL.t_train,
    COL.t_wait,
    COL.bubble_ratio,
    COL.admitted,
    COL.cost_step_usd,
    COL.active_workers,
    COL.standby_workers,
    COL.t_bcast,
    COL.wall_s,
    COL.publish_encoding,
    COL.publish_bytes,
    COL.publish_full_bytes,
    COL.delta_ratio,
    COL.encode_s,
    COL.decode_s,
    COL.heldout_step,
    COL.heldout_mean,
    COL.heldout_lo,
    COL.heldout_hi,
    COL.best_step,
    COL.collapse,
    COL.completions_cut,
    COL.episode_stats,
)
DASHBOARD_COST = "cost_usd"  # a dashboard row's running cost, fleet and learner, $


def num(x: object) -> float | None:
    """A finite float, else None (the metric keeps its last value: one NaN must not stick in
    a running total such as the cost). ``x``: anything float() takes (a number, a numeric
    string, a numpy scalar); anything else is None too."""
    if not isinstance(x, (float, int, str, bytes, bytearray, SupportsFloat, SupportsIndex)):
        return None  # None, a dict, a list: float() would raise TypeError
    try:
        v = float(x)
    except (TypeError, ValueError, OverflowError):
        return None
    return v if math.isfinite(v) else None


def _set_from(pairs: tuple[tuple[Gauge, str], ...], source: object) -> None:
    """Each gauge to its field's value, where that is a finite number (else it keeps its
    last). ``source``: a declared type, read by attribute (a field it lacks reads as None)."""
    for gauge, name in pairs:
        v = num(getattr(source, name, None))
        if v is not None:
            gauge.set(v)


def _gauge(registry: CollectorRegistry) -> Callable[..., Gauge]:
    def g(name: str, doc: str, labels: tuple[str, ...] = ()) -> Gauge:
        return Gauge(name, doc, labels, registry=registry)

    return g


class StepGauges:
    """What one learner step's row says: progress, cost, staleness, the newest publication.
    Keeps the recent rows (for the dashboard) and the running cost."""

    def __init__(self, registry: CollectorRegistry, learner_price: float, history: int) -> None:
        g = _gauge(registry)
        self.learner_price = learner_price
        self.rows: deque[JsonObject] = deque(maxlen=history)  # as /api/state sends them
        self.cost_usd = 0.0
        self.steps = 0
        self.last_step: int | None = None
        self.stale_counts: dict[int, int] = {}
        self.g_step = g("echo_learner_step", "last learner step completed")
        self.g_cost = g("echo_cost_usd", "cost so far, $ (fleet + learner, over t_train + t_wait)")
        self.g_cost_step = g("echo_cost_per_step_usd", "mean cost per learner step so far, $")
        self.g_cost_last = g("echo_last_step_cost_usd", "cost of the last learner step, $")
        self.g_cost_1k = g("echo_cost_per_1k_admitted_usd", "$ per 1,000 admitted trajectories")
        self.h_stale = Histogram(
            "echo_staleness",
            "staleness (versions) of trained trajectories",
            buckets=STALENESS_BUCKETS,
            registry=registry,
        )
        self.g_buffer = g("echo_buffer_groups", "groups in the replay buffer", ("kind",))
        # an episode adapter's info numbers, the last step's means; names no longer in the
        # row are removed (a row holds at most 16: echo_rl/learner/rows.py)
        self.g_episode = g(
            "echo_episode_stat", "multi-turn: mean of an episode info number, last step", ("name",)
        )
        self.episode_names: set[str] = set()
        self.by_key = self._row_gauges(g)

    @staticmethod
    def _row_gauges(g: Callable[..., Gauge]) -> tuple[tuple[Gauge, str], ...]:
        """The gauges that show one row field as it is."""
        return (
            (g("echo_policy_version", "policy version of the last step"), COL.version),
            (g("echo_reward_mean", "mean reward of the last step's batch"), COL.reward_mean),
            (
                g(
                    "echo_heldout_score",
                    "newest held-out score (learner.heldout), mean over prompts",
                ),
                COL.heldout_mean,
            ),
            (
                g("echo_bubble_ratio", "sum(t_wait) / sum(t_train + t_wait), after step 0"),
                COL.bubble_ratio,
            ),
            (g("echo_staleness_max", "max staleness in the last step's batch"), COL.staleness_max),
            (
                g("echo_completions_cut", "share of the last step's completions cut short"),
                COL.completions_cut,
            ),
            (g("echo_t_train_seconds", "last step's training time"), COL.t_train),
            (g("echo_t_wait_seconds", "last step's wait for admissible data"), COL.t_wait),
            (g("echo_admitted", "trajectories admitted to the buffer so far"), COL.admitted),
            (
                g("echo_dropped_stale", "trajectories dropped as too stale so far"),
                COL.dropped_stale,
            ),
            # docs/broadcast.md, "Delta snapshots": what the newest publication sent and cost
            (
                g(
                    "echo_publish_bytes",
                    "bytes of the newest publication's payload "
                    "(a delta, or a keyframe's full payload)",
                ),
                COL.publish_bytes,
            ),
            (
                g("echo_publish_full_bytes", "bytes of the newest version in full"),
                COL.publish_full_bytes,
            ),
            (g("echo_delta_ratio", "newest publication's bytes / full bytes"), COL.delta_ratio),
            (
                g(
                    "echo_encode_seconds",
                    "building the newest publication (encode, "
                    "hashes, signature; on the publisher thread)",
                ),
                COL.encode_s,
            ),
            (
                g(
                    "echo_decode_seconds",
                    "median seconds workers took to rebuild the "
                    "newest version they reported from its delta",
                ),
                COL.decode_s,
            ),
            (
                g(
                    "echo_keyframe_installs",
                    "installs that needed a keyframe (the "
                    "worker lacked the base of a delta) so far",
                ),
                COL.keyframe_installs,
            ),
        )

    def step_cost(self, row: StepRow) -> float:
        """Fleet cost from the row plus the learner's own price over the same seconds (the row's
        ``cost_step_usd`` covers the fleet only)."""
        fleet = num(row.cost_step_usd) or 0.0
        secs = (num(row.t_train) or 0.0) + (num(row.t_wait) or 0.0)
        return fleet + self.learner_price * secs / 3600.0

    def update(self, row: StepRow) -> None:
        cost = self.step_cost(row)
        self.cost_usd += cost
        self.steps += 1
        self.last_step = self.steps - 1 if row.step is None else int(row.step)
        doc = row.to_json()
        kept = {k: doc[k] for k in ROW_FIELDS if k in doc}
        kept[DASHBOARD_COST] = round(self.cost_usd, 8)
        kept[COL.cost_step_usd] = round(cost, 8)
        self.rows.append(kept)
        self.g_step.set(self.last_step)
        _set_from(self.by_key, row)
        self.g_cost.set(self.cost_usd)
        self.g_cost_last.set(cost)
        self.g_cost_step.set(self.cost_usd / self.steps)
        admitted = num(row.admitted)
        if admitted:
            self.g_cost_1k.set(1000.0 * self.cost_usd / admitted)
        for kind, value in (("ready", row.ready_groups), ("partial", row.partial_groups)):
            v = num(value)
            if v is not None:
                self.g_buffer.labels(kind=kind).set(v)
        self._observe_staleness(row)
        self._episode_stats(row.episode_stats)

    def _episode_stats(self, stats: object) -> None:
        means = {str(k): num(v) for k, v in stats.items()} if isinstance(stats, dict) else {}
        kept = {k: v for k, v in means.items() if v is not None}
        for gone in self.episode_names - set(kept):
            self.g_episode.remove(gone)
        for name, v in kept.items():
            self.g_episode.labels(name=name).set(v)
        self.episode_names = set(kept)

    def _observe_staleness(self, row: StepRow) -> None:
        counts = row.staleness_counts
        if isinstance(counts, dict) and counts:
            items = [(int(k), int(n)) for k, n in counts.items()]
        elif row.staleness_max is not None:
            items = [(int(row.staleness_max), 1)]
        else:
            items = []
        for s, n in items:
            self.stale_counts[s] = self.stale_counts.get(s, 0) + n
            for _ in range(n):
                self.h_stale.observe(s)


class FleetGauges:
    """What the control plane's stats say: fleet size and price, refusals, bytes sent, and each
    live worker's numbers and checks (series of departed workers removed)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        g = _gauge(registry)
        self.workers: dict[str, dict[str, object]] = {}
        self.reputation: dict[str, dict[str, object]] = {}
        self.by_key = (
            (g("echo_active_workers", "live active workers"), STAT.active_workers),
            (g("echo_standby_workers", "live standby workers"), STAT.standby_workers),
            (
                g("echo_fleet_price_per_hour", "sum of active workers' prices, $/h"),
                STAT.fleet_price_per_hour,
            ),
            (
                g("echo_learner_bytes_sent", "snapshot bytes sent by the learner so far"),
                STAT.learner_bytes_sent,
            ),
            (g("echo_t_bcast_seconds", "T_bcast of the latest measured publication"), STAT.t_bcast),
            (
                g("echo_in_flight_groups", "groups handed out and not yet returned"),
                STAT.in_flight_groups,
            ),
            (
                g(
                    "echo_ack_queue",
                    "batch acknowledgements waiting for the write-ahead "
                    "log's fsync (group commit; bounded, echo_rl.control.listen.ACK_QUEUE)",
                ),
                STAT.ack_queue,
            ),
            (
                g(
                    "echo_snapshot_path_reporters",
                    "workers whose fetches from the learner's snapshot port failed in the last "
                    "30 s, when the learner judges the port unreachable (echo_rl/control/snapshot_path.py)",
                ),
                STAT.snapshot_path_reporters,
            ),
        )
        self.g_rejected = g("echo_rejected", "records/frames rejected so far", ("reason",))
        # docs/security.md: what the door refused, by reason
        self.g_join_refused = g(
            "echo_join_refused", "joins and connections refused so far", ("reason",)
        )
        self.g_limited = g(
            "echo_messages_refused", "messages refused (rate limit, ban) so far", ("reason",)
        )
        self.g_chunk_refused = g(
            "echo_chunk_requests_refused", "learner chunk requests refused so far", ("reason",)
        )
        self.g_w = {  # stats key -> per-worker gauge, with the value a missing key shows
            "throughput": (
                g(
                    "echo_worker_throughput",
                    "measured throughput (EWMA, trajectories/s)",
                    ("worker",),
                ),
                0.0,
            ),
            "price": (g("echo_worker_price_per_hour", "worker price, $/h", ("worker",)), 0.0),
            "active": (g("echo_worker_active", "1 active, 0 standby", ("worker",)), 0.0),
            "version": (
                g("echo_worker_version", "policy version the worker runs", ("worker",)),
                -1.0,
            ),
            "admitted": (
                g("echo_worker_admitted", "trajectories admitted from the worker", ("worker",)),
                0.0,
            ),
        }
        # docs/security.md, "Trust but verify": checks of what each worker delivered
        self.g_w_checks = g(
            "echo_worker_checks",
            "checks made of the worker's deliveries (recomputed rewards, whole groups, audits)",
            ("worker",),
        )
        self.g_w_failed = g(
            "echo_worker_check_failures", "checks the worker failed (strikes)", ("worker",)
        )
        self.g_w_quarantined = g(
            "echo_worker_quarantined", "1 if the worker was quarantined", ("worker",)
        )
        self.g_checks = g("echo_checks", "checks so far, by kind and outcome", ("check", "outcome"))

    def update(self, stats: ControlStats) -> None:
        _set_from(self.by_key, stats)
        for reason, n in stats.rejected.items():
            self.g_rejected.labels(reason=reason).set(n)
        for counts, gauge in (
            (stats.join_refused, self.g_join_refused),
            (stats.limited, self.g_limited),
            (stats.chunk_rejected, self.g_chunk_refused),
        ):
            for reason, n in counts.items():
                gauge.labels(reason=reason).set(n)
        if isinstance(stats.workers, dict):
            self._update_workers(stats.workers)
        self._update_checks(stats)

    def _update_workers(self, workers: Mapping[str, Mapping[str, object]]) -> None:
        for gone in set(self.workers) - set(workers):
            for gauge, _ in self.g_w.values():
                try:
                    gauge.remove(gone)
                except KeyError:
                    pass
        self.workers = {}
        for wid, w in workers.items():
            self.workers[wid] = dict(w)
            for key, (gauge, missing) in self.g_w.items():
                if key == "active":  # a flag, not a number
                    gauge.labels(worker=wid).set(1.0 if w.get("active") else 0.0)
                else:
                    gauge.labels(worker=wid).set(num(w.get(key)) or missing)

    def _update_checks(self, stats: ControlStats) -> None:
        rep = stats.reputation
        if isinstance(rep, dict):
            self.reputation = {wid: dict(r) for wid, r in rep.items()}
            for wid, r in rep.items():
                self.g_w_checks.labels(worker=wid).set(num(r.get("audits")) or 0.0)
                self.g_w_failed.labels(worker=wid).set(num(r.get("failures")) or 0.0)
                self.g_w_quarantined.labels(worker=wid).set(num(r.get("quarantined")) or 0.0)
        for name, n in stats.checks.items():
            check, _, outcome = str(name).partition(":")
            self.g_checks.labels(check=check, outcome=outcome).set(num(n) or 0.0)


class AccountGauges:
    """echo_rl.control.accounts: each worker's books, exactly what the worker is told (departed workers
    included, bounded); labels that no longer apply are removed."""

    def __init__(self, registry: CollectorRegistry) -> None:
        g = _gauge(registry)
        self.accounts: dict[str, JsonObject] = {}  # {worker: a wire.Account dumped}
        self.g_acct = {
            "accepted": g(
                "echo_worker_records_accepted", "records of the worker admitted", ("worker",)
            ),
            "duplicates": g(
                "echo_worker_records_duplicate",
                "resent records already held (acknowledged, not counted twice)",
                ("worker",),
            ),
            "active_s": g(
                "echo_worker_active_seconds",
                "seconds the learner counted the worker active",
                ("worker",),
            ),
            "earned_usd": g(
                "echo_worker_earned_usd", "declared price x active seconds, $", ("worker",)
            ),
        }
        self.g_acct_rejected = g(
            "echo_worker_records_rejected",
            "records of the worker refused, by reason",
            ("worker", "reason"),
        )
        self.g_acct_state = g(
            "echo_worker_state",
            "1 for the worker's state in the learner's books (standby, active, quarantined, left)",
            ("worker", "state"),
        )

    def update(self, accounts: Mapping[str, JsonObject]) -> None:
        for wid in set(self.accounts) - set(accounts):
            for gauge in self.g_acct.values():
                gauge.remove(wid)
        for wid, old in self.accounts.items():  # labels (reason, state) no longer there
            new = accounts.get(wid, {})
            for reason in set(_rejected(old)) - set(_rejected(new)):
                self.g_acct_rejected.remove(wid, reason)
            if old.get("state") != new.get("state"):
                self.g_acct_state.remove(wid, old.get("state"))
        for wid, a in accounts.items():
            for key, gauge in self.g_acct.items():
                gauge.labels(worker=wid).set(num(a.get(key)) or 0.0)
            for reason, n in _rejected(a).items():
                self.g_acct_rejected.labels(worker=wid, reason=reason).set(num(n) or 0.0)
            self.g_acct_state.labels(worker=wid, state=str(a.get("state"))).set(1.0)
        self.accounts = {wid: dict(a) for wid, a in accounts.items()}


def _rejected(account: JsonObject) -> JsonObject:
    """An account's refused records by reason ({} when it has none)."""
    rejected = account.get("rejected")
    return rejected if isinstance(rejected, dict) else {}


class InstallGauges:
    """Per version, seconds from publication until the last worker installed it: the
    ``KEEP_VERSIONS`` most recent versions, older series removed."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.installs: dict[int, dict[str, float]] = {}
        self._versions: list[str] = []
        self.g_bcast_v = Gauge(
            "echo_broadcast_seconds",
            "per version: seconds until the last worker installed it (recent versions)",
            ("version",),
            registry=registry,
        )

    def update(self, installs: Mapping[int, Mapping[str, float]]) -> None:
        """``installs``: {version: {worker: seconds}} (a version read back from JSON may be a
        string; int() takes both)."""
        for version, times in installs.items():
            if times:
                self.installs[int(version)] = {w: float(t) for w, t in times.items()}
        for v in sorted(self.installs)[:-KEEP_VERSIONS]:
            del self.installs[v]
        keep = [str(v) for v in sorted(self.installs)]
        for label in set(self._versions) - set(keep):
            self.g_bcast_v.remove(label)
        for label in keep:
            self.g_bcast_v.labels(version=label).set(max(self.installs[int(label)].values()))
        self._versions = keep
