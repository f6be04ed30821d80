"""Join -> first install for a volunteer (issue 30): how long from ``echo-worker join`` to a
model that holds the learner's first snapshot, and where the time goes.

    python benchmarks/join_install.py [--runs 5] [--label after] [--tree DIR]
        [--json benchmarks/results/join_install.json]

    # the code before a change: a worktree of that commit, measured in turns with this one
    git worktree add --detach /tmp/echo-before c861546
    python benchmarks/join_install.py --tree /tmp/echo-before --label "before (c861546)"

Starts one learner on loopback (provisioning off, so every worker is active), then one worker
at a time: each is timed from its process start to the log line that says it installed its
first snapshot (the log's own timestamps, so polling the file costs nothing in the figure),
then stopped with SIGTERM and timed to its exit. The worker's own CPU seconds at the install
are kept beside the wall time: on a machine others load, they show what the worker spent. A worker that writes its ``first_install``
phases in the status file (join, model loaded, snapshot received) has them recorded too. The
result keeps the machine, and the load average before and after, since a busy machine
stretches every import. Each invocation appends one entry to the JSON file (a list).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from echo_rl.core.machine import machine_info
from echo_rl.core.procs import ProcessGroup, python_argv, wait_ready
from echo_rl.worker.status import read_status

INSTALLED = re.compile(r"^(\S+ \S+) INFO echo\.worker: installed snapshot v\d+", re.MULTILINE)
TIMEOUT_S = 180.0


def _stamp(text: str) -> float:
    """A log line's asctime (local time, milliseconds after a comma) as a Unix time."""
    return datetime.strptime(text, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def _wait_installed(log: Path, proc, deadline: float) -> float:
    """The Unix time the worker logged its first install (polls its log: a benchmark's
    observer, outside the measured interval)."""
    while time.time() < deadline:
        m = INSTALLED.search(log.read_text(errors="replace")) if log.exists() else None
        if m:
            return _stamp(m.group(1))
        if proc.poll() is not None:
            raise RuntimeError(f"worker exited ({proc.returncode}) before installing; see {log}")
        time.sleep(0.05)
    raise RuntimeError(f"no install within {TIMEOUT_S:.0f} s; see {log}")


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a live process (Linux /proc): on a machine others load,
    what the worker itself spent, which the wall clock does not show."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def one_worker(group: ProcessGroup, line: str, tmp: Path, i: int) -> dict:
    log, status = tmp / f"w{i}.log", tmp / f"w{i}.json"
    started = time.time()
    proc = group.start(
        f"w{i}",
        python_argv(
            "echo_rl.cli.worker",
            "join",
            line,
            "--id",
            f"w{i}",
            "--identity",
            str(tmp / f"w{i}.key"),
            "--status-file",
            str(status),
        ),
        log,
    )
    installed = _wait_installed(log, proc, started + TIMEOUT_S)
    cpu = cpu_s(proc.pid)  # read within 50 ms of the install (the poll period): an upper bound
    t0 = time.monotonic()
    group.stop(f"w{i}", timeout=60, sig=signal.SIGTERM)
    row = {
        "start_to_install_s": round(installed - started, 3),
        "worker_cpu_s": round(cpu, 2),
        "sigterm_exit_s": round(time.monotonic() - t0, 3),
    }
    if status.exists():
        first = read_status(status).first_install
        row["first_install"] = first.model_dump() if first else None
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=5, help="workers, one after another")
    p.add_argument(
        "--config",
        default=None,
        help="learner config (default: the tree's examples/quickstart.toml)",
    )
    p.add_argument(
        "--tree",
        type=Path,
        default=ROOT,
        help="the source tree whose learner and worker run (its modules win: they "
        "start with it as their working directory)",
    )
    p.add_argument(
        "--json", type=Path, default=ROOT / "benchmarks" / "results" / "join_install.json"
    )
    p.add_argument("--label", default="", help="what is measured (e.g. before/after a change)")
    args = p.parse_args(argv)
    args.config = args.config or str(args.tree / "examples" / "quickstart.toml")
    args.json = args.json.resolve()
    os.chdir(args.tree)
    tmp = Path(tempfile.mkdtemp(prefix="echo-join-install-"))
    load_before = os.getloadavg()
    group = ProcessGroup()
    try:
        learner = group.start(
            "learner",
            python_argv(
                "echo_rl.cli.rl",
                "learn",
                args.config,
                "--run-dir",
                str(tmp / "run"),
                "--set",
                "learner.max_steps=1000000",
                "--set",
                "provisioning.enabled=false",
            ),
            tmp / "learner.log",
            pipe_stdout=True,
        )
        line = wait_ready(learner, timeout=120)
        rows = [one_worker(group, line, tmp, i) for i in range(args.runs)]
    finally:
        group.stop_all()
    totals = [r["start_to_install_s"] for r in rows]
    out = {
        "label": args.label,
        "tree": str(args.tree),
        "config": args.config,
        "model": "tiny-qwen3 (quickstart)",
        "runs": rows,
        "start_to_install_s": {
            "median": statistics.median(totals),
            "min": min(totals),
            "max": max(totals),
        },
        "worker_cpu_s": {"median": statistics.median(r["worker_cpu_s"] for r in rows)},
        "sigterm_exit_s_max": max(r["sigterm_exit_s"] for r in rows),
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "machine": machine_info(),
        "when": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    kept = json.loads(args.json.read_text()) if args.json.exists() else []
    args.json.write_text(json.dumps([*kept, out], indent=1) + "\n")
    print(
        json.dumps(
            {
                k: out[k]
                for k in (
                    "label",
                    "start_to_install_s",
                    "worker_cpu_s",
                    "sigterm_exit_s_max",
                    "loadavg_before",
                    "loadavg_after",
                )
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
