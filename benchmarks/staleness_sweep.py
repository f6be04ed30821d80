"""Staleness as a control knob, measured: training quality and cost against S (docs/staleness.md).

    .venv/bin/python benchmarks/staleness_sweep.py [--s 0,1,2,3,5,8] [--seeds 3] [--is on,off]
        [--steps 150] [--workers 2] [--out benchmarks/results/staleness]

Quality: real training runs of the quickstart task (``examples/quickstart.toml``: toy-add on the
tiny Qwen3, a real learner and real worker processes on loopback, via ``echo-rl quickstart``),
one per (S, importance sampling on/off, seed). "IS on" is the default truncated importance
sampling (``learner.is_mode = "token_truncate"``, cap 2); "IS off" is ``is_mode = "none"`` (stale
samples trained as if on-policy). S = 0 is synchronous: only the current version's trajectories
train. The provisioner is off (every worker active), so each run gets the same fleet. Each run's
reward curve and final reward (mean of the last 10 steps' mean reward) are written to
``OUT/runs/S{S}-is{on|off}-seed{k}.json``.

Cost: for the same S values, the simulator's paper-scale scenario
(``examples/sim/table2-ablation.toml``: Qwen3-8B, T_train 1631.2 s, 16.4 GB snapshots, 24 RTX 5090
offers at $0.35-0.95/h, 0.28 trajectories/s each, an A100 learner at $3.06/h) with the
controller on: cost per step, bubble ratio and active workers per S.

Everything lands in ``OUT/sweep.json`` (with the machine it ran on) and a plot ``OUT/sweep.png``
(reward against step, one line per S, the seeds' range as a band, one panel per IS setting).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from echo_rl.core.steprow import COL, read_rows  # noqa: E402
from echo_rl.provisioning.sim.summary import SIM, SimSummary  # noqa: E402

IS_MODE = {"on": "token_truncate", "off": "none"}
LAST = 10  # final reward: mean of the last LAST steps' mean reward
SIM_SCENARIO = ROOT / "examples" / "sim" / "table2-ablation.toml"


def run_name(s: int, is_on: str, seed: int) -> str:
    return f"S{s}-is{is_on}-seed{seed}"


def train(s: int, is_on: str, seed: int, steps: int, workers: int, out: Path) -> dict[str, Any]:
    """One real training run; its reward curve and final reward. A run whose result file is
    already there (same steps) is read back, not run again: an interrupted sweep resumes."""
    path = out / "runs" / f"{run_name(s, is_on, seed)}.json"
    if path.exists():
        done = json.loads(path.read_text())
        if done.get("steps") == steps:
            return done
    with tempfile.TemporaryDirectory(prefix="echo-sweep-") as tmp:
        run_dir = Path(tmp) / "run"
        cmd = [
            sys.executable,
            "-m",
            "echo_rl.cli.rl",
            "quickstart",
            "--config",
            str(ROOT / "examples" / "quickstart.toml"),
            "--workers",
            str(workers),
            "--run-dir",
            str(run_dir),
            "--set",
            f"learner.max_steps={steps}",
            "--set",
            f"learner.staleness={s}",
            "--set",
            f'learner.is_mode="{IS_MODE[is_on]}"',
            "--set",
            f"seed={seed}",
            "--set",
            "provisioning.enabled=false",
        ]
        t0 = time.monotonic()
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3600)
        wall = time.monotonic() - t0
        rows = read_rows(run_dir / "metrics.jsonl")
        if proc.returncode != 0 or len(rows) < steps:
            log = (proc.stderr or "")[-2000:]
            raise RuntimeError(
                f"{run_name(s, is_on, seed)}: quickstart exited {proc.returncode} "
                f"after {len(rows)} of {steps} steps\n{log}"
            )
    rewards = [float(r.reward_mean) for r in rows]
    res = {  # the row's names (COL) for what comes from the rows
        "S": s,
        "is": is_on,
        "is_mode": IS_MODE[is_on],
        "seed": seed,
        "steps": len(rows),
        "wall_s": round(wall, 1),
        "rewards": [round(x, 5) for x in rewards],
        "final_reward": round(statistics.fmean(rewards[-LAST:]), 5),
        COL.staleness_max: max(int(r.staleness_max or 0) for r in rows),
        COL.bubble_ratio: rows[-1].bubble_ratio,
        "t_wait_s": round(sum(float(r.t_wait or 0) for r in rows[1:]), 2),
        "t_train_s": round(sum(float(r.t_train or 0) for r in rows[1:]), 2),
        COL.dropped_stale: rows[-1].dropped_stale,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=1))
    return res


def simulate(s: int) -> dict[str, Any]:
    """The paper-scale scenario at this S, controller on (what S costs at scale)."""
    from echo_rl.provisioning.sim.api import run_scenario
    from echo_rl.provisioning.sim.scenario import load_scenario

    scen = load_scenario(SIM_SCENARIO, [f"learner.staleness={s}", "provisioning.controller=true"])
    summary = SimSummary.from_json(run_scenario(scen, progress=False, machine=False)["summary"])
    keep = (
        SIM.kappa,
        SIM.cost_per_step_usd,
        SIM.bubble_ratio,
        SIM.active_mean,
        SIM.wait_s_per_step,
        SIM.t_bcast_mean_s,
        SIM.staleness_max,
    )
    return {"S": s, **{k: getattr(summary, k) for k in keep}}


def table(runs: list[dict[str, Any]], sims: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per S: final reward over seeds (IS on, off), and the simulator's cost."""
    rows = []
    for sim in sims:
        row: dict[str, Any] = {"S": sim["S"]}
        for is_on in IS_MODE:
            finals = [r["final_reward"] for r in runs if r["S"] == sim["S"] and r["is"] == is_on]
            if finals:
                row[f"final_is_{is_on}"] = {
                    "mean": round(statistics.fmean(finals), 4),
                    "min": min(finals),
                    "max": max(finals),
                    "n": len(finals),
                    "sd": round(statistics.stdev(finals), 4) if len(finals) > 1 else 0.0,
                }
        row.update(
            {
                k: sim[k]
                for k in (SIM.cost_per_step_usd, SIM.bubble_ratio, SIM.active_mean, SIM.kappa)
            }
        )
        rows.append(row)
    return rows


