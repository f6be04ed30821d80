"""Security drill: every attack of docs/security.md against a real, training learner.

    .venv/bin/python benchmarks/security_drill.py [--baseline-s 60] [--json FILE]
    .venv/bin/python benchmarks/security_drill.py liars|calibrate ...   (benchmarks/drill_liars.py)

First an honest run (learner in token mode + 2 workers, the quickstart's model, small steps) for
``--baseline-s`` seconds: its peak RSS, threads and steps/s are the baseline. Then the same setup
again, and one attack after another against it, each from its own process
(``security_drill.py attack NAME ...``, see ``benchmarks/drill_attacks.py``) for a bounded time:
junk frames, impersonation, leave floods, future chunk requests, join floods with fresh keys,
idle HTTP connections, plaintext / wrong-key clients, a live ban, oversize frames. For each it
records what the learner counted (Prometheus ``/metrics``: echo_join_refused, echo_messages_refused,
echo_chunk_requests_refused, echo_rejected, by reason), whether it kept stepping, the honest
workers' admitted samples, and the learner's RSS and threads. At the end: RSS within 1.5x of the
honest run's, nothing a worker saw acknowledged lost or trained twice (``echo_rl.learner.run_audit``), no
traceback in the learner's log. Writes benchmarks/results/security_drill.json with the machine.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from echo_rl.core.config import dump_toml, load_config  # noqa: E402
from echo_rl.core.procs import ProcessGroup, python_argv, wait_ready  # noqa: E402
from echo_rl.core.steprow import COL  # noqa: E402

OVERRIDES = [
    "learner.max_steps=1000000",
    "learner.prompts_per_step=8",
    "learner.group_size=4",
    "learner.max_outstanding_groups=16",
    "provisioning.enabled=false",
    'security.join="token"',
]
COUNTERS = {
    "echo_join_refused": "join_refused",
    "echo_messages_refused": "limited",
    "echo_chunk_requests_refused": "chunk_refused",
    "echo_rejected": "rejected",
}
RSS_LIMIT = 1.5


# ----------------------------------------------------------------------------- probes


def proc_status(pid: int) -> dict[str, int]:
    """VmRSS (MiB) and Threads of a live process; {} when it is gone."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return {}
    kv = dict(ln.split(":", 1) for ln in lines if ":" in ln)
    if "VmRSS" not in kv:  # a zombie
        return {}
    return {"rss_mib": int(kv["VmRSS"].split()[0]) // 1024, "threads": int(kv["Threads"])}


def http(url: str, timeout: float = 5.0, tries: int = 30) -> bytes:
    """GET with retries: during the idle-connection flood the dashboard refuses new ones."""
    for i in range(tries):
        try:
            with urllib.request.urlopen(url, timeout=timeout) as r:
                return r.read()
        except OSError:
            if i == tries - 1:
                raise
            time.sleep(0.5)
    raise AssertionError("unreachable")


def counters(metrics_url: str) -> dict[str, Any]:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, Any] = {v: {} for v in COUNTERS.values()}
    text = http(metrics_url + "/metrics").decode()
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in COUNTERS:
                out[COUNTERS[s.name]][s.labels.get("reason", "")] = int(s.value)
            elif s.name == "echo_learner_step":
                out["step"] = int(s.value)
    return out


def api_state(metrics_url: str) -> dict[str, Any]:
    return json.loads(http(metrics_url + "/api/state"))


class Sampler(threading.Thread):
    """Peak RSS and threads of the processes watched, every 0.2 s, reset per phase."""

    def __init__(self, pids: dict[str, int]):
        super().__init__(daemon=True)
        self.pids, self.peak, self.lock, self.stop = pids, {}, threading.Lock(), threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.2):
            for name, pid in list(self.pids.items()):
                st = proc_status(pid)
                with self.lock:
                    for k, v in st.items():
                        key = f"{name}_{k}_peak"
                        self.peak[key] = max(self.peak.get(key, 0), v)

    def take(self) -> dict[str, int]:
        with self.lock:
            peak, self.peak = self.peak, {}
        return peak


# ----------------------------------------------------------------------------- the fleet


