"""An expensive reward checked on the learner's loop or off it, for real (docs/scheduling.md,
"A reward pool").

    .venv/bin/python benchmarks/reward_check_real.py [--steps 30] [--workers 2] [--rounds 2]

The code example (``examples/code.toml``: each sample's reward runs a sandboxed program) as
``echo-rl quickstart`` on loopback, ``--rounds`` times each way, alternating:

  * every: ``security.expensive_reward_check = "every"``: the learner recomputes each
    delivered reward at intake, on its control loop (as it does for a cheap reward);
  * sampled: the default: a thread recomputes the groups of workers on probation and
    ``security.reward_audit_rate`` of the others, off the loop.

Per run: steps per minute, the learner's mean wait for a batch (``t_wait``), its bubble ratio,
and how many rewards the learner recomputed. Prints a table; writes
benchmarks/results/reward_check_real.json with the machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.alternate import alternate, save  # noqa: E402

MODES = ("every", "sampled")


def one_run(mode: str, steps: int, workers: int, folder: Path) -> dict[str, Any]:
    run_dir = folder / f"{mode}-{len(list(folder.iterdir()))}"
    argv = [
        sys.executable, "-m", "echo_rl.cli.rl", "quickstart", "--config",
        str(ROOT / "examples" / "code.toml"), "--run-dir", str(run_dir), "--workers",
        str(workers), "--set", f"learner.max_steps={steps}",
        "--set", f"security.expensive_reward_check={mode}",
    ]  # fmt: skip
    subprocess.run(argv, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    audits = run_dir / "security" / "audits.jsonl"
    checks = [json.loads(x) for x in audits.read_text().splitlines()] if audits.exists() else []
    last = rows[-1]
    return {
        "mode": mode,
        "steps": len(rows),
        "steps_per_min": 60 * len(rows) / last["wall_s"],
        "t_wait_mean": statistics.mean(r["t_wait"] for r in rows),
        "t_train_mean": statistics.mean(r["t_train"] for r in rows),
        "bubble_ratio": last["bubble_ratio"],
        "rewards_recomputed_groups": sum(c["check"] == "reward" for c in checks),
        "admitted": last["admitted"],
        "reward_audit": last.get("reward_audit"),
    }


def table(runs: list[dict[str, Any]]) -> str:
    """Per run; ``other s``: a step's wall time less its train and batch-wait times, i.e. the
    learner waiting on its own control loop (statistics, publication) between steps."""
    lines = [
        f"{'check':10}{'steps/min':>11}{'s/step':>8}{'t_train':>9}{'t_wait':>8}{'other':>8}"
        f"{'bubble':>8}{'groups rechecked':>18}{'admitted':>10}"
    ]
    for r in runs:
        per = 60 / r["steps_per_min"]
        other = per - r["t_train_mean"] - r["t_wait_mean"]
        lines.append(
            f"{r['mode']:10}{r['steps_per_min']:>11.1f}{per:>8.2f}{r['t_train_mean']:>9.2f}"
            f"{r['t_wait_mean']:>8.2f}{other:>8.2f}{r['bubble_ratio']:>8.3f}"
            f"{r['rewards_recomputed_groups']:>18}{r['admitted'] // 8:>10}"
        )
    for mode in MODES:
        mine = [r for r in runs if r["mode"] == mode]
        lines.append(
            f"median {mode}: {statistics.median(r['steps_per_min'] for r in mine):.1f} steps/min, "
            f"t_wait {statistics.median(r['t_wait_mean'] for r in mine):.2f} s"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", type=Path, default=ROOT / "benchmarks/results/reward_check_real.json")
    args = ap.parse_args(argv)
    runs = alternate(
        MODES,
        args.rounds,
        lambda mode, tmp: one_run(mode, args.steps, args.workers, tmp),
        lambda r: (
            f"{r['mode']}: {r['steps_per_min']:.1f} steps/min, t_wait {r['t_wait_mean']:.2f} s"
        ),
        "echo-reward-check-",
    )
    print(table(runs))
    save(args, "benchmarks/reward_check_real.py", {"runs": runs, "table": table(runs)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