def plot(runs: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    panels = [k for k in IS_MODE if any(r["is"] == k for r in runs)]
    fig, axes = plt.subplots(
        1, len(panels), figsize=(6.5 * len(panels), 4.4), squeeze=False, sharey=True
    )
    values = sorted({r["S"] for r in runs})
    colours = plt.cm.viridis(np.linspace(0, 0.9, len(values)))
    for ax, is_on in zip(axes[0], panels):
        for s, c in zip(values, colours):
            curves = [r["rewards"] for r in runs if r["S"] == s and r["is"] == is_on]
            if not curves:
                continue
            n = min(len(x) for x in curves)
            arr = np.array([_smooth(x[:n]) for x in curves])
            steps = np.arange(n)
            ax.plot(steps, arr.mean(0), color=c, label=f"S = {s}")
            ax.fill_between(steps, arr.min(0), arr.max(0), color=c, alpha=0.15)
        ax.set_title(f"importance sampling {is_on} ({IS_MODE[is_on]})")
        ax.set_xlabel("learner step")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("mean reward (moving average of 10 steps)")
    axes[0][-1].legend(loc="lower right")
    fig.suptitle(
        "toy-add on the tiny Qwen3: reward against step per staleness budget S "
        "(band: min-max over seeds)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _smooth(x: list[float], k: int = LAST) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(x):
        acc += v - (x[i - k] if i >= k else 0.0)
        out.append(acc / min(i + 1, k))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--s", default="0,1,2,3,5,8", help="staleness budgets, comma-separated")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--is", dest="is_settings", default="on,off", help="on, off or on,off")
    p.add_argument("--steps", type=int, default=150, help="learner steps per run")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "staleness")
    p.add_argument("--no-train", action="store_true", help="only the simulator's side")
    args = p.parse_args(argv)
    values = [int(x) for x in args.s.split(",")]
    settings = [x for x in args.is_settings.split(",") if x]
    if any(v < 0 for v in values) or not set(settings) <= set(IS_MODE):
        print(
            "staleness_sweep.py: --s takes integers >= 0, --is takes on and/or off", file=sys.stderr
        )
        return 2
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from echo_rl.core.machine import write_result

    console = Console()
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    sims = [simulate(s) for s in values]
    jobs = [(s, i, k) for k in range(args.seeds) for s in values for i in settings]
    runs: list[dict[str, Any]] = []
    if not args.no_train:
        with Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total}"),
            TimeElapsedColumn(),
            console=console,
        ) as bar:
            task = bar.add_task("training runs", total=len(jobs))
            for s, is_on, seed in jobs:  # seeds outermost: a cut-short sweep covers every S
                bar.update(task, description=f"training {run_name(s, is_on, seed)}")
                runs.append(train(s, is_on, seed, args.steps, args.workers, args.out))
                bar.advance(task)
    rows = table(runs, sims)
    result = {
        "command": "benchmarks/staleness_sweep.py " + " ".join(argv or sys.argv[1:]),
        "wall_s": round(time.monotonic() - t0, 1),
        "task": "toy-add, examples/quickstart.toml",
        "steps": args.steps,
        "workers": args.workers,
        "seeds": args.seeds,
        "last_steps_averaged": LAST,
        "sim_scenario": str(SIM_SCENARIO.relative_to(ROOT)),
        "table": rows,
        "simulated": sims,
        "runs": [{k: v for k, v in r.items() if k != "rewards"} for r in runs],
    }
    write_result(args.out / "sweep.json", result, indent=1)
    if runs:
        plot(runs, args.out / "sweep.png")
    t = Table(title=f"staleness sweep ({result['wall_s']:.0f} s)")
    for col in (
        "S",
        "final reward, IS on",
        "final reward, IS off",
        "sim $/step",
        "sim bubble",
        "sim active workers",
    ):
        t.add_column(col, justify="right")
    for row in rows:
        fmt = lambda f: f"{f['mean']:.3f} ({f['min']:.3f}-{f['max']:.3f})" if f else "-"  # noqa: E731
        t.add_row(
            str(row["S"]),
            fmt(row.get("final_is_on")),
            fmt(row.get("final_is_off")),
            f"{row[SIM.cost_per_step_usd]:.3f}",
            f"{100 * row[SIM.bubble_ratio]:.2f} %",
            f"{row[SIM.active_mean]:.1f}",
        )
    console.print(t)
    console.print(f"wrote {args.out / 'sweep.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
