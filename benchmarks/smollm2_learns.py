"""Does SmolLM2-135M-Instruct learn through Echo on this CPU? (issue 32, item 5)

    python benchmarks/smollm2_learns.py --run full=runs/smollm2-full --run lora=runs/smollm2-lora \
        [--eval full=/tmp/eval-full.json --eval lora=/tmp/eval-lora.json] \
        [--load-start "..." --load-end "..."] \
        [--png docs/img/smollm2-learns.png] [--json benchmarks/results/smollm2_learns.json]

Reads each run's ``metrics.jsonl`` (written by the learner, one row per step) and, optionally,
the ``echo-rl eval --compare untrained --json`` output of each run. Writes:

- a PNG of the training reward per step (and its 10-step moving mean) for every run;
- a JSON with, per run: steps, wall time, the reward of the first and last 10 steps, the bytes
  the learner published per version (``learner_bytes_sent`` differences: keyframes and deltas
  apart), ``t_bcast`` (mean and median), the evaluation (means, 95 % CIs, paired difference),
  and the machine (``echo_rl.core.machine.machine_info``) with the load averages given.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from echo_rl.core.machine import machine_info
from echo_rl.core.steprow import COL  # noqa: E402


def rows_of(run: Path) -> list[dict]:
    out = []
    for line in (run / "metrics.jsonl").read_text().splitlines():
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass  # a line being written when the run was stopped
    return out


def _mean(xs: list[float]) -> float | None:
    return round(sum(xs) / len(xs), 4) if xs else None


def reward_key(rows: list[dict]) -> str:
    for k in (COL.reward_mean, "reward", "mean_reward"):
        if any(k in r for r in rows):
            return k
    raise SystemExit(f"no reward column in metrics.jsonl (keys: {sorted(rows[0])[:40]})")


def summarise(name: str, run: Path) -> dict:
    rows = rows_of(run)
    if not rows:
        return {"run": name, "run_dir": str(run), "steps": 0}
    rk = reward_key(rows)
    rew = [r[rk] for r in rows if r.get(rk) is not None]
    sent = [r.get(COL.learner_bytes_sent) for r in rows]
    per_version = [
        b - a for a, b in itertools.pairwise(sent) if a is not None and b is not None and b > a
    ]
    enc: dict[str, list[int]] = {}
    for r in rows:
        if r.get(COL.publish_bytes):
            enc.setdefault(str(r.get(COL.publish_encoding)), []).append(int(r[COL.publish_bytes]))
    first = sent[0] if sent and sent[0] else None
    tb = [r[COL.t_bcast] for r in rows if r.get(COL.t_bcast) is not None]
    wall = [r.get("wall_s") or r.get("time_s") or r.get("elapsed_s") for r in rows]
    out = {
        "run": name,
        "run_dir": str(run),
        "steps": len(rows),
        "reward_key": rk,
        "reward_first3": _mean(rew[:3]),
        "reward_last3": _mean(rew[-3:]),
        "reward_first10": _mean(rew[:10]),
        "reward_last10": _mean(rew[-10:]),
        "reward_per_step": [round(x, 4) for x in rew],
        "learner_bytes_sent_total": sent[-1] if sent else None,
        "bytes_first_row": first,
        "bytes_per_version": {
            "n": len(per_version),
            "max": max(per_version) if per_version else None,
            "min": min(per_version) if per_version else None,
            "median": statistics.median(per_version) if per_version else None,
            "mean": round(statistics.mean(per_version)) if per_version else None,
        },
        "publish_bytes_by_encoding": {
            k: {"n": len(v), "min": min(v), "max": max(v), "mean": round(statistics.mean(v))}
            for k, v in enc.items()
        },
        COL.publish_full_bytes: rows[-1].get(COL.publish_full_bytes),
        "t_bcast_s": {
            "n": len(tb),
            "mean": _mean(tb),
            "median": round(statistics.median(tb), 4) if tb else None,
            "max": round(max(tb), 4) if tb else None,
        },
        "wall_s_last": wall[-1] if wall and wall[-1] is not None else None,
    }
    return out


def plot(runs: dict[str, list[float]], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6), dpi=110)
    for (name, rew), color in zip(runs.items(), ("tab:blue", "tab:orange", "tab:green")):
        xs = list(range(len(rew)))
        ax.plot(xs, rew, color=color, alpha=0.5, lw=1, marker="o", ms=3, label=f"{name} (per step)")
        mov = [
            sum(rew[max(0, i - 9) : i + 1]) / len(rew[max(0, i - 9) : i + 1])
            for i in range(len(rew))
        ]
        ax.plot(xs, mov, color=color, lw=2, label=f"{name} (running mean, 10 steps)")
    ax.set_xlabel("learner step (4 prompts x 8 samples)")
    ax.set_ylabel("training reward")
    ax.set_ylim(0, 1)
    ax.set_title("SmolLM2-135M-Instruct, single-digit additions, 2-core CPU")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", action="append", default=[], help="NAME=RUN_DIR (repeatable)")
    ap.add_argument("--eval", action="append", default=[], help="NAME=EVAL_JSON (repeatable)")
    ap.add_argument("--load-start", default=None, help="`uptime` when the runs started")
    ap.add_argument("--load-end", default=None, help="`uptime` when the runs were stopped")
    ap.add_argument("--note", default=None)
    ap.add_argument("--png", default="docs/img/smollm2-learns.png")
    ap.add_argument("--json", default="benchmarks/results/smollm2_learns.json")
    args = ap.parse_args()
    evals = dict(e.split("=", 1) for e in args.eval)
    res = {
        "task": "single-digit addition (examples/data/add1*.jsonl), math adapter",
        "machine": machine_info(),
        "load_start": args.load_start,
        "load_end": args.load_end,
        "note": args.note,
        "runs": [],
    }
    curves = {}
    for spec in args.run:
        name, path = spec.split("=", 1)
        s = summarise(name, Path(path))
        cfg = Path(path) / "config.toml"
        s["config"] = cfg.read_text() if cfg.is_file() else None
        if name in evals:
            ev = json.loads(Path(evals[name]).read_text())
            for p in ev.get("policies", []):
                p.pop("per_prompt", None)
            s["eval"] = ev
        curves[name] = s.get("reward_per_step", [])
        res["runs"].append(s)
        print(
            f"{name}: {s['steps']} steps, reward first3 {s.get('reward_first3')} last3 "
            f"{s.get('reward_last3')}, by encoding {s.get('publish_bytes_by_encoding')}, bytes/version {s.get('bytes_per_version')}, "
            f"t_bcast {s.get('t_bcast_s')}"
        )
    plot(curves, Path(args.png))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {args.png} and {args.json}")


if __name__ == "__main__":
    main()
