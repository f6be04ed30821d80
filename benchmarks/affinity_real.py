"""Hardware-affinity routing on and off, for real (docs/scheduling.md, "Affinity").

    .venv/bin/python benchmarks/affinity_real.py [--steps 40] [--rounds 2] [--fast 1]
        [--slow 2] [--fast-slowdown 3] [--slowdown 12] [--short 8] [--long-share 0.25]

A learner and workers on loopback, the quickstart (``examples/quickstart.toml``: toy addition
on the tiny model) with a mix of tasks: ``--long-share`` of the addition pairs (a fixed set)
may run to ``worker.max_new_tokens = 128``, the others are short tasks with a budget of
``--short`` tokens (toy-add's ``short_tokens``). The untrained model ends a sample with a small
chance at every token, so a long task's group runs many times longer than a short one's: a
length distribution with a real tail, printed first (through the worker's own backend).
Workers run through ``labs.slow_device``: ``--fast`` of them ``--fast-slowdown`` times slower
than this machine and ``--slow`` of them ``--slowdown`` times slower (each rollout then takes
that many times as long, the extra time asleep, as a slower device's would). Both are slowed so
that rollouts, not the learner's step, set the pace, as in RL post-training generally: on this
machine's CPUs the tiny model's step would otherwise outlast the rollouts it trains on. ``--rounds`` times each way, alternating: ``learner.affinity`` false and true.

The learner's lr is 1e-9: the policy holds still, so completion lengths do not drift (learning
runs' did, by half, from run to run), and what differs between the modes is the routing.

Per run: learner steps per minute (after the first step), its mean wait for a batch
(``t_wait``), tokens trained per step and per minute, the affinity counts of the last step row (prompts routed
out of order, taken for their age) and the slow workers' share of the groups admitted. Prints
a table; writes benchmarks/results/affinity_real.json with the machine.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.alternate import alternate, save  # noqa: E402
from echo_rl.core.procs import ProcessGroup, python_argv, wait_ready  # noqa: E402

CONFIG = ROOT / "examples" / "quickstart.toml"
MAX_NEW = 128
# lr 1e-9 holds the policy still: its completion lengths then do not drift within or between
# runs (a learning run's did: tokens per step 2.9k-4.6k), so what differs is the routing alone
LEARNER = {"updates_per_step": 1, "beta": 0.0, "prompts_per_step": 16, "max_outstanding_groups": 32,
           "lr": 1e-9}  # fmt: skip


def config(folder: Path, args: argparse.Namespace, affinity: bool) -> Path:
    """The quickstart with the task mix, room for long completions and the switch."""
    text = CONFIG.read_text()
    text = text.replace(
        "max_sum = 9\n",
        f"max_sum = 9\nshort_tokens = {args.short}\nlong_share = {args.long_share}\n",
    )
    text = text.replace(
        "generation = { max_new_tokens = 4 }", f"generation = {{ max_new_tokens = {MAX_NEW} }}"
    )
    # a learner step cheaper than the rollouts it trains on (one update, no reference model,
    # half the prompts): the regime where routing can shorten a step, the rollout-bound one
    text = text.replace("[learner]\n", f"[learner]\naffinity = {str(affinity).lower()}\n")
    for key, value in LEARNER.items():
        text = re.sub(rf"(?m)^{key} = .*$", f"{key} = {value}", text)
    path = folder / f"affinity-{affinity}.toml"
    path.write_text(text)
    return path


def lengths(args: argparse.Namespace, samples: int = 256) -> dict[str, Any]:
    """Completion lengths of the untrained model, long and short tasks apart."""
    import random

    from echo_rl.core import wire
    from echo_rl.core.config import load_config
    from echo_rl.data.adapter import load_adapter
    from echo_rl.worker.backends.transformers import TransformersBackend

    cfg = load_config(config(Path("/tmp"), args, False), [])
    backend = TransformersBackend(cfg.model, threads=1)
    adapter = load_adapter("toy-add", cfg.adapter.effective_options, backend.tokenizer)
    out: dict[str, list[int]] = {"long": [], "short": []}
    for i, p in enumerate(adapter.prompts(random.Random(0))):
        if len(out["long"]) >= samples and len(out["short"]) >= samples:
            break
        kind = "short" if p.max_new_tokens else "long"
        if len(out[kind]) >= samples:
            continue
        g = wire.Group(
            group_id=str(i), prompt_ids=p.prompt_ids, n=16, seed=i, max_new_tokens=p.max_new_tokens
        )
        out[kind] += [len(s.completion_ids) for s in backend.generate([g], MAX_NEW, 1.0)[0]]
    return {k: _quantiles(v) for k, v in out.items()}


def _quantiles(xs: list[int]) -> dict[str, float]:
    xs = sorted(xs)
    q = lambda f: xs[min(len(xs) - 1, int(f * len(xs)))]  # noqa: E731
    return {"samples": len(xs), "mean": round(statistics.mean(xs), 1), "p50": q(0.5),
            "p90": q(0.9), "p99": q(0.99), "max": xs[-1]}  # fmt: skip


def one_run(affinity: bool, args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    tmp = folder / f"aff{affinity}-{len(list(folder.iterdir()))}"
    tmp.mkdir()
    cfg = config(tmp, args, affinity)
    group = ProcessGroup()
    try:
        argv = python_argv(
            "echo_rl.cli.rl", "learn", str(cfg), "--run-dir", str(tmp / "run"),
            "--set", f"learner.max_steps={args.steps}",
        )  # fmt: skip
        learner = group.start("learner", argv, tmp / "learner.log", pipe_stdout=True)
        line = wait_ready(learner, timeout=180)
        for i in range(args.fast + args.slow):
            join = ["join", line, "--id", f"w{i}", "--plain", "--identity", str(tmp / f"w{i}.key"),
                    "--status-file", str(tmp / f"w{i}.json")]  # fmt: skip
            k = args.slowdown if i >= args.fast else args.fast_slowdown
            argv = python_argv("labs.slow_device", "--slowdown", str(k), *join)
            group.start(f"w{i}", argv, tmp / f"w{i}.log")
        learner.wait(timeout=args.timeout)
    finally:
        group.stop_all()
    return summarise(affinity, tmp, args)


def summarise(affinity: bool, tmp: Path, args: argparse.Namespace) -> dict[str, Any]:
    from echo_rl.worker.status import read_status

    rows = [json.loads(x) for x in (tmp / "run/metrics.jsonl").read_text().splitlines() if x]
    rest = rows[1:]  # the first step waits for the workers to start
    last = rows[-1]
    # records admitted per worker, as the learner's books last told each worker
    admitted = {}
    for i in range(args.fast + args.slow):
        doc = read_status(tmp / f"w{i}.json")
        admitted[f"w{i}"] = doc.account.accepted if doc.account is not None else 0
    slow_ids = {f"w{i}" for i in range(args.fast, args.fast + args.slow)}
    total = sum(admitted.values()) or 1
    return {
        "affinity": affinity,
        "steps": len(rows),
        "steps_per_min": 60 * len(rest) / (last["wall_s"] - rows[0]["wall_s"]),
        "t_wait_mean": statistics.mean(r["t_wait"] for r in rest),
        "t_train_mean": statistics.mean(r["t_train"] for r in rest),
        "tokens_per_step": statistics.mean(r["tokens_trained"] for r in rest),
        "tokens_per_min": 60
        * sum(r["tokens_trained"] for r in rest)
        / (last["wall_s"] - rows[0]["wall_s"]),
        "reward_last": statistics.mean(r["reward_mean"] for r in rows[-10:]),
        "affinity_counts": last.get("affinity"),
        "slow_share": sum(v for k, v in admitted.items() if k in slow_ids) / total,
        "admitted": admitted,
        "dropped_stale": last.get("dropped_stale"),
    }


def table(runs: list[dict[str, Any]]) -> str:
    lines = [
        f"{'affinity':>9}{'steps/min':>11}{'t_wait':>8}{'t_train':>9}{'tokens/step':>13}"
        f"{'tokens/min':>12}{'slow share':>12}{'routed':>8}{'aged':>6}"
    ]
    for r in runs:
        c = r["affinity_counts"] or {}
        lines.append(
            f"{str(r['affinity']):>9}{r['steps_per_min']:>11.1f}{r['t_wait_mean']:>8.2f}"
            f"{r['t_train_mean']:>9.2f}{r['tokens_per_step']:>13.0f}{r['tokens_per_min']:>12.0f}"
            f"{r['slow_share']:>12.2f}{c.get('routed', '-')!s:>8}{c.get('aged', '-')!s:>6}"
        )
    for aff in (False, True):
        mine = [r for r in runs if r["affinity"] == aff]
        if mine:
            med = lambda k, mine=mine: statistics.median(r[k] for r in mine)  # noqa: E731
            lines.append(
                f"median affinity={aff}: {med('steps_per_min'):.1f} steps/min, t_wait "
                f"{med('t_wait_mean'):.2f} s, {med('tokens_per_step'):.0f} tokens/step, "
                f"{med('tokens_per_min'):.0f} tokens trained a minute"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--fast", type=int, default=1)
    ap.add_argument("--slow", type=int, default=2)
    ap.add_argument("--slowdown", type=float, default=12.0, help="the slow workers'")
    ap.add_argument("--fast-slowdown", type=float, default=3.0, help="the fast workers'")
    ap.add_argument("--short", type=int, default=8)
    ap.add_argument("--long-share", type=float, default=0.25)
    ap.add_argument("--timeout", type=float, default=1200.0, help="seconds a run may take")
    ap.add_argument("--json", type=Path, default=ROOT / "benchmarks/results/affinity_real.json")
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    dist = lengths(args)
    print(f"untrained completion lengths (tokens), long and short tasks: {dist}", flush=True)
    runs = alternate(
        (False, True),
        args.rounds,
        lambda aff, tmp: one_run(aff, args, tmp),
        lambda r: (
            f"affinity={r['affinity']}: {r['steps_per_min']:.1f} steps/min, "
            f"t_wait {r['t_wait_mean']:.2f} s, slow share {r['slow_share']:.2f}"
        ),
        "echo-affinity-",
    )
    print(table(runs))
    print(f"({time.monotonic() - t0:.0f} s)")
    save(args, "benchmarks/affinity_real.py", {"lengths": dist, "runs": runs, "table": table(runs)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
