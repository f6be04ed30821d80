"""The long-tail cut on and off, for real (docs/scheduling.md, "Long-tail cut").

    .venv/bin/python benchmarks/tail_cut_real.py [--steps 40] [--workers 2] [--rounds 2]

The quickstart (``examples/quickstart.toml``: toy addition on the tiny model) with room for
long completions (``worker.max_new_tokens = 128``), as ``echo-rl quickstart`` on loopback,
``--rounds`` times each way, alternating: ``worker.tail_cut = 0`` (off) and ``--tail``
(default 0.75). The untrained model ends a sample with a small chance at every token, so
completion lengths have a long tail (printed first: the untrained model's lengths over
``--samples`` samples, through the worker's own backend).

Per run: learner steps per minute, its mean wait for a batch (``t_wait``), tokens trained per
step, what a worker completes per second of its busy time (``worker_busy_rate``, from its
heartbeats) and the mean busy time of a delivered batch, and the groups carried by tail cuts
(from the workers' status files). Prints a table; writes
benchmarks/results/tail_cut_real.json with the machine.
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

CONFIG = ROOT / "examples" / "quickstart.toml"
MAX_NEW = 128


def lengths(samples: int) -> dict[str, Any]:
    """The untrained model's completion lengths, sampled by the worker's backend."""
    from echo_rl.core import wire
    from echo_rl.core.config import load_config
    from echo_rl.worker.backends.transformers import TransformersBackend

    cfg = load_config(CONFIG, [f"worker.max_new_tokens={MAX_NEW}"])
    backend = TransformersBackend(cfg.model, threads=1)
    prompt = backend.tokenizer.encode("3+4=", add_special_tokens=False)
    out: list[int] = []
    for seed in range(samples // 32):
        g = wire.Group(group_id=str(seed), prompt_ids=prompt, n=32, seed=seed)
        out += [len(s.completion_ids) for s in backend.generate([g], MAX_NEW, 1.0)[0]]
    out.sort()
    q = lambda f: out[min(len(out) - 1, int(f * len(out)))]  # noqa: E731
    return {
        "samples": len(out),
        "mean": statistics.mean(out),
        "p50": q(0.5),
        "p75": q(0.75),
        "p90": q(0.9),
        "p99": q(0.99),
        "max": out[-1],
        "at_max_new_tokens": sum(n >= MAX_NEW for n in out) / len(out),
    }


def one_run(tail: float, steps: int, workers: int, folder: Path) -> dict[str, Any]:
    run_dir = folder / f"tail{tail}-{len(list(folder.iterdir()))}"
    argv = [
        sys.executable, "-m", "echo_rl.cli.rl", "quickstart", "--config", str(CONFIG),
        "--run-dir", str(run_dir), "--workers", str(workers),
        "--set", f"learner.max_steps={steps}", "--set", f"worker.max_new_tokens={MAX_NEW}",
        "--set", f"worker.tail_cut={tail}",
    ]  # fmt: skip
    subprocess.run(argv, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    rest = rows[1:]  # the first step waits for the workers to start
    last = rows[-1]
    carried = [
        json.loads(f.read_text()).get("tail_groups") or 0
        for f in (run_dir / "status").glob("*.json")
    ]
    return {
        "tail_cut": tail,
        "steps": len(rows),
        "steps_per_min": 60 * len(rest) / (last["wall_s"] - rows[0]["wall_s"]),
        "t_wait_mean": statistics.mean(r["t_wait"] for r in rest),
        "t_train_mean": statistics.mean(r["t_train"] for r in rest),
        "tokens_per_step": statistics.mean(r["tokens_trained"] for r in rest),
        # what a worker completes per second of its busy time (heartbeats; whole run), and the
        # mean busy time of the batches the records came in
        "worker_busy_rate": last["worker_busy_rate"],
        "gen_s_mean": statistics.mean(r["gen_s_mean"] or 0.0 for r in rest),
        "reward_last": statistics.mean(r["reward_mean"] for r in rows[-10:]),
        "tail_groups": sum(carried),
        "handbacks": last.get("handbacks"),
        "dropped_stale": last.get("dropped_stale"),
    }


def table(runs: list[dict[str, Any]]) -> str:
    lines = [
        f"{'tail_cut':>9}{'steps/min':>11}{'t_wait':>8}{'t_train':>9}{'tokens/step':>13}"
        f"{'traj/busy s':>13}{'batch s':>9}{'reward, last 10':>17}{'tail groups':>13}"
    ]
    for r in runs:
        lines.append(
            f"{r['tail_cut']:>9}{r['steps_per_min']:>11.1f}{r['t_wait_mean']:>8.2f}"
            f"{r['t_train_mean']:>9.2f}{r['tokens_per_step']:>13.0f}"
            f"{r['worker_busy_rate']:>13.1f}{r['gen_s_mean']:>9.3f}{r['reward_last']:>17.3f}"
            f"{r['tail_groups']:>13}"
        )
    for tail in sorted({r["tail_cut"] for r in runs}):
        mine = [r for r in runs if r["tail_cut"] == tail]
        med = lambda k, mine=mine: statistics.median(r[k] for r in mine)  # noqa: E731
        lines.append(
            f"median tail_cut={tail}: {med('steps_per_min'):.1f} steps/min, t_wait "
            f"{med('t_wait_mean'):.2f} s, {med('worker_busy_rate'):.1f} trajectories per busy "
            f"second of a worker, batches of {med('gen_s_mean'):.3f} s"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tail", type=float, default=0.75)
    ap.add_argument("--samples", type=int, default=512)
    ap.add_argument("--json", type=Path, default=ROOT / "benchmarks/results/tail_cut_real.json")
    args = ap.parse_args(argv)
    dist = lengths(args.samples)
    print(f"untrained completion lengths (tokens, max {MAX_NEW}): {dist}", flush=True)
    runs = alternate(
        (0.0, args.tail),
        args.rounds,
        lambda tail, tmp: one_run(tail, args.steps, args.workers, tmp),
        lambda r: (
            f"tail_cut={r['tail_cut']}: {r['steps_per_min']:.1f} steps/min, "
            f"t_wait {r['t_wait_mean']:.2f} s, tail groups {r['tail_groups']}"
        ),
        "echo-tail-cut-",
    )
    print(table(runs))
    save(
        args,
        "benchmarks/tail_cut_real.py",
        {"lengths_untrained": dist, "runs": runs, "table": table(runs)},
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
