"""Does the fleet sample the policy the learner holds? Full fine-tuning of SmolLM2 on the
does-it-learn task with bf16 snapshots rounded to nearest, stochastically and dithered (the
default; ``broadcast.rounding``), side by side (issue 56; docs/does-it-learn.md, "Snapshot
precision").

The two runs and their evaluations (this script reads what they wrote):

    echo-rl quickstart --config examples/smollm2-full.toml --run-dir runs/full-nearest \\
        --set learner.max_steps=20 --set broadcast.rounding='"nearest"' &
    echo-rl quickstart --config examples/smollm2-full.toml --run-dir runs/full-stochastic \\
        --set learner.max_steps=20 --set broadcast.rounding='"stochastic"' &
    # once those two stopped (a third at once would not fit 2 cores well), the default:
    echo-rl quickstart --config examples/smollm2-full.toml --run-dir runs/full-dither \
        --set learner.max_steps=20
    # for R in nearest stochastic dither, once each stopped at step 20:
    echo-rl eval --run-dir runs/full-$R --as-sampled --compare latest --split heldout \\
        --samples 4 --threads 1 --json > /tmp/lag-$R.json       # sampled - learner
    echo-rl eval --run-dir runs/full-$R --compare untrained --split heldout \\
        --samples 4 --threads 1 --json > /tmp/rise-$R.json      # learner - untrained
    # the stochastic run's checkpoint cast to nearest, for contrast: a copy of its folder
    mkdir /tmp/sr-as-nearest && cp -r runs/full-stochastic/checkpoints /tmp/sr-as-nearest/
    sed 's/rounding = "stochastic"/rounding = "nearest"/' runs/full-stochastic/config.toml \
        > /tmp/sr-as-nearest/config.toml
    echo-rl eval --run-dir /tmp/sr-as-nearest --as-sampled --compare latest --split heldout \
        --samples 4 --threads 2 --json > /tmp/lag-stochastic-cast-nearest.json
    python benchmarks/snapshot_lag.py --run nearest=runs/full-nearest \\
        --run stochastic=runs/full-stochastic --eval-dir /tmp

Writes ``benchmarks/results/snapshot_lag.json`` (per run: training reward of the first and
last five steps, ``sampling_lag_kl`` per step, bytes per delta, the evaluations with their 95 %
intervals; the machine) and ``docs/img/snapshot-lag.png`` (training reward and sampling lag per
step), and prints a table.

The LoRA twin (examples/smollm2-lora.toml, 10 steps, bf16 dithered against float32 adapters):

    echo-rl quickstart --config examples/smollm2-lora.toml --run-dir runs/lora-dither \
        --set learner.max_steps=10 &
    echo-rl quickstart --config examples/smollm2-lora.toml --run-dir runs/lora-float32 \
        --set learner.max_steps=10 --set broadcast.dtype='"float32"' &
    # the same two evaluations of each into /tmp/lora/lag-NAME.json and rise-NAME.json
    python benchmarks/snapshot_lag.py --run bf16-dither=runs/lora-dither \
        --run float32=runs/lora-float32 --eval-dir /tmp/lora \
        --json benchmarks/results/snapshot_lag_lora.json --png docs/img/snapshot-lag-lora.png \
        --title "SmolLM2 LoRA r16, lr 5e-4: adapter snapshots"
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from echo_rl.core.machine import machine_info  # noqa: E402
from echo_rl.core.steprow import COL  # noqa: E402


def rows_of(run: Path) -> list[dict[str, Any]]:
    rows = []
    for line in (run / "metrics.jsonl").read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line being written when the run stopped
    return rows


def _eval(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    doc = json.loads(path.read_text())
    return {
        "policies": {p["policy"]: p["reward"] for p in doc["policies"]},
        "paired": doc.get("paired"),
    }


def summarise(name: str, run: Path, evals: Path) -> dict[str, Any]:
    rows = rows_of(run)
    reward = [r[COL.reward_mean] for r in rows]
    lag = [r.get(COL.sampling_lag_kl) for r in rows]
    deltas = [r[COL.publish_bytes] for r in rows if r.get(COL.publish_encoding) != "full"]
    changed = [r[COL.delta_changed] for r in rows if r.get(COL.publish_encoding) != "full"]
    first, last = reward[:5], reward[-5:]
    return {
        "run": name,
        "run_dir": str(run),
        "steps": len(rows),
        "rounding": name,
        "reward_per_step": reward,
        "reward_first5": round(statistics.mean(first), 4),
        "reward_last5": round(statistics.mean(last), 4),
        "sampling_lag_kl_per_step": lag,
        "sampling_lag_kl_mean_after_step_2": round(
            statistics.mean(x for x in lag[3:] if x is not None), 5
        ),
        "delta_bytes_mean": round(statistics.mean(deltas)) if deltas else None,
        "delta_changed_mean": round(statistics.mean(changed), 4) if changed else None,
        "bytes_per_version_last": rows[-1][COL.publish_bytes],
        "sampled_vs_learner": _eval(evals / f"lag-{name}.json"),
        # the same checkpoint cast to nearest (a copy of the run folder with
        # broadcast.rounding = "nearest"), where the run itself published otherwise
        "cast_to_nearest_vs_learner": _eval(evals / f"lag-{name}-cast-nearest.json"),
        "learner_vs_untrained": _eval(evals / f"rise-{name}.json"),
    }


def plot(runs: list[dict[str, Any]], png: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    for r in runs:
        steps = range(len(r["reward_per_step"]))
        top.plot(steps, r["reward_per_step"], marker="o", label=r["rounding"])
        lag = [float("nan") if x is None else x for x in r["sampling_lag_kl_per_step"]]
        bottom.plot(steps, lag, marker="o", label=r["rounding"])
    top.set_ylabel("training reward (4 x 8 samples)")
    top.set_title(title)
    bottom.set_ylabel("sampling lag (KL, nats/token)")
    bottom.set_xlabel("learner step")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", action="append", required=True, metavar="NAME=DIR")
    ap.add_argument("--eval-dir", type=Path, default=Path("/tmp"))
    ap.add_argument("--json", type=Path, default=ROOT / "benchmarks/results/snapshot_lag.json")
    ap.add_argument("--png", type=Path, default=ROOT / "docs/img/snapshot-lag.png")
    ap.add_argument("--title", default="SmolLM2 full fine-tuning, lr 1e-5, bf16 snapshots")
    args = ap.parse_args(argv)
    runs = [summarise(n, Path(d), args.eval_dir) for n, d in (x.split("=", 1) for x in args.run)]
    doc = {
        "command": "python benchmarks/snapshot_lag.py " + " ".join(sys.argv[1:]),
        "machine": machine_info(),
        "runs": runs,
    }
    args.json.write_text(json.dumps(doc, indent=1) + "\n")
    plot(runs, args.png, args.title)
    print(f"{'rounding':<11} {'reward 0-4':>10} {'last 5':>7} {'lag KL':>8} {'delta MB':>9}  eval")
    for r in runs:
        ev = r["sampled_vs_learner"] or {}
        paired = ev.get("paired") or {}
        print(
            f"{r['rounding']:<11} {r['reward_first5']:>10.3f} {r['reward_last5']:>7.3f} "
            f"{r['sampling_lag_kl_mean_after_step_2']:>8.4f} "
            f"{(r['delta_bytes_mean'] or 0) / 1e6:>9.1f}  sampled - learner "
            f"{paired.get('mean', float('nan')):+.3f} "
            f"[{paired.get('lo', float('nan')):+.3f}, {paired.get('hi', float('nan')):+.3f}]"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
