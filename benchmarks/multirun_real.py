"""Two runs on one fleet, for real (issue 35, docs/multirun.md).

    python benchmarks/multirun_real.py [--seconds 150] [--workers 4]
        [--config examples/quickstart.toml] [--json benchmarks/results/multirun_real.json]

Two learners (the config at seeds 0 and 1) and ``--workers`` worker processes on loopback,
measured back to back on this machine, each case for ``--seconds`` from the moment its
learners are ready:

  * shared: every worker joined to both runs (``echo-worker join LINE_A LINE_B``);
  * split: the same workers split between the runs (half each), as dedicated fleets;
  * alone-a, alone-b: each run with all the workers to itself, one after the other.

Per case and run: steps, steps per minute, reward of the first and last 10 steps; per case
the fleet's idle fraction (the workers' device idle share, from their status files) and
worker-seconds per step (what a step costs when the fleet is paid by the second). Prints a
table and writes JSON with the machine.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from echo_rl.core.machine import write_result  # noqa: E402
from echo_rl.core.procs import ProcessGroup, python_argv, wait_ready  # noqa: E402
from echo_rl.core.steprow import COL  # noqa: E402
from echo_rl.worker.status import read_status  # noqa: E402

SEEDS = {"a": 0, "b": 1}


def _learner(group: ProcessGroup, tmp: Path, run: str, config: Path) -> str:
    seed = SEEDS[run]
    argv = python_argv(
        "echo_rl.cli.rl", "learn", str(config), "--run-dir", str(tmp / run),
        "--set", f"seed={seed}", "--set", f"model.seed={seed}",
        "--set", "learner.max_steps=100000",
    )  # fmt: skip
    proc = group.start(f"learner-{run}", argv, tmp / f"learner-{run}.log", pipe_stdout=True)
    return wait_ready(proc, timeout=180)


def _worker(group: ProcessGroup, tmp: Path, i: int, lines: list[str]) -> None:
    argv = python_argv(
        "echo_rl.cli.worker", "join", *lines, "--id", f"w{i}", "--plain",
        "--identity", str(tmp / f"w{i}.key"), "--status-file", str(tmp / f"w{i}.json"),
    )  # fmt: skip
    group.start(f"w{i}", argv, tmp / f"w{i}.log")


def _rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    # whole lines only: the learner may be writing the last one while we poll
    return [json.loads(x) for x in path.read_text().split("\n")[:-1]]


def _mean(rows: list[dict]) -> float | None:
    vals = [r[COL.reward_mean] for r in rows if r.get(COL.reward_mean) is not None]
    return round(sum(vals) / len(vals), 4) if vals else None


def _idle(tmp: Path) -> float | None:
    """The fleet's idle fraction: each worker's device idle share (a shared worker's status
    files all carry its device's), averaged over the workers."""
    per_worker: dict[str, float] = {}
    for f in sorted(tmp.glob("w*.json")):
        doc = read_status(f)
        if doc.sharing is not None:
            per_worker[str(doc.worker_id)] = doc.sharing.idle_fraction
    return round(sum(per_worker.values()) / len(per_worker), 4) if per_worker else None


def run_case(name: str, plan: dict[str, list[int]], args: argparse.Namespace) -> dict:
    """``plan``: run -> the workers joined to it (a worker in two lists serves both)."""
    tmp = Path(tempfile.mkdtemp(prefix=f"multirun-{name}-"))
    group = ProcessGroup()
    print(f"[{name}] {plan}", flush=True)
    try:
        lines = {run: _learner(group, tmp, run, args.config) for run in plan}
        t0 = time.monotonic()
        workers = sorted({w for ws in plan.values() for w in ws})
        for w in workers:
            _worker(group, tmp, w, [lines[r] for r in plan if w in plan[r]])
        while time.monotonic() - t0 < args.seconds:
            time.sleep(1.0)  # a measuring window, not a wait for an event
            done = {r: len(_rows(tmp / r)) for r in plan}
            print(f"[{name}] {time.monotonic() - t0:5.0f} s: steps {done}", flush=True)
        wall = time.monotonic() - t0
        idle = _idle(tmp)  # before the stop: the status files as the workers last wrote them
        for w in workers:
            group.stop(f"w{w}", timeout=20, sig=signal.SIGTERM)
    finally:
        group.stop_all()
    runs = {}
    for run in plan:
        rows = _rows(tmp / run)
        runs[run] = {
            "workers": len(plan[run]),
            "steps": len(rows),
            "steps_per_min": round(60 * len(rows) / wall, 2),
            "reward_first10": _mean(rows[:10]),
            "reward_last10": _mean(rows[-10:]),
        }
    steps = sum(r["steps"] for r in runs.values())
    return {
        "case": name,
        "wall_s": round(wall, 1),
        "workers": len(workers),
        "fleet_idle_fraction": idle,
        "worker_s_per_step": round(len(workers) * wall / steps, 2) if steps else None,
        "runs": runs,
        "folder": str(tmp),
    }


def table(cases: list[dict]) -> str:
    head = f"{'case':9} {'run':3} {'workers':>7} {'steps':>5} {'steps/min':>9} {'reward first10':>14} {'last10':>6} {'fleet idle':>10} {'worker-s/step':>13}"
    out = [head, "-" * len(head)]
    for c in cases:
        for run, r in c["runs"].items():
            out.append(
                f"{c['case']:9} {run:3} {r['workers']:>7} {r['steps']:>5} {r['steps_per_min']:>9} "
                f"{r['reward_first10']!s:>14} {r['reward_last10']!s:>6} "
                f"{c['fleet_idle_fraction']!s:>10} {c['worker_s_per_step']!s:>13}"
            )
    return "\n".join(out)


def medians(cases: list[dict]) -> dict[str, dict]:
    """Per case: the median (and range) over the repeats of all runs' steps per minute, the
    fleet's idle fraction and worker-seconds per step."""
    out: dict[str, dict] = {}
    for name in dict.fromkeys(c["case"] for c in cases):
        mine = [c for c in cases if c["case"] == name]
        rates = [sum(r["steps_per_min"] for r in c["runs"].values()) for c in mine]
        idle = [c["fleet_idle_fraction"] for c in mine if c["fleet_idle_fraction"] is not None]
        cost = [c["worker_s_per_step"] for c in mine if c["worker_s_per_step"] is not None]
        out[name] = {
            "repeats": len(mine),
            "steps_per_min_all_runs": statistics.median(rates),
            "steps_per_min_range": [min(rates), max(rates)],
            "fleet_idle_fraction": statistics.median(idle) if idle else None,
            "worker_s_per_step": statistics.median(cost) if cost else None,
            "worker_s_per_step_range": [min(cost), max(cost)] if cost else None,
        }
    return out


def summary_table(summary: dict[str, dict]) -> str:
    out = [
        f"{'case':9} {'repeats':>7} {'steps/min, all runs':>20} {'range':>15} {'fleet idle':>10} {'worker-s/step':>13}"
    ]
    for name, m in summary.items():
        lo, hi = m["steps_per_min_range"]
        out.append(
            f"{name:9} {m['repeats']:>7} {m['steps_per_min_all_runs']:>20.1f} "
            f"{f'{lo:.1f}-{hi:.1f}':>15} {m['fleet_idle_fraction']!s:>10} "
            f"{m['worker_s_per_step']!s:>13}"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=150.0)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--config", type=Path, default=ROOT / "examples" / "quickstart.toml")
    p.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "multirun_real.json"))
    p.add_argument("--cases", default="shared,split,alone-a,alone-b", help="which, in order")
    p.add_argument("--repeat", type=int, default=1, help="rounds of the cases, alternating")
    args = p.parse_args(argv)
    n, half = args.workers, args.workers // 2
    everyone = list(range(n))
    plans = {
        "shared": {"a": everyone, "b": everyone},
        "split": {"a": everyone[:half], "b": everyone[half:]},
        "alone-a": {"a": everyone},
        "alone-b": {"b": everyone},
    }
    unknown = set(args.cases.split(",")) - set(plans)
    if unknown:
        p.error(f"--cases: unknown {sorted(unknown)}; choose from {', '.join(plans)}")
    cases = []
    for i in range(args.repeat):  # the cases alternate, so slow minutes of the host fall on all
        for name in args.cases.split(","):
            cases.append({**run_case(name, plans[name], args), "repeat": i})
    print(table(cases))
    summary = medians(cases)
    print(summary_table(summary))
    write_result(
        args.json,
        {"command": " ".join(["python", "benchmarks/multirun_real.py", *(argv or sys.argv[1:])]),
         "seconds": args.seconds, "config": str(args.config), "repeat": args.repeat,
         "medians": summary, "cases": cases},
    )  # fmt: skip
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
