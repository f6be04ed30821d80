"""Learner observability: one Prometheus registry, a small HTTP server, a live dashboard.

``LearnerMetrics.update(row, control_stats)`` is called once per learner step with the row
written to ``metrics.jsonl`` (``echo_rl.core.steprow.StepRow``, built by ``echo_rl.learner.rows.metrics_row``)
and the learner server's statistics (``echo_rl.core.control_stats.ControlStats``, from
``LearnerServer.stats()``). Both are declared types: what each field means, and its unit, is
written there. The names and labels exported are listed in docs/observability.md (tests check
that table against ``/metrics``). A row or statistics given as a mapping (a recorded run, a
test) is read tolerantly: a missing field is None and its metric keeps its last value.

The gauges are grouped by source in ``echo_rl.core.metrics_gauges``; the server
(``echo_rl.core.metrics_server``: stdlib ``http.server``, daemon thread) serves ``/metrics`` (Prometheus text),
``/health`` (JSON), ``/api/state`` (JSON for the dashboard) and ``/`` (the dashboard page,
``echo_rl/core/dashboard/index.html``, no external assets). The relay tree (``echo_rl.core.tree.RelayTree``) and
the workers' books are not fed per step: ``live.tree`` and ``live.accounts`` (``LiveSources``) are read at
each scrape and each ``/api/state``.

``python -m echo_rl.core.metrics serve RUN_DIR [--host H] [--port P]`` serves a recorded run (rows and
decisions replayed from its files; no live worker data).
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest

from echo_rl.core.control_stats import ControlStats, as_stats
from echo_rl.core.jsontypes import JsonObject
from echo_rl.core.metrics_gauges import AccountGauges, FleetGauges, InstallGauges, StepGauges, num
from echo_rl.core.metrics_server import MAX_PER_IP, MetricsServer, finite_or_null
from echo_rl.core.steprow import COL, StepRow, as_row
from echo_rl.core.tree import RelayTree
from echo_rl.core.tree_metrics import TreeGauges


class Health(TypedDict):
    """``/health``."""

    ok: bool
    step: int | None  # the last step done
    steps: int
    run_id: str
    uptime_s: float


class DashboardState(TypedDict):
    """``/api/state``, what the dashboard's JavaScript reads (docs/observability.md)."""

    run_id: str
    step: int | None
    steps: int
    totals: dict[str, float | None]  # cost so far and the last row's headline numbers
    rows: list[JsonObject]  # the recent rows, ROW_FIELDS and the running cost
    workers: list[dict[str, object]]  # {"worker": id, **its WorkerRow}
    checks: list[dict[str, object]]  # {"worker": id, **its reputation}
    accounts: list[JsonObject]  # {"worker": id, **its Account}
    decisions: list[dict[str, object]]  # the provisioner's last 20
    installs: dict[str, dict[str, float]]  # {version: {worker: s}}
    staleness: dict[str, int]  # {versions: records trained}
    tree: JsonObject | None  # the relay tree (RelayTree dumped)


__all__ = [
    "DashboardState",
    "Health",
    "MAX_PER_IP",
    "LearnerMetrics",
    "LiveSources",
    "MetricsServer",
    "finite_or_null",
    "from_run_dir",
    "learner_price_of",
    "main",
]


@dataclass(frozen=True)
class LiveSources:
    """What the dashboard and /metrics read live, at each scrape and poll, once serving: the
    workers' books (``Accounts.export``) and the current version's relay tree
    (``LearnerServer.relay_tree``; it may raise TimeoutError, and the last tree is kept)."""

    accounts: Callable[[], dict[str, JsonObject]] | None = None
    tree: Callable[[], RelayTree] | None = None