class Fleet:
    """A learner in token mode and its honest workers, in ``tmp``."""

    def __init__(self, tmp: Path, overrides: list[str] | None = None):
        self.tmp, self.run = tmp, tmp / "run"
        self.group = ProcessGroup()
        self.cfg = load_config(
            ROOT / "examples/quickstart.toml", OVERRIDES if overrides is None else overrides
        )
        self.line = ""
        self.info: dict[str, Any] = {}

    def start(self, workers: int = 2) -> None:
        self.start_learner()
        token = self.token(workers, "honest")
        for i in range(workers):
            self.worker(f"w{i}", token)
        self.wait_step(2, timeout=180)

    def start_learner(self) -> None:
        conf = self.tmp / "cfg.toml"
        conf.write_text(dump_toml(self.cfg))
        learner = self.group.start(
            "learner",
            python_argv("echo_rl.cli.rl", "learn", str(conf), "--run-dir", str(self.run)),
            self.tmp / "learner.err",
            pipe_stdout=True,
        )
        self.line = wait_ready(learner, timeout=180)
        self.info = json.loads((self.run / "learner.json").read_text())

    def token(self, uses: int, note: str) -> str:
        out = subprocess.run(
            python_argv(
                "echo_rl.cli.rl",
                "token",
                "create",
                "--run-dir",
                str(self.run),
                "--uses",
                str(uses),
                "--note",
                note,
            ),
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        )
        return out.stdout.strip()

    def worker(self, name: str, token: str, kind: str | None = None) -> None:
        """``echo-worker join``; with ``kind``, the same worker with one lie (or ``honest``),
        logging what it scored to ``<name>.truth`` (benchmarks/drill_workers.py)."""
        prog = (
            python_argv("echo_rl.cli.worker")
            if kind is None
            else [
                sys.executable,
                str(ROOT / "benchmarks/drill_workers.py"),
                "--kind",
                kind,
                "--truth",
                str(self.tmp / f"{name}.truth"),
            ]
        )
        self.group.start(
            name,
            prog
            + [
                "join",
                f"{self.line}?token={token}",
                "--id",
                name,
                "--ledger",
                str(self.tmp / f"{name}.ledger"),
                "--identity",
                str(self.tmp / f"{name}.key"),
            ],
            self.tmp / f"{name}.log",
        )

    def pid(self, name: str) -> int:
        return self.group.procs[name].pid

    def alive(self, name: str) -> bool:
        return self.group.procs[name].poll() is None

    def step(self) -> int:
        return int(json.loads(http(self.info["metrics"] + "/health")).get("steps") or 0)

    def wait_step(self, n: int, timeout: float = 60.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive("learner"):
                raise RuntimeError(
                    "learner died: " + (self.tmp / "learner.err").read_text()[-2000:]
                )
            if self.step() >= n:
                return True
            time.sleep(0.2)
        return False

    def relay_of(self, worker: str) -> tuple[str, str]:
        """The relay endpoint ``worker`` announced at join (learner's log) and its key."""
        import re

        for line in (self.run / "learner.log").read_text().splitlines():
            m = re.search(r"relay (tcp://[^\s)]+)", line)
            if f"worker {worker} joined" in line and m:
                return m.group(1), (self.tmp / f"{worker}.key").read_text().split()[0]
        return "", ""

    def log_bytes(self) -> int:
        return (self.run / "learner.log").stat().st_size

    def tracebacks(self) -> int:
        """Tracebacks in the learner's log so far (a handler that failed, however caught)."""
        return (self.run / "learner.log").read_text().count("Traceback")

    def admitted(self) -> dict[str, int]:
        return {
            w["worker"]: int(w.get("admitted") or 0)
            for w in api_state(self.info["metrics"])["workers"]
        }

    def stop(self) -> dict[str, Any]:
        """Workers first (they deliver what is pending and leave), then the learner."""
        rcs = {}
        for name in [n for n in self.group.procs if n.startswith("w")]:
            rcs[name] = self.group.stop(name, timeout=30)
        rcs["learner"] = self.group.stop("learner", timeout=60)
        self.group.stop_all()
        return rcs


# ----------------------------------------------------------------------------- phases


def delta(after: dict[str, Any], before: dict[str, Any]) -> dict[str, dict[str, int]]:
    out = {}
    for kind in COUNTERS.values():
        d = {r: n - before.get(kind, {}).get(r, 0) for r, n in after.get(kind, {}).items()}
        d = {r: n for r, n in d.items() if n}
        if d:
            out[kind] = d
    return out


def run_attack(
    fleet: Fleet, sampler: Sampler, name: str, relay: tuple[str, str], token: str, timeout: float
) -> dict[str, Any]:
    import drill_relays

    url = fleet.info["metrics"]
    before, adm0 = counters(url), fleet.admitted()
    reports0, checks0 = drill_relays.last_row(fleet.run).get(COL.relay_reports, {}), _failures(url)
    sampler.take()
    log0, tb0 = fleet.log_bytes(), fleet.tracebacks()
    w0_before = proc_status(fleet.pid("w0")).get("rss_mib")
    t0 = time.monotonic()
    argv = [
        sys.executable,
        str(Path(__file__).resolve()),
        "attack",
        name,
        "--line",
        fleet.line,
        "--run-dir",
        str(fleet.run),
        "--relay",
        relay[0],
        "--relay-key",
        relay[1],
        "--token",
        token,
    ]
    proc = fleet.group.start(
        f"attack-{name}", argv, fleet.tmp / f"attack-{name}.err", pipe_stdout=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
        report = json.loads(out.decode().strip().splitlines()[-1])
    except (subprocess.TimeoutExpired, IndexError, ValueError):
        fleet.group.stop(f"attack-{name}")
        report = {
            "error": "attacker failed or timed out: "
            + (fleet.tmp / f"attack-{name}.err").read_text()[-800:]
        }
    wall = time.monotonic() - t0
    steps = fleet.step() - before.get("step", 0)
    stepped = fleet.wait_step(fleet.step() + 2, timeout=30)  # fresh counters come with a step
    after = counters(url)
    adm1, checks1, row = fleet.admitted(), _failures(url), drill_relays.last_row(fleet.run)
    reports = {
        k: n - reports0.get(k, 0)
        for k, n in row.get(COL.relay_reports, {}).items()
        if n != reports0.get(k, 0)
    }
    return {
        "attack": name,
        "wall_s": round(wall, 1),
        "attacker": report,
        "relay_reports_delta": reports,
        COL.relays_marked: row.get(COL.relays_marked, 0),
        "honest_struck": {
            w: checks1.get(w, 0) - checks0.get(w, 0)
            for w in ("w0", "w1")
            if checks1.get(w, 0) > checks0.get(w, 0)
        },
        "counted": delta(after, before),
        "steps_during": steps,
        "learner_log_kib": (fleet.log_bytes() - log0) // 1024,
        "learner_tracebacks": fleet.tracebacks() - tb0,
        "kept_stepping": steps > 0 and stepped,
        "steps_per_s": round(steps / max(wall, 1e-3), 3),
        "honest_admitted": {w: adm1.get(w, 0) - adm0.get(w, 0) for w in ("w0", "w1")},
        "w0_rss_mib_before": w0_before,
        "w0_rss_mib_after": proc_status(fleet.pid("w0")).get("rss_mib"),
        **sampler.take(),
        "learner_alive": fleet.alive("learner"),
        "honest_alive": all(fleet.alive(w) for w in ("w0", "w1")),
    }


def ban_phase(fleet: Fleet, sampler: Sampler) -> dict[str, Any]:
    """A third worker joins; the operator bans its key; it must be refused and exit."""
    url = fleet.info["metrics"]
    before, adm0 = counters(url), fleet.admitted()
    sampler.take()
    t0 = time.monotonic()
    fleet.worker("w2", fleet.token(1, "to be banned"))
    deadline = time.monotonic() + 60
    while "w2" not in fleet.admitted() and time.monotonic() < deadline:
        time.sleep(0.5)
    joined = "w2" in fleet.admitted()
    key = (fleet.tmp / "w2.key").read_text().split()[0]
    subprocess.run(
        python_argv("echo_rl.cli.rl", "worker", "ban", key, "--run-dir", str(fleet.run)),
        check=True,
        capture_output=True,
        timeout=60,
    )
    t_ban = time.monotonic()
    try:
        rc = fleet.group.procs["w2"].wait(15)
    except subprocess.TimeoutExpired:
        rc = None
    exit_s = time.monotonic() - t_ban
    log = (fleet.tmp / "w2.log").read_text()
    step_end = before.get("step", 0)
    stepped = fleet.wait_step(step_end + 2, timeout=30)
    after = counters(url)
    adm1 = fleet.admitted()
    said = [ln for ln in log.splitlines() if "banned" in ln]
    return {
        "attack": "banned",
        "wall_s": round(time.monotonic() - t0, 1),
        "attacker": {
            "joined_before_ban": joined,
            "exit_code": rc,
            "exit_s_after_ban": round(exit_s, 1),
            "worker_said": said[-1][-160:] if said else "",
            "last_log": log.strip().splitlines()[-1] if log.strip() else "",
            "still_listed": "w2" in adm1,
        },
        "counted": delta(after, before),
        "steps_during": after.get("step", 0) - step_end,
        "kept_stepping": stepped,
        "steps_per_s": None,
        "honest_admitted": {w: adm1.get(w, 0) - adm0.get(w, 0) for w in ("w0", "w1")},
        **sampler.take(),
        "learner_alive": fleet.alive("learner"),
        "honest_alive": all(fleet.alive(w) for w in ("w0", "w1")),
    }


def relay_phase(
    fleet: Fleet, sampler: Sampler, kind: str, token: str, seconds: float = 240.0
) -> dict[str, Any]:
    """A third worker whose relay is hostile (``benchmarks/drill_relays.py``): it declares a
    fast link, so the chain planner gives it a child; the phase lasts until the learner's counts
    show the child's report handled (or ``seconds``: the worker's start, a publication that
    places it, the child's fetch timeout and the report took over 90 s on a loaded 2-core
    machine, and the phase ended before anything was reported)."""
    import drill_relays

    url = fleet.info["metrics"]
    row0, adm0, checks0 = drill_relays.last_row(fleet.run), fleet.admitted(), _failures(url)
    sampler.take()
    tb0, s0, t0, wall0 = fleet.tracebacks(), fleet.step(), time.monotonic(), time.time()
    name = "a-" + kind.replace("_", "-")
    fleet.group.start(
        name,
        [
            sys.executable,
            str(ROOT / "benchmarks/drill_relays.py"),
            "--kind",
            kind,
            "join",
            f"{fleet.line}?token={token}",
            "--id",
            name,
            "--identity",
            str(fleet.tmp / f"{name}.key"),
            # what a relay that wants children says of itself: the planner ranks a new worker
            # by its declared rates until it has measured it (echo_rl/broadcast/coordinator.py). Without
            # this the hole could join unmeasured below the honest relays and get no child.
            "--down-mbit",
            "10000",
            "--up-mbit",
            "10000",
        ],
        fleet.tmp / f"{name}.log",
    )
    # Done when the learner's counts show the attack handled: for the selective relay, its
    # child's corrupt report and a probe after it (a probe alone may be a late retry of the
    # phase before: echo_rl/control/probes.py tries a refused timeout probe again).
    handled = {
        "black_hole": (("probe:unreachable", "timeout:convicted", "disconnected:convicted"),),
        "selective_relay": (
            ("corrupt:counted", "corrupt:convicted"),
            ("probe:intact", "probe:corrupt", "corrupt:convicted"),
        ),
    }[kind]

    def reports() -> dict[str, int]:
        now = drill_relays.last_row(fleet.run).get(COL.relay_reports, {})
        return {
            k: n - row0.get(COL.relay_reports, {}).get(k, 0)
            for k, n in now.items()
            if n != row0.get(COL.relay_reports, {}).get(k, 0)
        }

    def was_handled() -> bool:
        seen = reports()
        return all(any(k in seen for k in keys) for keys in handled)

    drill_relays.wait_for(was_handled, seconds)
    fleet.group.stop(name)
    wall = time.monotonic() - t0
    steps = fleet.step() - s0
    stepped = fleet.wait_step(fleet.step() + 2, timeout=30)
    adm1, checks1 = fleet.admitted(), _failures(url)
    bans = fleet.run / "security" / "bans.txt"
    banned_text = bans.read_text() if bans.exists() else ""
    honest_keys = {w: (fleet.tmp / f"{w}.key").read_text().split()[0] for w in ("w0", "w1")}
    joined = re.search(
        rf"worker {name} joined \(.*relay (tcp://[^)\s]+)\)",
        (fleet.run / "learner.log").read_text(),
    )
    hole = joined.group(1) if joined else "?"
    losses = {
        w: drill_relays.child_loss((fleet.tmp / f"{w}.log").read_text(), wall0, hole)
        for w in ("w0", "w1")
    }
    return {
        "attack": kind,
        "child_loss": {w: loss for w, loss in losses.items() if loss is not None},
        "wall_s": round(wall, 1),
        "attacker": {"worker": name},
        "relay_reports_delta": reports(),
        COL.relays_marked: drill_relays.last_row(fleet.run).get(COL.relays_marked, 0),
        "steps_during": steps,
        "kept_stepping": steps > 0 and stepped,
        "steps_per_s": round(steps / max(wall, 1e-3), 3),
        "learner_tracebacks": fleet.tracebacks() - tb0,
        "honest_admitted": {w: adm1.get(w, 0) - adm0.get(w, 0) for w in ("w0", "w1")},
        "honest_struck": {
            w: checks1.get(w, 0) - checks0.get(w, 0)
            for w in ("w0", "w1")
            if checks1.get(w, 0) > checks0.get(w, 0)
        },
        "reporters_banned": [w for w, k in honest_keys.items() if k in banned_text],
        **sampler.take(),
        "learner_alive": fleet.alive("learner"),
        "honest_alive": all(fleet.alive(w) for w in ("w0", "w1")),
    }


def _failures(url: str) -> dict[str, int]:
    """Failed checks per worker, as the learner counts them (its reputation)."""
    return {c["worker"]: int(c.get("failures") or 0) for c in api_state(url).get("checks", [])}


def _replies(r: dict[str, Any]) -> dict[str, int]:
    return r["attacker"].get("replies", {})


def _check_junk(r: dict[str, Any]) -> list[str]:
    out = [
        f"{where}: {n} x {why}"
        for where, got in _replies(r).items()
        for why, n in got.items()
        if why in ("internal_error", "join_ack", "chunk")
    ]
    return out + (
        [] if sum(_replies(r)["control"].values()) == 1000 else ["control: replies missing"]
    )


def _check_impersonate(r: dict[str, Any]) -> list[str]:
    want = {
        "never_joined_trajectories": "not_joined",
        "join_as_w0": "id_taken",
        **{
            f"evil_{t}_as_w0": "identity_mismatch"
            for t in ("heartbeat", "trajectories", "source_request", "leave")
        },
    }
    return [
        f"{k}: {r['attacker'].get(k)} (expected {v})"
        for k, v in want.items()
        if r["attacker"].get(k) != v
    ]


def token_state(run_dir: Path, token: str) -> dict[str, int]:
    """Uses left and keys bound for one token (tokens.json keeps only its SHA-256)."""
    tokens = json.loads((run_dir / "security" / "tokens.json").read_text())["tokens"]
    entry = tokens[hashlib.sha256(token.encode()).hexdigest()]
    return {"uses_left": entry["uses_left"], "keys": len(entry["keys"])}


def _check_token(r: dict[str, Any]) -> list[str]:
    """Only the insider's own join ("evil") may spend a use of its token; the join refused as
    id_taken must not."""
    keys = r.get("insider_token", {}).get("keys", 1)
    return (
        []
        if keys == 1
        else [
            f"a join refused as id_taken spent a use of the token "
            f"({keys} keys now hold it, 1 expected)"
        ]
    )


def _check_future(r: dict[str, Any]) -> list[str]:
    a, out = r["attacker"], []
    # an unjoined key is refused at the handshake (no connection) or, before its ZAP verdict
    # lands, answered not_joined: either way it gets nothing
    if set(a["joined"]) != {"future_version"} or not set(a["unjoined"]) <= {
        "not_joined",
        "no_connection",
    }:
        out.append(f"replies joined={a['joined']} unjoined={a['unjoined']}")
    # The next version is parked, 64 per key at most; it may be published during the burst.
    refused = a["next_version_x2000"].get("too_many_requests", 0)
    if refused < 1000:
        out.append(f"next version: only {refused} of 2000 refused too_many_requests")
    return out


def _check_idle(r: dict[str, Any]) -> list[str]:
    out = (
        []
        if r["attacker"]["health_during_12s"] == "ok"
        else [f"/health at 12 s of the flood: {r['attacker']['health_during_12s']}"]
    )
    if r["learner_threads_peak"] > r["baseline_threads"] + 40:
        out.append(f"learner threads {r['learner_threads_peak']} (honest {r['baseline_threads']})")
    return out


def _check_ban(r: dict[str, Any]) -> list[str]:
    a, out = r["attacker"], []
    if a["still_listed"]:
        out.append("the banned worker is still a session")
    if a["exit_code"] in (None, 0) or not a["worker_said"]:
        out.append(
            f"the banned worker did not exit saying so within 15 s (exit {a['exit_code']}, "
            f"last log line: {a['last_log'][-120:]!r})"
        )
    return out


def _check_oversize(r: dict[str, Any]) -> list[str]:
    a, out = r["attacker"], []
    if a.get("control_limit_plus_1mib") != "oversize":
        out.append(f"control frame over the limit: {a.get('control_limit_plus_1mib')}")
    if a.get("control_4x_limit_plus_1mib") != "no_reply":
        out.append(f"control frame over the hard cap: {a.get('control_4x_limit_plus_1mib')}")
    grew = (r["w0_rss_mib_after"] or 0) - (r["w0_rss_mib_before"] or 0)
    if grew >= 64:
        out.append(f"relay worker RSS grew {grew} MiB")
    return out


def _check_colluders(r: dict[str, Any]) -> list[str]:
    """Issue 52: one token's keys reporting every granted source as a timeout convict nobody,
    strike no honest worker, and start a bounded number of probes."""
    out, reports = [], r.get("relay_reports_delta", {})
    if not r["attacker"].get("reports_sent"):
        out.append("no report sent: not exercised")
    convicted = {k: n for k, n in reports.items() if k.endswith(":convicted")}
    if convicted or r.get(COL.relays_marked):
        out.append(f"honest relays convicted {convicted}, marked {r.get(COL.relays_marked)}")
    if r.get("honest_struck"):
        out.append(f"honest workers struck: {r['honest_struck']}")
    probes = sum(n for k, n in reports.items() if k.startswith("probe:"))
    cap = 4 * (1 + int(r["wall_s"] // 60))  # security.report_probes_per_min, one witness
    if probes > cap:
        out.append(f"{probes} probes from one token's reports (cap {cap})")
    return out


EXPECT = {  # what "refused" means for each attack: the problems found in the phase's record
    "junk13": _check_junk,
    "impersonate": lambda r: _check_impersonate(r) + _check_token(r),
    "leave_flood": lambda r: [
        f"reply {k}"
        for k in _replies(r)
        if k
        not in {
            "identity_mismatch",
            "not_joined",
            "heartbeat_ack",
            "rate_limited",
            "snapshot_notice",
        }
    ],
    "future_chunks": _check_future,
    "join_flood": lambda r: ["a sybil got join_ack"] if "join_ack" in _replies(r) else [],
    "idle_http": _check_idle,
    "plaintext": lambda r: (
        ([f"got replies {r['attacker']}"] if set(r["attacker"].values()) != {"no_reply"} else [])
        + (
            []
            if r["counted"].get("join_refused", {}).get("handshake_failed", 0) >= 2
            else ["handshake_failed not counted"]
        )
    ),
    "banned": _check_ban,
    "oversize": _check_oversize,
    "relay_spellings": lambda r: (
        [
            f"{form}: {reply} (expected bad_endpoint)"
            for form, reply in r["attacker"].get("replies", {"?": "no record"}).items()
            if reply != "bad_endpoint"
        ]
        + (
            []
            if r.get("token_before") == r.get("token_after")
            else [
                f"refused joins spent the token: {r.get('token_before')} -> {r.get('token_after')}"
            ]
        )
    ),
    "colluding_reporters": lambda r: _check_colluders(r),
    "colluding_reporters_5": lambda r: _check_colluders(r),
    **__import__("drill_relays").CHECKS,
    "forged_handback": __import__("drill_handbacks").check_forged_handback,
    "cherry_pick": __import__("drill_handbacks").check_cherry_pick,
    "edge_holder": __import__("drill_handbacks").check_edge_holder,
    "patient_liar": __import__("drill_patient").check_patient,
    "sybil_flood": lambda r: __import__("drill_sybil").check_sybil(
        r, r.get("baseline_steps_per_s")
    ),
}
# Issue 31's attacks follow the first nine: relays and reports (benchmarks/drill_relays.py),
# hand-backs and staleness (drill_handbacks.py), and Sybils in open mode (drill_sybil.py, on a
# fleet of its own: the main fleet admits by token).
ORDER = [
    "junk13",
    "impersonate",
    "leave_flood",
    "future_chunks",
    "join_flood",
    "idle_http",
    "plaintext",
    "banned",
    "oversize",
    "relay_spellings",
    "colluding_reporters",
    "colluding_reporters_5",
    "stranger_reports",
    "black_hole",
    "selective_relay",
    "patient_liar",
    "forged_handback",
    "cherry_pick",
    "edge_holder",
    "sybil_flood",
]
OPEN_MODE = ("sybil_flood",)
RELAY_PHASES = ("black_hole", "selective_relay")  # a hostile worker, not a scripted peer
# future_chunks: 100 windows of up to 1 s each (requests over a peer's rate go unanswered)
TIMEOUT = {
    "future_chunks": 240,
    "join_flood": 150,
    "leave_flood": 60,
    "forged_handback": 150,
    "cherry_pick": 380,
    "edge_holder": 200,
    "sybil_flood": 240,
}


def judge(r: dict[str, Any]) -> str:
    if "error" in r["attacker"]:
        return f"FAILED: {r['attacker']['error'][:200]}"
    problems = []
    if not r["learner_alive"]:
        problems.append("learner died")
    if not r["kept_stepping"]:
        problems.append("learner stopped stepping")
    if not r["honest_alive"]:
        problems.append("an honest worker died")
    if r.get("learner_tracebacks"):
        problems.append(f"{r['learner_tracebacks']} tracebacks in the learner's log")
    try:
        problems += EXPECT[r["attack"]](r)
    except (KeyError, TypeError) as exc:
        problems.append(f"missing field {exc}")
    return "refused" if not problems else "FAILED: " + "; ".join(problems)


# ----------------------------------------------------------------------------- runs


def honest_run(tmp: Path, seconds: float) -> dict[str, Any]:
    fleet = Fleet(tmp)
    try:
        fleet.start()
        sampler = Sampler({"learner": fleet.pid("learner"), "w0": fleet.pid("w0")})
        sampler.start()
        s0, t0 = fleet.step(), time.monotonic()
        time.sleep(seconds)
        steps, wall = fleet.step() - s0, time.monotonic() - t0
        peak = sampler.take()
        rcs = fleet.stop()
    finally:
        fleet.group.stop_all()
    return {
        "seconds": round(wall, 1),
        "steps": steps,
        "steps_per_s": round(steps / wall, 3),
        **peak,
        "exit_codes": rcs,
        **final_checks(fleet),
    }


def final_checks(fleet: Fleet) -> dict[str, Any]:
    from echo_rl.learner.run_audit import audit_run

    workers = [n for n in fleet.group.procs if n.startswith("w") and n != "w2"]
    ledgers = [fleet.tmp / f"{w}.ledger" for w in workers]
    audit = audit_run(fleet.run, ledgers, fleet.cfg.learner.group_size)
    rejected: dict[str, int] = {}
    for p in ledgers:
        for row in (json.loads(x) for x in p.read_text().splitlines()) if p.exists() else ():
            for k, v in row["rejected"].items():
                rejected[k] = rejected.get(k, 0) + v
    log = (fleet.run / "learner.log").read_text()  # (learner.err repeats its errors)
    return {
        "honest_acked_samples": len(audit.acked),
        "honest_rejected": rejected,
        "lost_acked_samples": len(audit.lost),
        "groups_trained_twice": audit.groups_trained_twice,
        "tracebacks": log.count("Traceback"),
        "crashed_lines": log.count("crashed"),
        "learner_log_mib": round((fleet.run / "learner.log").stat().st_size / 2**20, 2),
    }


def attack_run(
    tmp: Path, baseline: dict[str, Any], only: list[str] | None = None
) -> dict[str, Any]:
    fleet = Fleet(tmp)
    results = []
    try:
        fleet.start()
        sampler = Sampler({"learner": fleet.pid("learner"), "w0": fleet.pid("w0")})
        sampler.start()
        relay = fleet.relay_of("w0")
        token = fleet.token(8, "insider turned attacker")
        for name in [n for n in ORDER if (not only or n in only) and n not in OPEN_MODE]:
            if not fleet.alive("learner"):
                results.append({"attack": name, "outcome": "FAILED: learner not running"})
                continue
            if name == "banned":
                r = ban_phase(fleet, sampler)
            elif name in RELAY_PHASES:
                r = relay_phase(fleet, sampler, name, fleet.token(1, name))
            elif name == "patient_liar":
                r = __import__("drill_patient").patient_phase(fleet, sampler, fleet.token(1, name))
            else:
                before = token_state(fleet.run, token)
                r = run_attack(fleet, sampler, name, relay, token, TIMEOUT.get(name, 60))
                r["token_before"], r["token_after"] = before, token_state(fleet.run, token)
            if name == "impersonate":
                r["insider_token"] = token_state(fleet.run, token)
            r["baseline_threads"] = baseline.get("learner_threads_peak", 0)
            if r.get("steps_per_s") is not None:
                r["steps_vs_honest"] = round(
                    r["steps_per_s"] / max(baseline["steps_per_s"], 1e-9), 3
                )
            r["outcome"] = judge(r)
            results.append(r)
            print(f"{name}: {r['outcome']}", file=sys.stderr, flush=True)
        rcs = fleet.stop()
    finally:
        fleet.group.stop_all()
    return {
        "relay_attacked": relay[0],
        "attacks": results,
        "exit_codes": rcs,
        **final_checks(fleet),
    }


def open_mode_run(tmp: Path, only: list[str] | None = None) -> list[dict[str, Any]]:
    """Attacks that need ``security.join = "open"`` (Sybils), on a fleet of their own, judged
    against that fleet's own step rate measured just before."""
    names = [n for n in OPEN_MODE if not only or n in only]
    if not names:
        return []
    fleet = Fleet(
        tmp, [o for o in OVERRIDES if not o.startswith("security.join")] + ['security.join="open"']
    )
    results = []
    try:
        fleet.start()
        sampler = Sampler({"learner": fleet.pid("learner"), "w0": fleet.pid("w0")})
        sampler.start()
        s0, t0 = fleet.step(), time.monotonic()
        time.sleep(30)
        before = (fleet.step() - s0) / (time.monotonic() - t0)
        for name in names:
            r = run_attack(fleet, sampler, name, fleet.relay_of("w0"), "", TIMEOUT.get(name, 60))
            r["baseline_steps_per_s"] = round(before, 3)
            r["steps_vs_honest"] = round(r["steps_per_s"] / max(before, 1e-9), 3)
            r["outcome"] = judge(r)
            results.append(r)
            print(f"{name}: {r['outcome']}", file=sys.stderr, flush=True)
        fleet.stop()
    finally:
        fleet.group.stop_all()
    return results


def summarize(baseline: dict[str, Any], attacked: dict[str, Any]) -> dict[str, Any]:
    rss = max((r.get("learner_rss_mib_peak", 0) for r in attacked["attacks"]), default=0)
    return {
        "learner_rss_peak_mib": {
            "honest": baseline.get("learner_rss_mib_peak"),
            "attacked": rss,
            "ratio": round(rss / max(1, baseline.get("learner_rss_mib_peak", 1)), 3),
        },
        "rss_within_1_5x": rss <= RSS_LIMIT * baseline.get("learner_rss_mib_peak", 0),
        "nothing_acked_lost": attacked["lost_acked_samples"] == 0
        and baseline["lost_acked_samples"] == 0,
        "nothing_trained_twice": attacked["groups_trained_twice"] == 0,
        "no_traceback": attacked["tracebacks"] == 0 and attacked["crashed_lines"] == 0,
        # SIGTERM ends a learner like Ctrl-C: exit 130 ("interrupted; workers were told to stop")
        "learner_stopped_cleanly": attacked["exit_codes"].get("learner") == 130,
        "honest_workers_exit_0": all(attacked["exit_codes"].get(w) == 0 for w in ("w0", "w1")),
    }


def harmed(r: dict[str, Any]) -> str:
    """Honest workers harmed in a phase: struck, banned, dead or starved (delivered nothing)."""
    out = [f"{w} struck" for w in r.get("honest_struck", {})]
    out += [f"{w} banned" for w in r.get("reporters_banned", [])]
    if r.get("honest_alive") is False:
        out.append("one died")
    adm = r.get("honest_admitted")
    if adm is not None and min(adm.values(), default=0) <= 0:
        out.append("one delivered nothing")
    return ", ".join(out) or "none"


def print_table(
    baseline: dict[str, Any], attacked: dict[str, Any], summary: dict[str, Any]
) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"Security drill (honest run: {baseline['steps_per_s']:.2f} steps/s, "
        f"learner RSS peak {baseline.get('learner_rss_mib_peak')} MiB, "
        f"threads {baseline.get('learner_threads_peak')})"
    )
    for col in (
        "attack",
        "refused / neutralised",
        "counted by the learner",
        "s",
        "kept stepping (steps/s vs honest)",
        "RSS vs honest",
        "honest workers harmed",
    ):
        table.add_column(col, overflow="fold")
    base_rss = max(1, baseline.get("learner_rss_mib_peak") or 1)
    for r in attacked["attacks"]:
        counted = "; ".join(
            f"{k}: " + ", ".join(f"{a}={n}" for a, n in v.items())
            for k, v in r.get("counted", {}).items()
        )
        if r.get("relay_reports_delta"):
            counted += (
                ("; " if counted else "")
                + "relay_reports: "
                + ", ".join(f"{k}={n}" for k, n in r["relay_reports_delta"].items())
            )
        stepping = f"{'yes' if r.get('kept_stepping') else 'NO'} ({r.get('steps_vs_honest', '-')})"
        rss = r.get("learner_rss_mib_peak")
        table.add_row(
            r["attack"],
            r["outcome"],
            counted or "-",
            str(r.get("wall_s", "")),
            stepping,
            f"{rss / base_rss:.2f}" if rss else "-",
            harmed(r),
        )
    console = Console(width=220)
    console.print(table)
    console.print(summary)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline-s", type=float, default=60.0)
    ap.add_argument("--json", default=str(ROOT / "benchmarks/results/security_drill.json"))
    ap.add_argument(
        "--keep",
        default="",
        metavar="DIR",
        help="run the fleets in DIR/honest, DIR/attacked, DIR/open and keep them",
    )
    ap.add_argument(
        "--only",
        default="",
        help="comma-separated attacks (default: all, in order: " + ", ".join(ORDER) + ")",
    )
    args = ap.parse_args(argv)
    only = [n for n in args.only.split(",") if n]
    unknown = sorted(set(only) - set(ORDER))
    if unknown:
        ap.error(f"unknown attack(s) {unknown}: choose from {ORDER}")
    from echo_rl.core.machine import write_result

    t0 = time.monotonic()
    keep = Path(args.keep) if args.keep else None
    if keep is not None:
        for d in ("honest", "attacked", "open"):
            (keep / d).mkdir(parents=True, exist_ok=True)
    with (
        tempfile.TemporaryDirectory() as a,
        tempfile.TemporaryDirectory() as b,
        tempfile.TemporaryDirectory() as c,
    ):
        if keep is not None:  # run folders and logs kept for a look afterwards
            a, b, c = (str(keep / d) for d in ("honest", "attacked", "open"))
        baseline = honest_run(Path(a), args.baseline_s)
        print(f"honest run: {baseline}", file=sys.stderr, flush=True)
        attacked = attack_run(Path(b), baseline, only)
        attacked["attacks"] += open_mode_run(Path(c), only)
    summary = summarize(baseline, attacked)
    print_table(baseline, attacked, summary)
    write_result(
        args.json,
        {
            "overrides": OVERRIDES,
            "wall_s": round(time.monotonic() - t0, 1),
            "honest_run": baseline,
            "attacked_run": attacked,
            "summary": summary,
        },
    )
    failed = [r for r in attacked["attacks"] if r["outcome"] != "refused"]
    return 1 if failed or not all(v for k, v in summary.items() if isinstance(v, bool)) else 0


def attack_main(argv: list[str]) -> int:
    import drill_handbacks
    import drill_sybil
    from drill_attacks import ATTACKS as BASIC
    from drill_attacks import Target
    from drill_relays import ATTACKS as RELAYS

    ATTACKS = {
        **BASIC,
        **RELAYS,
        "sybil_flood": drill_sybil.sybil_flood,
        **{
            f.__name__: f
            for f in (
                drill_handbacks.forged_handback,
                drill_handbacks.cherry_pick,
                drill_handbacks.edge_holder,
            )
        },
    }

    ap = argparse.ArgumentParser(prog="security_drill.py attack")
    ap.add_argument("name", choices=sorted(ATTACKS))
    ap.add_argument("--line", required=True)
    ap.add_argument("--run-dir", type=Path, required=True)
    ap.add_argument("--relay", default="")
    ap.add_argument("--relay-key", default="")
    ap.add_argument("--token", default="")
    args = ap.parse_args(argv)
    target = Target(args.line, args.run_dir, args.relay, args.relay_key, args.token)
    target.max_message_mib = tomllib.loads((args.run_dir / "config.toml").read_text())["transport"][
        "max_message_mib"
    ]
    result = ATTACKS[args.name](target)
    print(json.dumps(result, default=str), flush=True)
    target.ctx.destroy(linger=0)
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["attack"]:
        sys.exit(attack_main(sys.argv[2:]))
    if sys.argv[1:2] in (["liars"], ["calibrate"]):  # lying workers: benchmarks/drill_liars.py
        import drill_liars

        sys.exit(
            (drill_liars.liars_main if sys.argv[1] == "liars" else drill_liars.calibrate_main)(
                sys.argv[2:]
            )
        )
    sys.exit(main())
