"""Learner observability: one Prometheus registry, a small HTTP server, a live dashboard.

``LearnerMetrics.update(row, control_stats)`` is called once per learner step with the row
written to ``metrics.jsonl`` (``learner.main._metrics_row``) and the control plane's stats dict
(``ControlPlane.stats()``). The names and labels exported are listed in docs/observability.md
(tests check that table against ``/metrics``).

Keys relied on. ``row``: step, version, reward_mean, staleness_max, staleness_mean, t_train,
t_wait, bubble_ratio, admitted, dropped_stale, cost_step_usd, ready_groups, partial_groups;
optional: staleness_counts ({staleness: records}, else staleness_max is observed once per
step), learner_price_per_hour. ``control_stats``: active_workers, standby_workers,
fleet_price_per_hour, rejected ({reason: n}), learner_bytes_sent, t_bcast, in_flight_groups,
workers ({id: {price, version, state, active, throughput, admitted[, reachable]}}); optional:
installs ({version: {worker: seconds after publication}}, e.g. from
``Coordinator.install_times``). Missing keys are tolerated (the metric keeps its last value).

The server (stdlib ``http.server``, daemon thread) serves ``/metrics`` (Prometheus text),
``/health`` (JSON), ``/api/state`` (JSON for the dashboard) and ``/`` (the dashboard page,
``echo/dashboard/index.html``, no external assets). The relay tree (``echo.tree.RelayTree``) and
the workers' books are not fed per step: ``tree_source`` and ``accounts_source`` are read at
each scrape and each ``/api/state``.

``python -m echo.metrics serve RUN_DIR [--host H] [--port P]`` serves a recorded run (rows and
decisions replayed from its files; no live worker data).
"""

from __future__ import annotations

import argparse
import json
import math
import threading
import time
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from echo.tree import RelayTree
from echo.tree_metrics import TreeGauges

DASHBOARD = Path(__file__).parent / "dashboard" / "index.html"
STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 16)
KEEP_VERSIONS = 20  # broadcast gauges/timeline keep this many recent versions

# Row fields sent to the dashboard (the rest stay in metrics.jsonl).
ROW_FIELDS = ("step", "version", "reward_mean", "staleness_max", "staleness_mean", "t_train",
              "t_wait", "bubble_ratio", "admitted", "cost_step_usd", "cost_usd", "active_workers",
              "standby_workers", "t_bcast", "wall_s", "publish_encoding", "publish_bytes",
              "publish_full_bytes", "delta_ratio", "encode_s", "decode_s")


def _num(x: Any) -> float | None:
    """A finite float, else None (the metric keeps its last value: one NaN must not stick in
    a running total such as the cost)."""
    try:
        v = None if x is None else float(x)
    except (TypeError, ValueError, OverflowError):
        return None
    return v if v is not None and math.isfinite(v) else None