class LearnerMetrics:
    """Everything the learner exports, on one registry: the gauge groups of
    ``echo_rl.core.metrics_gauges`` and the relay tree's, fed under one lock. Thread-safe: ``update``
    from the trainer thread, reads from the server's threads."""

    def __init__(
        self, *, learner_price_per_hour: float = 0.0, history: int = 2000, run_id: str = ""
    ) -> None:
        self.run_id = run_id
        self.registry = r = CollectorRegistry(auto_describe=True)
        self._lock = threading.Lock()
        self.started = time.time()
        self.decisions: deque[dict[str, object]] = deque(maxlen=200)
        self.step_gauges = StepGauges(r, float(learner_price_per_hour), history)
        self.fleet = FleetGauges(r)
        self.books = AccountGauges(r)
        self.install_gauges = InstallGauges(r)
        self.tree: RelayTree | None = None  # the last relay tree read (echo_rl.core.tree)
        self.live = LiveSources()  # given by ``serve``: read at each scrape and poll
        self._tree_gauges = TreeGauges(r)

    # The running totals, read by the report and the tests.
    @property
    def learner_price(self) -> float:
        return self.step_gauges.learner_price

    @property
    def cost_usd(self) -> float:
        return self.step_gauges.cost_usd

    @property
    def steps(self) -> int:
        return self.step_gauges.steps

    @property
    def last_step(self) -> int | None:
        return self.step_gauges.last_step

    # ------------------------------------------------------------------ feeding

    def update(
        self,
        row: StepRow | JsonObject,
        control_stats: ControlStats | JsonObject | None = None,
        installs: dict[int, dict[str, float]] | None = None,
    ) -> None:
        """``row``: the learner's StepRow, or a row as written to metrics.jsonl;
        ``control_stats``: LearnerServer.stats(), or what a recorded row holds of them."""
        stats = as_stats(control_stats)
        with self._lock:
            self.step_gauges.update(as_row(row))
            self.fleet.update(stats)
            if stats.accounts:
                self.books.update(stats.accounts)
            inst = installs if installs is not None else stats.installs
            if inst:
                self.install_gauges.update(inst)

    def _pull_accounts(self) -> None:
        if self.live.accounts is not None:
            accounts = self.live.accounts()
            with self._lock:
                self.books.update(accounts)

    def set_tree(self, tree: RelayTree) -> None:
        with self._lock:
            self.tree = tree
            self._tree_gauges.update(tree)

    def _pull_tree(self) -> None:
        if self.live.tree is None:
            return
        try:
            tree = self.live.tree()
        except (TimeoutError, RuntimeError):  # a busy or stopped control loop: keep the last
            return
        self.set_tree(tree)

    def add_decision(self, decision: Mapping[str, object]) -> None:
        """A provisioner decision as written to decisions.jsonl (step, action, worker, reason,
        c_eff, target, mu_req)."""
        with self._lock:
            self.decisions.append(dict(decision))

    # ------------------------------------------------------------------ reading

    def prometheus_text(self) -> bytes:
        self._pull_accounts()
        self._pull_tree()
        with self._lock:
            return generate_latest(self.registry)

    def health(self) -> Health:
        with self._lock:
            return {
                "ok": True,
                "step": self.last_step,
                "steps": self.steps,
                "run_id": self.run_id,
                "uptime_s": round(time.time() - self.started, 3),
            }

    def state(self, rows: int = 500) -> DashboardState:
        self._pull_accounts()
        self._pull_tree()
        with self._lock:
            sg = self.step_gauges
            return {
                "run_id": self.run_id,
                "step": sg.last_step,
                "steps": sg.steps,
                "totals": self._totals(),
                "rows": list(sg.rows)[-rows:],
                "workers": [{"worker": wid, **w} for wid, w in sorted(self.fleet.workers.items())],
                "checks": [
                    {"worker": wid, **r} for wid, r in sorted(self.fleet.reputation.items())
                ],
                "accounts": [
                    {"worker": wid, **a} for wid, a in sorted(self.books.accounts.items())
                ],
                "decisions": list(self.decisions)[-20:],
                "installs": {str(v): t for v, t in sorted(self.install_gauges.installs.items())},
                "staleness": {str(k): n for k, n in sorted(sg.stale_counts.items())},
                "tree": self.tree.model_dump() if self.tree is not None else None,
            }

    def _totals(self) -> dict[str, float | None]:
        sg = self.step_gauges
        last = StepRow.from_json(sg.rows[-1] if sg.rows else {})
        admitted = num(last.admitted) or 0.0
        # the dashboard's totals: the last row's values under the row's own names
        latest = {
            c: getattr(last, c)
            for c in (
                COL.bubble_ratio,
                COL.reward_mean,
                COL.admitted,
                COL.t_bcast,
                COL.publish_bytes,
                COL.delta_ratio,
            )
        }
        return {
            "cost_usd": sg.cost_usd,
            "cost_per_step_usd": sg.cost_usd / sg.steps if sg.steps else None,
            "cost_per_1k_admitted_usd": 1000 * sg.cost_usd / admitted if admitted else None,
            **latest,
            "learner_price_per_hour": sg.learner_price,
        }

    # ------------------------------------------------------------------ serving

    def serve(
        self, host: str = "127.0.0.1", port: int = 0, live: LiveSources | None = None
    ) -> MetricsServer:
        """Serve the dashboard and /metrics, reading ``live`` at each scrape from now on."""
        if live is not None:
            self.live = live
        return MetricsServer(self, host, port)


# ---------------------------------------------------------------------- recorded runs


def _jsonl(path: Path) -> list[JsonObject]:
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def learner_price_of(run_dir: Path) -> float:
    """learner.price_per_hour from the run's config.toml (0 if absent)."""
    import tomllib

    cfg = run_dir / "config.toml"
    if not cfg.exists():
        return 0.0
    try:
        return float(tomllib.loads(cfg.read_text()).get("learner", {}).get("price_per_hour", 0.0))
    except (tomllib.TOMLDecodeError, TypeError, ValueError):
        return 0.0


def from_run_dir(run_dir: Path | str) -> LearnerMetrics:
    """Replay a recorded run (metrics.jsonl, decisions.jsonl) into a fresh registry. The control
    stats in each row (worker counts, rejections, bytes, t_bcast) are replayed too; per-worker
    tables and install timelines are not in the files, so they stay empty."""
    run_dir = Path(run_dir)
    m = LearnerMetrics(learner_price_per_hour=learner_price_of(run_dir), run_id=run_dir.name)
    replayed = (
        COL.active_workers,
        COL.standby_workers,
        COL.fleet_price_per_hour,
        COL.rejected,
        COL.learner_bytes_sent,
        COL.t_bcast,
    )  # the control stats a row carries
    for doc in _jsonl(run_dir / "metrics.jsonl"):
        row = StepRow.from_json(doc)
        m.update(
            row,
            ControlStats.from_json({k: getattr(row, k) for k in replayed if k not in row.missing}),
        )
    for d in _jsonl(run_dir / "decisions.jsonl"):
        m.add_decision(d)
    return m


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m echo_rl.core.metrics")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="serve a recorded run's dashboard and /metrics")
    s.add_argument("run_dir", type=Path)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=9400)
    args = p.parse_args(argv)
    server = from_run_dir(args.run_dir).serve(args.host, args.port)
    print(f"dashboard: {server.url}/  metrics: {server.url}/metrics  (Ctrl-C stops)", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        server.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
