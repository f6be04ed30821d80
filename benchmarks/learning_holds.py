"""Learning that holds (issue 51, item 3): SmolLM2-135M-Instruct with LoRA on single-digit tasks,
old defaults against new, held-out at the start, at the best checkpoint and at the end.

    python examples/data/make_tasks.py                       # mul1, sub1, max1 (shipped)
    python benchmarks/learning_holds.py run --task mul1 --mode new --seed 0 [--steps 60]
    python benchmarks/learning_holds.py table runs/holds/* \
        [--json benchmarks/results/learning_holds.json] [--png docs/img/learning-holds.png]

``run`` is ``echo-rl quickstart --config examples/smollm2-lora.toml`` on the task's files with
``learner.heldout.every = 10`` (the run's own held-out evaluation: 30 prompts x 4 samples, the
same prompts and seeds at every evaluation, echo_rl/learner/heldout.py), the run folder
``runs/holds/TASK-MODE-sSEED``. Modes:

- ``old``: examples/smollm2-lora.toml as it shipped before issue 51 (beta 0, a symmetric clip
  of 0.2, every group trained);
- ``new``: ``learner.beta = 0.1``, ``learner.epsilon_high = 0.28``, ``learner.dynamic_sampling =
  true`` (the example's settings since).

``table`` reads each run folder's ``heldout.jsonl`` (the score after 0 steps is the untrained
policy's; the paired differences against it are over the same prompts and seeds, echo_rl/core/ci.py)
and ``metrics.jsonl`` (entropy, groups that scored alike, collapse warnings), and prints the
table docs/does-it-learn.md shows.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from echo_rl.core.ci import paired_ci  # noqa: E402
from echo_rl.core.machine import machine_info  # noqa: E402

MODES = {
    "old": ["learner.beta=0", "learner.epsilon_high=0", "learner.dynamic_sampling=false"],
    "new": ["learner.beta=0.1", "learner.epsilon_high=0.28", "learner.dynamic_sampling=true"],
}


def run_command(task: str, mode: str, seed: int, steps: int, runs: Path) -> list[str]:
    sets = [
        f'adapter.options.path="examples/data/{task}.jsonl"',
        f'adapter.options.heldout_path="examples/data/{task}_heldout.jsonl"',
        f"seed={seed}",
        f"learner.max_steps={steps}",
        "learner.heldout.every=10",
        *MODES[mode],
    ]
    cmd = ["echo-rl", "quickstart", "--config", "examples/smollm2-lora.toml"]
    cmd += ["--run-dir", str(runs / f"{task}-{mode}-s{seed}")]
    for s in sets:
        cmd += ["--set", s]
    return cmd


def summarise(run: Path) -> dict[str, Any]:
    scores = [json.loads(x) for x in (run / "heldout.jsonl").read_text().splitlines() if x.strip()]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    start = next(s for s in scores if s["steps"] == 0)
    end = max(scores, key=lambda s: s["steps"])
    best = max(scores, key=lambda s: s["mean"])  # the first of equals, as the learner keeps

    def ci(s: dict[str, Any]) -> dict[str, Any]:
        d = paired_ci(start["per_prompt"], s["per_prompt"])
        return {
            "steps": s["steps"],
            "mean": s["mean"],
            "lo": s["lo"],
            "hi": s["hi"],
            "vs_untrained": {"mean": d.mean, "lo": d.lo, "hi": d.hi},
        }

    task, mode, seed = run.name.rsplit("-", 2)
    ent = [r["entropy_est"] for r in rows if r.get("entropy_est") is not None]
    return {
        "run": run.name,
        "task": task,
        "mode": mode,
        "seed": int(seed.lstrip("s")),
        "steps": len(rows),
        "wall_s": rows[-1].get("wall_s") if rows else None,
        "untrained": {k: start[k] for k in ("mean", "lo", "hi")},
        "best": ci(best),
        "end": ci(end),
        "curve": [{"steps": s["steps"], "mean": s["mean"]} for s in scores],
        "entropy_first5": sum(ent[:5]) / max(1, len(ent[:5])),
        "entropy_last5": sum(ent[-5:]) / max(1, len(ent[-5:])),
        "collapse_warned_steps": [r["step"] for r in rows if r.get("collapse")],
        "reward_last10": sum(r["reward_mean"] for r in rows[-10:]) / max(1, len(rows[-10:])),
    }


def table(results: list[dict[str, Any]]) -> str:
    out = [
        "| task | mode | seed | steps | untrained | best (step) | end | end - untrained (paired) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        u, b, e = r["untrained"], r["best"], r["end"]
        d = e["vs_untrained"]
        out.append(
            f"| {r['task']} | {r['mode']} | {r['seed']} | {r['steps']} | "
            f"{u['mean']:.3f} [{u['lo']:.3f}, {u['hi']:.3f}] | "
            f"{b['mean']:.3f} [{b['lo']:.3f}, {b['hi']:.3f}] ({b['steps']}) | "
            f"{e['mean']:.3f} [{e['lo']:.3f}, {e['hi']:.3f}] | "
            f"{d['mean']:+.3f} [{d['lo']:+.3f}, {d['hi']:+.3f}] |"
        )
    return "\n".join(out)


def plot(results: list[dict[str, Any]], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = sorted({r["task"] for r in results})
    fig, axes = plt.subplots(1, len(tasks), figsize=(5 * len(tasks), 3.6), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        for r in results:
            if r["task"] != task:
                continue
            xs = [c["steps"] for c in r["curve"]]
            ys = [c["mean"] for c in r["curve"]]
            style = "-" if r["mode"] == "new" else "--"
            ax.plot(xs, ys, style, marker="o", label=f"{r['mode']} s{r['seed']}")
        ax.set_title(f"{task}: held-out score (30 prompts x 4)")
        ax.set_xlabel("learner steps")
        ax.set_ylim(0, 1)
        ax.legend()
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--task", required=True)
    r.add_argument("--mode", choices=sorted(MODES), required=True)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--steps", type=int, default=60)
    r.add_argument("--runs", type=Path, default=Path("runs/holds"))
    t = sub.add_parser("table")
    t.add_argument("run_dirs", nargs="+", type=Path)
    t.add_argument("--json", type=Path)
    t.add_argument("--png", type=Path)
    args = ap.parse_args()
    if args.cmd == "run":
        cmd = run_command(args.task, args.mode, args.seed, args.steps, args.runs)
        print(" ".join(cmd), flush=True)
        exe = Path(sys.executable).with_name("echo-rl")
        os.execv(str(exe), [str(exe), *cmd[1:]])
    results = [summarise(d) for d in sorted(args.run_dirs) if (d / "heldout.jsonl").exists()]
    print(table(results))
    if args.json:
        args.json.write_text(
            json.dumps({"machine": machine_info(), "runs": results}, indent=1) + "\n"
        )
    if args.png:
        plot(results, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