class LearnerMetrics:
    """Everything the learner exports. Thread-safe: ``update`` from the trainer thread, reads
    from the server's threads."""

    def __init__(self, *, learner_price_per_hour: float = 0.0, history: int = 2000,
                 run_id: str = "") -> None:
        self.learner_price = float(learner_price_per_hour)
        self.run_id = run_id
        self.registry = r = CollectorRegistry(auto_describe=True)
        self._lock = threading.Lock()
        self.rows: deque[dict[str, Any]] = deque(maxlen=history)
        self.decisions: deque[dict[str, Any]] = deque(maxlen=200)
        self.installs: dict[int, dict[str, float]] = {}
        self.workers: dict[str, dict[str, Any]] = {}
        self.cost_usd = 0.0
        self.steps = 0
        self.last_step: int | None = None
        self.started = time.time()
        self.stale_counts: dict[int, int] = {}

        def g(name: str, doc: str, labels: tuple[str, ...] = ()) -> Gauge:
            return Gauge(name, doc, labels, registry=r)

        self.g_step = g("echo_learner_step", "last learner step completed")
        self.g_version = g("echo_policy_version", "policy version of the last step")
        self.g_cost = g("echo_cost_usd", "cost so far, $ (fleet + learner, over t_train + t_wait)")
        self.g_cost_step = g("echo_cost_per_step_usd", "mean cost per learner step so far, $")
        self.g_cost_last = g("echo_last_step_cost_usd", "cost of the last learner step, $")
        self.g_cost_1k = g("echo_cost_per_1k_admitted_usd", "$ per 1,000 admitted trajectories")
        self.g_bubble = g("echo_bubble_ratio", "sum(t_wait) / sum(t_train + t_wait), after step 0")
        self.g_reward = g("echo_reward_mean", "mean reward of the last step's batch")
        self.g_stale_max = g("echo_staleness_max", "max staleness in the last step's batch")
        self.h_stale = Histogram("echo_staleness", "staleness (versions) of trained trajectories",
                                 buckets=STALENESS_BUCKETS, registry=r)
        self.g_t_train = g("echo_t_train_seconds", "last step's training time")
        self.g_t_wait = g("echo_t_wait_seconds", "last step's wait for admissible data")
        self.g_admitted = g("echo_admitted", "trajectories admitted to the buffer so far")
        self.g_dropped = g("echo_dropped_stale", "trajectories dropped as too stale so far")
        self.g_buffer = g("echo_buffer_groups", "groups in the replay buffer", ("kind",))
        self.g_in_flight = g("echo_in_flight_groups", "groups handed out and not yet returned")
        self.g_ack_queue = g("echo_ack_queue", "batch acknowledgements waiting for the write-ahead "
                             "log's fsync (group commit; bounded, learner.control.ACK_QUEUE)")
        self.g_rejected = g("echo_rejected", "records/frames rejected so far", ("reason",))
        # docs/security.md: what the door refused, by reason
        self.g_refusals = {
            "join_refused": g("echo_join_refused", "joins and connections refused so far", ("reason",)),
            "limited": g("echo_messages_refused", "messages refused (rate limit, ban) so far", ("reason",)),
            "chunk_rejected": g("echo_chunk_requests_refused", "learner chunk requests refused so far",
                                ("reason",)),
        }
        self.g_bytes = g("echo_learner_bytes_sent", "snapshot bytes sent by the learner so far")
        self.g_t_bcast = g("echo_t_bcast_seconds", "T_bcast of the latest measured publication")
        # docs/broadcast.md, "Delta snapshots": what the newest publication sent and cost
        self.g_pub_bytes = g("echo_publish_bytes", "bytes of the newest publication's payload "
                             "(a delta, or a keyframe's full payload)")
        self.g_pub_full = g("echo_publish_full_bytes", "bytes of the newest version in full")
        self.g_delta_ratio = g("echo_delta_ratio", "newest publication's bytes / full bytes")
        self.g_encode = g("echo_encode_seconds", "building the newest publication (encode, "
                          "hashes, signature; on the publisher thread)")
        self.g_decode = g("echo_decode_seconds", "median seconds workers took to rebuild the "
                          "newest version they reported from its delta")
        self.g_keyframes = g("echo_keyframe_installs", "installs that needed a keyframe (the "
                             "worker lacked the base of a delta) so far")
        self.g_bcast_v = g("echo_broadcast_seconds", "per version: seconds until the last worker "
                           "installed it (recent versions)", ("version",))
        self.g_active = g("echo_active_workers", "live active workers")
        self.g_standby = g("echo_standby_workers", "live standby workers")
        self.g_fleet_price = g("echo_fleet_price_per_hour", "sum of active workers' prices, $/h")
        self.g_w_tput = g("echo_worker_throughput", "measured throughput (EWMA, trajectories/s)", ("worker",))
        self.g_w_price = g("echo_worker_price_per_hour", "worker price, $/h", ("worker",))
        self.g_w_active = g("echo_worker_active", "1 active, 0 standby", ("worker",))
        self.g_w_version = g("echo_worker_version", "policy version the worker runs", ("worker",))
        self.g_w_admitted = g("echo_worker_admitted", "trajectories admitted from the worker", ("worker",))
        # docs/security.md, "Trust but verify": checks of what each worker delivered
        self.g_w_checks = g("echo_worker_checks", "checks made of the worker's deliveries "
                            "(recomputed rewards, whole groups, audits)", ("worker",))
        self.g_w_failed = g("echo_worker_check_failures", "checks the worker failed (strikes)", ("worker",))
        self.g_w_quarantined = g("echo_worker_quarantined", "1 if the worker was quarantined", ("worker",))
        self.g_checks = g("echo_checks", "checks so far, by kind and outcome", ("check", "outcome"))
        # learner.accounts: each worker's books, exactly what the worker is told (departed
        # workers included, bounded); read live at each scrape when ``accounts_source`` is set
        self.g_acct = {
            "accepted": g("echo_worker_records_accepted", "records of the worker admitted", ("worker",)),
            "duplicates": g("echo_worker_records_duplicate", "resent records already held "
                            "(acknowledged, not counted twice)", ("worker",)),
            "active_s": g("echo_worker_active_seconds", "seconds the learner counted the worker "
                          "active", ("worker",)),
            "earned_usd": g("echo_worker_earned_usd", "declared price x active seconds, $", ("worker",)),
        }
        self.g_acct_rejected = g("echo_worker_records_rejected", "records of the worker refused, "
                                 "by reason", ("worker", "reason"))
        self.g_acct_state = g("echo_worker_state", "1 for the worker's state in the learner's "
                              "books (standby, active, quarantined, left)", ("worker", "state"))
        self.accounts: dict[str, dict[str, Any]] = {}
        self.accounts_source: Any = None  # () -> {worker: account dict}, e.g. Accounts.export
        self.reputation: dict[str, dict[str, Any]] = {}
        self._bcast_versions: list[str] = []
        self._rejected_reasons: set[str] = set()
        # echo.tree: the current version's relay tree, read live at each scrape and each
        # dashboard poll when ``tree_source`` is set (ControlPlane.relay_tree)
        self.tree: RelayTree | None = None
        self.tree_source: Any = None  # () -> RelayTree; may raise TimeoutError: last one kept
        self._tree_gauges = TreeGauges(r)

    # ------------------------------------------------------------------ feeding

    def step_cost(self, row: dict[str, Any]) -> float:
        """Fleet cost from the row plus the learner's own price over the same seconds (the row's
        ``cost_step_usd`` covers the fleet only)."""
        fleet = _num(row.get("cost_step_usd")) or 0.0
        price = _num(row.get("learner_price_per_hour"))
        price = self.learner_price if price is None else price
        secs = (_num(row.get("t_train")) or 0.0) + (_num(row.get("t_wait")) or 0.0)
        return fleet + price * secs / 3600.0

    def update(self, row: dict[str, Any], control_stats: dict[str, Any] | None = None,
               installs: dict[int, dict[str, float]] | None = None) -> None:
        stats = control_stats or {}
        with self._lock:
            self._update_row(row)
            self._update_stats(stats)
            inst = installs if installs is not None else stats.get("installs")
            if inst:
                self._update_installs(inst)

    def _update_row(self, row: dict[str, Any]) -> None:
        cost = self.step_cost(row)
        self.cost_usd += cost
        self.steps += 1
        self.last_step = int(row.get("step", self.steps - 1))
        kept = {k: row.get(k) for k in ROW_FIELDS if k in row}
        kept["cost_usd"] = round(self.cost_usd, 8)
        kept["cost_step_usd"] = round(cost, 8)
        self.rows.append(kept)
        self.g_step.set(self.last_step)
        for gauge, key in ((self.g_version, "version"), (self.g_reward, "reward_mean"),
                           (self.g_bubble, "bubble_ratio"), (self.g_stale_max, "staleness_max"),
                           (self.g_t_train, "t_train"), (self.g_t_wait, "t_wait"),
                           (self.g_admitted, "admitted"), (self.g_dropped, "dropped_stale"),
                           (self.g_pub_bytes, "publish_bytes"), (self.g_pub_full, "publish_full_bytes"),
                           (self.g_delta_ratio, "delta_ratio"), (self.g_encode, "encode_s"),
                           (self.g_decode, "decode_s"), (self.g_keyframes, "keyframe_installs")):
            v = _num(row.get(key))
            if v is not None:
                gauge.set(v)
        self.g_cost.set(self.cost_usd)
        self.g_cost_last.set(cost)
        self.g_cost_step.set(self.cost_usd / self.steps)
        admitted = _num(row.get("admitted"))
        if admitted:
            self.g_cost_1k.set(1000.0 * self.cost_usd / admitted)
        for kind in ("ready", "partial"):
            v = _num(row.get(f"{kind}_groups"))
            if v is not None:
                self.g_buffer.labels(kind=kind).set(v)
        counts = row.get("staleness_counts")
        if isinstance(counts, dict) and counts:
            items = [(int(k), int(n)) for k, n in counts.items()]
        elif row.get("staleness_max") is not None:
            items = [(int(row["staleness_max"]), 1)]
        else:
            items = []
        for s, n in items:
            self.stale_counts[s] = self.stale_counts.get(s, 0) + n
            for _ in range(n):
                self.h_stale.observe(s)

    def _update_stats(self, stats: dict[str, Any]) -> None:
        for gauge, key in ((self.g_active, "active_workers"), (self.g_standby, "standby_workers"),
                           (self.g_fleet_price, "fleet_price_per_hour"),
                           (self.g_bytes, "learner_bytes_sent"), (self.g_t_bcast, "t_bcast"),
                           (self.g_in_flight, "in_flight_groups"), (self.g_ack_queue, "ack_queue")):
            v = _num(stats.get(key))
            if v is not None:
                gauge.set(v)
        rejected = stats.get("rejected") or {}
        for reason, n in rejected.items():
            self._rejected_reasons.add(reason)
            self.g_rejected.labels(reason=reason).set(n)
        for key, gauge in self.g_refusals.items():
            for reason, n in (stats.get(key) or {}).items():
                gauge.labels(reason=reason).set(n)
        workers = stats.get("workers")
        if isinstance(workers, dict):
            for gone in set(self.workers) - set(workers):
                for gauge in (self.g_w_tput, self.g_w_price, self.g_w_active, self.g_w_version,
                              self.g_w_admitted):
                    try:
                        gauge.remove(gone)
                    except KeyError:
                        pass
            self.workers = {}
            for wid, w in workers.items():
                self.workers[wid] = dict(w)
                self.g_w_tput.labels(worker=wid).set(_num(w.get("throughput")) or 0.0)
                self.g_w_price.labels(worker=wid).set(_num(w.get("price")) or 0.0)
                self.g_w_active.labels(worker=wid).set(1.0 if w.get("active") else 0.0)
                self.g_w_version.labels(worker=wid).set(_num(w.get("version")) or -1.0)
                self.g_w_admitted.labels(worker=wid).set(_num(w.get("admitted")) or 0.0)
        self._update_checks(stats)
        if isinstance(stats.get("accounts"), dict):
            self._update_accounts(stats["accounts"])

    def _update_accounts(self, accounts: dict[str, dict[str, Any]]) -> None:
        for wid in set(self.accounts) - set(accounts):
            for gauge in self.g_acct.values():
                gauge.remove(wid)
        for wid, old in self.accounts.items():  # labels (reason, state) no longer there
            new = accounts.get(wid, {})
            for reason in set(old.get("rejected", {})) - set(new.get("rejected", {})):
                self.g_acct_rejected.remove(wid, reason)
            if old.get("state") != new.get("state"):
                self.g_acct_state.remove(wid, old.get("state"))
        for wid, a in accounts.items():
            for key, gauge in self.g_acct.items():
                gauge.labels(worker=wid).set(_num(a.get(key)) or 0.0)
            for reason, n in (a.get("rejected") or {}).items():
                self.g_acct_rejected.labels(worker=wid, reason=reason).set(_num(n) or 0.0)
            self.g_acct_state.labels(worker=wid, state=str(a.get("state"))).set(1.0)
        self.accounts = {wid: dict(a) for wid, a in accounts.items()}

    def _pull_accounts(self) -> None:
        if self.accounts_source is not None:
            accounts = self.accounts_source()
            with self._lock:
                self._update_accounts(accounts)

    def set_tree(self, tree: RelayTree) -> None:
        with self._lock:
            self.tree = tree
            self._tree_gauges.update(tree)

    def _pull_tree(self) -> None:
        if self.tree_source is None:
            return
        try:
            tree = self.tree_source()
        except (TimeoutError, RuntimeError):  # a busy or stopped control loop: keep the last
            return
        self.set_tree(tree)

    def _update_checks(self, stats: dict[str, Any]) -> None:
        rep = stats.get("reputation")
        if isinstance(rep, dict):
            self.reputation = {wid: dict(r) for wid, r in rep.items()}
            for wid, r in rep.items():
                self.g_w_checks.labels(worker=wid).set(_num(r.get("audits")) or 0.0)
                self.g_w_failed.labels(worker=wid).set(_num(r.get("failures")) or 0.0)
                self.g_w_quarantined.labels(worker=wid).set(_num(r.get("quarantined")) or 0.0)
        for name, n in (stats.get("checks") or {}).items():
            check, _, outcome = str(name).partition(":")
            self.g_checks.labels(check=check, outcome=outcome).set(_num(n) or 0.0)

    def _update_installs(self, installs: dict[Any, dict[str, float]]) -> None:
        for version, times in installs.items():
            if times:
                self.installs[int(version)] = {w: float(t) for w, t in times.items()}
        for v in sorted(self.installs)[:-KEEP_VERSIONS]:
            del self.installs[v]
        keep = [str(v) for v in sorted(self.installs)]
        for v in set(self._bcast_versions) - set(keep):
            self.g_bcast_v.remove(v)
        for v in keep:
            self.g_bcast_v.labels(version=v).set(max(self.installs[int(v)].values()))
        self._bcast_versions = keep

    def record_installs(self, version: int, times: dict[str, float]) -> None:
        with self._lock:
            self._update_installs({version: times})

    def add_decision(self, decision: dict[str, Any]) -> None:
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

    def health(self) -> dict[str, Any]:
        with self._lock:
            return {"ok": True, "step": self.last_step, "steps": self.steps, "run_id": self.run_id,
                    "uptime_s": round(time.time() - self.started, 3)}

    def state(self, rows: int = 500) -> dict[str, Any]:
        self._pull_accounts()
        self._pull_tree()
        with self._lock:
            last = self.rows[-1] if self.rows else {}
            admitted = _num(last.get("admitted")) or 0.0
            return {
                "run_id": self.run_id, "step": self.last_step, "steps": self.steps,
                "totals": {
                    "cost_usd": self.cost_usd,
                    "cost_per_step_usd": self.cost_usd / self.steps if self.steps else None,
                    "cost_per_1k_admitted_usd": 1000 * self.cost_usd / admitted if admitted else None,
                    "bubble_ratio": last.get("bubble_ratio"), "reward_mean": last.get("reward_mean"),
                    "admitted": last.get("admitted"), "t_bcast": last.get("t_bcast"),
                    "publish_bytes": last.get("publish_bytes"), "delta_ratio": last.get("delta_ratio"),
                    "learner_price_per_hour": self.learner_price,
                },
                "rows": list(self.rows)[-rows:],
                "workers": [{"worker": wid, **w} for wid, w in sorted(self.workers.items())],
                "checks": [{"worker": wid, **r} for wid, r in sorted(self.reputation.items())],
                "accounts": [{"worker": wid, **a} for wid, a in sorted(self.accounts.items())],
                "decisions": list(self.decisions)[-20:],
                "installs": {str(v): t for v, t in sorted(self.installs.items())},
                "staleness": {str(k): n for k, n in sorted(self.stale_counts.items())},
                "tree": self.tree.model_dump() if self.tree is not None else None,
            }

    # ------------------------------------------------------------------ serving

    def serve(self, host: str = "127.0.0.1", port: int = 0) -> "MetricsServer":
        return MetricsServer(self, host, port)


