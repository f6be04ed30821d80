"""Does the quickstart learn regardless of luck? (issue 32, item 6)

    python benchmarks/quickstart_seeds.py [--seeds 0 1 2 3 4] [--config examples/quickstart.toml]
        [--set KEY=VALUE ...] [--label before] [--json benchmarks/results/quickstart_seeds.json]

Runs ``echo-rl quickstart`` once per seed, one after another (the machine is shared: parallel
runs would slow each other and change staleness), with ``--set seed=N --set model.seed=N`` so
both the prompt order and the tiny model's initialisation change. From each run's
``metrics.jsonl`` it keeps the reward of the first and last 10 steps, the reward every 50
steps, the policy entropy and the clipped-token share, and the wall time; with the load
average before and after each run and the machine. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from echo_rl.core.machine import machine_info
from echo_rl.core.steprow import COL  # noqa: E402

TARGET = 0.6  # issue 32: every seed's last-10 reward at least this
RUN_TIMEOUT_S = 900


def _mean(rows: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return round(sum(vals) / len(vals), 4) if vals else None


def summarise(rows: list[dict]) -> dict:
    """The figures kept from one run's metrics rows."""
    return {
        "steps": len(rows),
        "reward_first10": _mean(rows[:10], COL.reward_mean),
        "reward_last10": _mean(rows[-10:], COL.reward_mean),
        "reward_every50": [
            _mean(rows[i : i + 10], COL.reward_mean) for i in range(0, len(rows), 50)
        ],
        "entropy_first10": _mean(rows[:10], COL.entropy_est),
        "entropy_last10": _mean(rows[-10:], COL.entropy_est),
        "entropy_every50": [
            _mean(rows[i : i + 10], COL.entropy_est) for i in range(0, len(rows), 50)
        ],
        "clip_frac_mean": _mean(rows, COL.clip_frac),
        "grad_norm_last10": _mean(rows[-10:], COL.grad_norm),
        COL.staleness_mean: _mean(rows, COL.staleness_mean),
        "wall_s": rows[-1]["wall_s"] if rows else None,
        # the learner's audits of the workers' log-probs and rewards, and how many failed
        "audits": max((r.get("audits") or 0 for r in rows), default=0),
        "audit_failures": max((r.get("audit_failures") or 0 for r in rows), default=0),
    }


def one_seed(seed: int, config: str, sets: list[str], tmp: Path) -> dict:
    run_dir = tmp / f"seed-{seed}"
    argv = [
        sys.executable,
        "-m",
        "echo_rl.cli.rl",
        "quickstart",
        "--config",
        config,
        "--run-dir",
        str(run_dir),
        "--set",
        f"seed={seed}",
        "--set",
        f"model.seed={seed}",
    ]
    for s in sets:
        argv += ["--set", s]
    load_before = os.getloadavg()
    t0 = time.monotonic()
    with (tmp / f"seed-{seed}.out").open("w") as out:
        rc = subprocess.run(
            argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, timeout=RUN_TIMEOUT_S, check=False
        ).returncode
    metrics = run_dir / "metrics.jsonl"
    rows = (
        [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
        if metrics.exists()
        else []
    )
    return {
        "seed": seed,
        "rc": rc,
        "run_dir": str(run_dir),
        **summarise(rows),
        "process_s": round(time.monotonic() - t0, 1),
        "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
    }


def table(runs: list[dict]) -> str:
    head = f"{'seed':>4} {'first10':>8} {'last10':>7} {'H first':>8} {'H last':>7} {'clip':>6} {'wall s':>7} {'load':>5} {'audits':>6} {'failed':>6}"
    lines = [head]
    for r in runs:

        def f(v, w, p=3):
            return f"{v:>{w}.{p}f}" if isinstance(v, (int, float)) else f"{'-':>{w}}"

        lines.append(
            f"{r['seed']:>4} {f(r['reward_first10'], 8)} {f(r['reward_last10'], 7)} "
            f"{f(r['entropy_first10'], 8)} {f(r['entropy_last10'], 7)} "
            f"{f(r['clip_frac_mean'], 6, 4)} {f(r['wall_s'], 7, 0)} {r['loadavg_before'][0]:>5.2f} "
            f"{r.get('audits', 0):>6} {r.get('audit_failures', 0):>6}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    p.add_argument("--config", default="examples/quickstart.toml")
    p.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config override for every run (repeatable)",
    )
    p.add_argument("--label", default="", help="what is measured (e.g. before/after a change)")
    p.add_argument(
        "--json", type=Path, default=ROOT / "benchmarks" / "results" / "quickstart_seeds.json"
    )
    args = p.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="echo-seeds-"))
    runs = []
    for seed in args.seeds:
        runs.append(one_seed(seed, args.config, args.sets, tmp))
        print(table(runs[-1:]).splitlines()[-1], flush=True)
    last = [r["reward_last10"] for r in runs if r["reward_last10"] is not None]
    out = {
        "label": args.label,
        "config": args.config,
        "overrides": args.sets,
        "target_last10": TARGET,
        "runs": runs,
        "last10": {
            "min": min(last, default=None),
            "max": max(last, default=None),
            "mean": round(statistics.mean(last), 4) if last else None,
            "all_at_least_target": bool(last) and len(last) == len(runs) and min(last) >= TARGET,
        },
        "machine": machine_info(),
        "when": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=1) + "\n")
    print(table(runs))
    print(
        f"last-10 reward: min {out['last10']['min']}, max {out['last10']['max']}, "
        f"mean {out['last10']['mean']}; all >= {TARGET}: {out['last10']['all_at_least_target']}"
    )
    print(f"wrote {args.json}; runs in {tmp}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
