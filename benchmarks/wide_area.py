"""Training over a misbehaving wide-area link: throughput and losses against a clean link.

    .venv/bin/python benchmarks/wide_area.py [--steps 40] [--workers 2] [--json FILE]

For each scenario a real learner (the quickstart's config) and worker processes run on
loopback, the workers reaching the learner only through ``python -m labs.chaos`` (latency,
stalls, RST resets; see ``labs/chaos.py``). The first scenario is the same proxy with no
faults: the baseline every other scenario's throughput is divided by. For each run it checks
that nothing a worker saw acknowledged is lost (trained, still buffered, or a counted stale
drop) and that no group is trained twice. Writes benchmarks/results/wide_area.json with the
machine. (The snapshot path is direct: the broadcast's own faults are in broadcast_suite.py.)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from echo_rl.core.config import dump_toml, load_config  # noqa: E402
from echo_rl.core.machine import write_result  # noqa: E402
from echo_rl.core.procs import ProcessGroup, python_argv, wait_ready  # noqa: E402
from echo_rl.core.security import JoinLine  # noqa: E402
from echo_rl.core.steprow import COL  # noqa: E402

SCENARIOS = {
    "clean": [],
    "latency 50 ms": ["--latency-ms", "50"],
    "resets every 2 s": ["--latency-ms", "20", "--reset-every-s", "2"],
    "resets every 0.5 s + stalls": [
        "--latency-ms",
        "20",
        "--reset-every-s",
        "0.5",
        "--stall-every-s",
        "5",
        "--stall-s",
        "1",
    ],
}


def run_scenario(name: str, flags: list[str], steps: int, workers: int, tmp: Path) -> dict:
    from echo_rl.learner.run_audit import audit_run
    from labs import child_env
    from labs.chaos import READY_PREFIX

    cfg = load_config(
        ROOT / "examples/quickstart.toml",
        [f"learner.max_steps={steps}", "provisioning.enabled=false"],
    )
    conf, run = tmp / "cfg.toml", tmp / "run"
    conf.write_text(dump_toml(cfg))
    group = ProcessGroup()
    try:
        learner = group.start(
            "learner",
            python_argv("echo_rl.cli.rl", "learn", str(conf), "--run-dir", str(run)),
            tmp / "learner.err",
            pipe_stdout=True,
        )
        join = JoinLine.parse(wait_ready(learner, timeout=120))
        endpoint = join.endpoint.removeprefix("tcp://")
        chaos = group.start(
            "chaos",
            python_argv(
                "labs.chaos", "--target", endpoint, *flags, "--stats", str(tmp / "chaos.json")
            ),
            tmp / "chaos.err",
            pipe_stdout=True,
            env=child_env(),
        )
        line = chaos.stdout.readline().decode()
        if not line.startswith(READY_PREFIX):
            raise RuntimeError((tmp / "chaos.err").read_text())
        proxied = str(
            JoinLine(f"tcp://127.0.0.1:{line[len(READY_PREFIX) :].strip()}", join.server_key)
        )
        t0 = time.monotonic()
        for i in range(workers):
            group.start(
                f"w{i}",
                python_argv(
                    "echo_rl.cli.worker",
                    "join",
                    proxied,
                    "--id",
                    f"w{i}",
                    "--ledger",
                    str(tmp / f"w{i}.ledger"),
                    "--identity",
                    str(tmp / f"w{i}.key"),
                ),
                tmp / f"w{i}.log",
            )
        if learner.wait(600) != 0:
            raise RuntimeError((tmp / "learner.err").read_text()[-2000:])
        wall = time.monotonic() - t0
        group.stop("chaos")
    finally:
        group.stop_all()
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    audit = audit_run(run, [tmp / f"w{i}.ledger" for i in range(workers)], cfg.learner.group_size)
    chaos_stats = json.loads((tmp / "chaos.json").read_text())
    last = rows[-1]
    return {
        "scenario": name,
        "proxy_flags": flags,
        "steps": len(rows),
        "wall_s": round(wall, 2),
        "steps_per_s": round(len(rows) / wall, 3),
        COL.bubble_ratio: last[COL.bubble_ratio],
        COL.staleness_max: max(r[COL.staleness_max] for r in rows),
        "resets": chaos_stats["resets"],
        "stalls": chaos_stats["stalls"],
        "duplicates": last["duplicates"],
        COL.reissued_groups: last[COL.reissued_groups],
        "acked_samples": len(audit.acked),
        "lost_acked_samples": len(audit.lost),
        "groups_trained_twice": audit.groups_trained_twice,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--json", default=str(ROOT / "benchmarks/results/wide_area.json"))
    args = ap.parse_args(argv)
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    results = []
    with Progress() as progress:
        task = progress.add_task("scenarios", total=len(SCENARIOS))
        for name, flags in SCENARIOS.items():
            with tempfile.TemporaryDirectory() as tmp:
                results.append(run_scenario(name, flags, args.steps, args.workers, Path(tmp)))
            progress.advance(task)
    base = results[0]["steps_per_s"]
    for r in results:
        r["throughput_vs_clean"] = round(r["steps_per_s"] / base, 3)
    table = Table(
        title=f"Training over a misbehaving link ({args.workers} workers, {args.steps} steps)"
    )
    for col in (
        "scenario",
        "wall s",
        "steps/s",
        "vs clean",
        "bubble",
        "resets",
        "stalls",
        "duplicates",
        "re-granted",
        "acked samples",
        "lost",
        "trained twice",
    ):
        table.add_column(col, justify="right")
    for r in results:
        table.add_row(
            r["scenario"],
            f"{r['wall_s']:.1f}",
            f"{r['steps_per_s']:.2f}",
            f"{r['throughput_vs_clean']:.2f}",
            f"{r[COL.bubble_ratio]:.3f}",
            str(r["resets"]),
            str(r["stalls"]),
            str(r["duplicates"]),
            str(r[COL.reissued_groups]),
            str(r["acked_samples"]),
            str(r["lost_acked_samples"]),
            str(r["groups_trained_twice"]),
        )
    Console(width=160).print(table)
    write_result(args.json, {"results": results})
    lost = sum(r["lost_acked_samples"] + r["groups_trained_twice"] for r in results)
    return 1 if lost else 0


if __name__ == "__main__":
    sys.exit(main())