class _Handler(BaseHTTPRequestHandler):
    metrics: LearnerMetrics  # set on the subclass made per server
    timeout = 10  # seconds a connection may sit idle (an idle flood must not hold threads)

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    def _send(self, code: int, body: bytes, ctype: str) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)

    def _json(self, obj: Any) -> None:
        self._send(200, json.dumps(obj, allow_nan=False, default=str).encode(), "application/json")

    def do_GET(self) -> None:  # noqa: N802
        path = self.path.split("?", 1)[0]
        try:
            if path == "/metrics":
                self._send(200, self.metrics.prometheus_text(), CONTENT_TYPE_LATEST)
            elif path == "/health":
                self._json(self.metrics.health())
            elif path == "/api/state":
                self._json(_finite(self.metrics.state()))
            elif path in ("/", "/index.html"):
                self._send(200, DASHBOARD.read_bytes(), "text/html; charset=utf-8")
            else:
                self._send(404, b"not found\n", "text/plain")
        except (BrokenPipeError, ConnectionResetError):
            pass


def _finite(x: Any) -> Any:
    """NaN/inf are not JSON: send null."""
    return finite_or_null(x)[0]


def finite_or_null(x: Any) -> tuple[Any, int]:
    """``x`` with every non-finite float (nested in dicts, lists, tuples) replaced by None,
    and how many were replaced: what ``json.dumps(..., allow_nan=False)`` accepts."""
    if isinstance(x, float) and not math.isfinite(x):
        return None, 1
    if isinstance(x, dict):
        items = [(k, finite_or_null(v)) for k, v in x.items()]
        return {k: v for k, (v, _) in items}, sum(n for _, (_, n) in items)
    if isinstance(x, (list, tuple)):
        items = [finite_or_null(v) for v in x]
        return [v for v, _ in items], sum(n for _, n in items)
    return x, 0


