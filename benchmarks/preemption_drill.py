"""Preemption drill (docs/preemption.md): spot workers reclaimed at random moments, with and
without migrating their partial rollouts.

    python benchmarks/preemption_drill.py [--workers 8 --spot 2 --grace 2 --steps 30]

One learner and ``--workers`` real worker processes on loopback (tiny model, toy-add, long
completions). ``--spot`` of them are spot instances: each is reclaimed at random moments
(exponential, mean ``--mean-up`` seconds after it started generating) with SIGTERM, SIGKILLed if still
alive after ``--grace`` seconds, and replaced by a new instance (a new key and id, as a new
cloud machine would be) ``--down`` seconds later. The same schedule (same seed) runs twice:
workers that migrate (hand back what they generated as prefixes, the default) and workers
started with ``--no-migrate`` (finish the current groups within the grace, else lose them).

Reported per mode: tokens the reclaimed instances sampled and threw away (sampled minus sent
in a batch or a handback, from each instance's status file), tokens trained, worker-seconds,
goodput (trained tokens per worker-second), the learner's handback counters and the staleness
of every trained record against the budget. The result goes to
``benchmarks/results/preemption_drill.json`` with the machine it ran on.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from echo_rl.core.config import dump_toml, load_config  # noqa: E402
from echo_rl.core.machine import machine_info  # noqa: E402
from echo_rl.core.procs import ProcessGroup, python_argv, wait_ready  # noqa: E402
from echo_rl.core.steprow import COL  # noqa: E402
from echo_rl.worker.status import WorkerStatus, read_status  # noqa: E402


def schedule(rng: random.Random, spot: int, mean_up: float, count: int = 1000) -> list[list[float]]:
    """Per spot slot, how long each of its instances generates before it is reclaimed
    (exponential: a reclaim is as likely at any moment of the work)."""
    return [[rng.expovariate(1 / mean_up) for _ in range(count)] for _ in range(spot)]


def _sampling(run_dir: Path, inst: dict) -> bool:
    """The instance has started generating (its status file counts sampled tokens)."""
    try:
        return (read_status(run_dir / "status" / f"{inst['name']}.json").tokens_sampled or 0) > 0
    except (OSError, ValueError):
        return False


def run_mode(
    args: argparse.Namespace, migrate: bool, reclaim: list[list[float]], out: Path
) -> dict:
    run_dir = out / ("migrate" if migrate else "no-migrate")
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = load_config(
        ROOT / "examples" / "quickstart.toml",
        [
            f"learner.max_steps={args.steps}",
            "learner.prompts_per_step=8",
            "learner.group_size=8",
            "learner.lr=1e-5",
            f"worker.max_new_tokens={args.max_new_tokens}",
            "worker.groups_per_request=4",
            "learner.lease_timeout_s=20",
            "provisioning.enabled=false",
            f"model.max_positions={args.max_new_tokens + 64}",
            f"model.hidden_size={args.hidden}",
            f"model.intermediate_size={4 * args.hidden}",
            f"model.num_layers={args.layers}",
            f"model.head_dim={args.hidden // 4}",
            f'model.tiny_vocab="{args.vocab}"',
        ],
    )
    (run_dir / "drill.toml").write_text(dump_toml(cfg))
    procs = ProcessGroup()
    learner = procs.start(
        "learner",
        python_argv(
            "echo_rl.cli.rl", "learn", str(run_dir / "drill.toml"), "--run-dir", str(run_dir)
        ),
        run_dir / "learner.stderr.log",
        pipe_stdout=True,
    )
    line = wait_ready(learner, 180)
    flags = [] if migrate else ["--no-migrate"]
    instances: list[dict] = []

    def start(name: str) -> dict:
        argv = python_argv(
            "echo_rl.cli.worker",
            "join",
            line,
            "--id",
            name,
            "--plain",
            "--identity",
            str(run_dir / "keys" / f"{name}.key"),
            "--status-file",
            str(run_dir / "status" / f"{name}.json"),
            *flags,
        )
        inst = {
            "name": name,
            "proc": procs.start(name, argv, run_dir / f"{name}.log"),
            "start": time.monotonic(),
            "end": None,
            "reclaimed": False,
        }
        instances.append(inst)
        return inst

    spots = [start(f"spot{k}-0") for k in range(args.spot)]
    for i in range(args.workers - args.spot):
        start(f"stable{i}")
    pending = [list(ts) for ts in reclaim]
    born = [1] * args.spot
    while learner.poll() is None:
        for k in range(args.spot):
            inst = spots[k]
            if (
                inst["end"] is None
                and inst.get("due") is None
                and pending[k]
                and _sampling(run_dir, inst)
            ):
                inst["due"] = time.monotonic() + pending[k].pop(0)  # a random moment of its work
            if (
                inst["end"] is None
                and inst.get("due") is not None
                and time.monotonic() >= inst["due"]
            ):
                inst["reclaimed"] = True
                inst["proc"].send_signal(signal.SIGTERM)
                try:
                    inst["proc"].wait(args.grace)
                except subprocess.TimeoutExpired:
                    inst["proc"].kill()  # the cloud takes the machine
                    inst["proc"].wait()
                inst["end"] = time.monotonic()
            elif inst["end"] is not None and time.monotonic() - inst["end"] >= args.down:
                spots[k] = start(f"spot{k}-{born[k]}")
                born[k] += 1
        time.sleep(0.1)  # the drill's own clock tick, not a wait for an event
    procs.stop_all()
    end = time.monotonic()
    return summarize(run_dir, instances, end, cfg.learner.staleness)


def summarize(run_dir: Path, instances: list[dict], end: float, budget: int) -> dict:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    status = {}
    for inst in instances:
        p = run_dir / "status" / f"{inst['name']}.json"
        status[inst["name"]] = read_status(p) if p.exists() else WorkerStatus()
    reclaimed = [i for i in instances if i["reclaimed"]]
    sampled = sum(status[i["name"]].tokens_sampled or 0 for i in reclaimed)
    sent = sum(status[i["name"]].tokens_sent or 0 for i in reclaimed)
    worker_s = sum((i["end"] or end) - i["start"] for i in instances)
    trained = sum(r.get(COL.tokens_trained, 0) for r in rows)
    last = rows[-1] if rows else {}
    return {
        "steps": len(rows),
        "reclaimed_instances": len(reclaimed),
        "reclaimed_tokens_sampled": sampled,
        "reclaimed_tokens_sent": sent,
        "wasted_tokens": sampled - sent,
        COL.tokens_trained: trained,
        "worker_seconds": round(worker_s, 1),
        "goodput_tokens_per_worker_s": round(trained / worker_s, 2) if worker_s else 0.0,
        COL.mixed_version_samples: sum(r.get(COL.mixed_version_samples, 0) for r in rows),
        "handbacks": last.get("handbacks", {}),
        COL.staleness_max: max((r[COL.staleness_max] for r in rows), default=0),
        "staleness_budget": budget,
        "staleness_violations": sum(1 for r in rows if r[COL.staleness_max] > budget),
        COL.reissued_groups: last.get(COL.reissued_groups),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--spot", type=int, default=2, help="workers reclaimed (25%% of 8)")
    ap.add_argument("--grace", type=float, default=2.0, help="seconds between SIGTERM and SIGKILL")
    ap.add_argument(
        "--mean-up",
        type=float,
        default=8.0,
        help="mean seconds a spot instance generates before it is reclaimed",
    )
    ap.add_argument("--down", type=float, default=3.0, help="seconds before a replacement starts")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    # Rollouts must outlast the grace for the comparison to mean anything (a real model's
    # take tens of seconds): a wider model and the text vocabulary (end-of-sequence drawn
    # less often by the random init) make the tiny model's last seconds on these CPUs.
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", choices=["arith", "text"], default="text")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("/tmp/echo-preemption-drill"))
    ap.add_argument(
        "--json", type=Path, default=ROOT / "benchmarks" / "results" / "preemption_drill.json"
    )
    args = ap.parse_args(argv)
    reclaim = schedule(random.Random(args.seed), args.spot, args.mean_up)
    result = {"machine": machine_info(), "args": {k: str(v) for k, v in vars(args).items()}}
    for migrate in (True, False):
        t = time.monotonic()
        res = run_mode(args, migrate, reclaim, args.out)
        res["wall_s"] = round(time.monotonic() - t, 1)
        result["migrate" if migrate else "no_migrate"] = res
        print(("migrate   " if migrate else "no-migrate"), json.dumps(res), flush=True)
    m, b = result["migrate"], result["no_migrate"]
    result["wasted_reduction"] = (
        (1 - m["wasted_tokens"] / b["wasted_tokens"]) if b["wasted_tokens"] else None
    )
    result["goodput_ratio"] = (
        m["goodput_tokens_per_worker_s"] / b["goodput_tokens_per_worker_s"]
        if b["goodput_tokens_per_worker_s"]
        else None
    )
    print(
        f"wasted tokens of reclaimed workers: {m['wasted_tokens']} with migration, "
        f"{b['wasted_tokens']} without ({100 * (result['wasted_reduction'] or 0):.1f}% fewer); "
        f"goodput {m['goodput_tokens_per_worker_s']} vs {b['goodput_tokens_per_worker_s']} "
        f"tokens per worker-second"
    )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