MAX_CONNECTIONS = 32
MAX_PER_IP = 8


class _BoundedServer(ThreadingHTTPServer):
    """At most ``MAX_CONNECTIONS`` connections served at once (one thread each), and at most
    ``MAX_PER_IP`` from one address; more are closed at once and counted. 780 idle connections
    then cost 32 threads, not 780, and one address cannot take every slot from the others."""

    def __init__(self, *args: Any, **kw: Any):
        super().__init__(*args, **kw)
        self.slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self.per_ip: dict[str, int] = {}
        self.lock = threading.Lock()
        self.refused = 0

    def _admit(self, ip: str) -> bool:
        with self.lock:
            if self.per_ip.get(ip, 0) >= MAX_PER_IP or not self.slots.acquire(blocking=False):
                self.refused += 1
                return False
            self.per_ip[ip] = self.per_ip.get(ip, 0) + 1
            return True

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._admit(client_address[0]):
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self.lock:
                self.per_ip[client_address[0]] -= 1
                if not self.per_ip[client_address[0]]:
                    del self.per_ip[client_address[0]]
            self.slots.release()


class MetricsServer:
    """``/metrics``, ``/health``, ``/api/state``, ``/`` on host:port (port 0: the OS picks) in a
    daemon thread, read-only, at most ``MAX_CONNECTIONS`` at once. ``close()`` stops it."""

    def __init__(self, metrics: LearnerMetrics, host: str = "127.0.0.1", port: int = 0):
        handler = type("Handler", (_Handler,), {"metrics": metrics})
        self.httpd = _BoundedServer((host, port), handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="echo-metrics",
                                       daemon=True)
        self.thread.start()

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.httpd.server_address[:2]
        return str(host), int(port)

    @property
    def url(self) -> str:
        host, port = self.address
        return f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{port}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


# ---------------------------------------------------------------------- recorded runs

def _jsonl(path: Path) -> list[dict[str, Any]]:
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
    for row in _jsonl(run_dir / "metrics.jsonl"):
        m.update(row, {k: row[k] for k in ("active_workers", "standby_workers",
                                           "fleet_price_per_hour", "rejected",
                                           "learner_bytes_sent", "t_bcast") if k in row})
    for d in _jsonl(run_dir / "decisions.jsonl"):
        m.add_decision(d)
    return m


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m echo.metrics")
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
