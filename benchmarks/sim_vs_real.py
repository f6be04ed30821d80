"""Simulated against measured bubble ratio, on the same parameters (issue: provisioning, item 7).

    .venv/bin/python benchmarks/sim_vs_real.py [--pools 1,2,4] [--steps 60]

For each pool size: run the real system on loopback (``echo-rl quickstart`` with that many
worker processes, provisioning off), measure T_train (mean and spread across steps), T_bcast
and each worker's generation rate (samples / busy second), then simulate exactly those
numbers with ``echo_rl.provisioning.sim.api.simulate_fixed`` and compare bubble ratios. Writes
benchmarks/results/sim_vs_real.json with the machine.
"""

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from echo_rl.core.config import load_config  # noqa: E402
from echo_rl.core.machine import write_result  # noqa: E402
from echo_rl.core.steprow import COL, RunSummary, read_rows  # noqa: E402
from echo_rl.provisioning.sim.api import simulate_fixed  # noqa: E402
from echo_rl.provisioning.sim.summary import SIM  # noqa: E402


def measure(n: int, steps: int, tmp: Path) -> dict:
    run = tmp / f"pool-{n}"
    sets = [f"learner.max_steps={steps}", "provisioning.enabled=false"]
    argv = [
        sys.executable,
        "-m",
        "echo_rl.cli.rl",
        "quickstart",
        "--workers",
        str(n),
        "--run-dir",
        str(run),
    ]
    for s in sets:
        argv += ["--set", s]
    subprocess.run(argv, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    cfg = load_config(ROOT / "examples/quickstart.toml", sets)
    rows = read_rows(run / "metrics.jsonl")[1:]
    summary = RunSummary.read(run / "summary.json")
    batch = cfg.worker.groups_per_request * cfg.learner.group_size
    bcast = [r.t_bcast for r in rows if r.t_bcast]
    train = [r.t_train + r.t_publish for r in rows]
    # the row's names (COL) for the row's figures, here means over the run
    return {
        "workers": n,
        COL.bubble_ratio: summary.bubble_ratio,
        COL.t_train: statistics.fmean(train),
        # step-to-step spread: near saturation a slow step the workers did not cover is a wait
        # that a constant T_train never produces
        "t_train_cv": statistics.pstdev(train) / statistics.fmean(train),
        COL.t_bcast: sum(bcast) / len(bcast) if bcast else 0.0,
        # each worker's busy-time rate (request, generate, score, deliver), from heartbeats
        "mu_per_worker": rows[-1].worker_busy_rate,  # whole-run average per busy second
        "mu_generate_only": batch / (sum(r.gen_s_mean for r in rows) / len(rows)),
        "cfg": cfg,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pools", default="1,2,4")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--json", default=str(ROOT / "benchmarks/results/sim_vs_real.json"))
    args = ap.parse_args(argv)
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in [int(x) for x in args.pools.split(",")]:
            m = measure(n, args.steps, Path(tmp))
            lc = m.pop("cfg").learner
            sim = simulate_fixed(
                n,
                m["mu_per_worker"],
                m[COL.t_train],
                m[COL.t_bcast],
                lc.prompts_per_step * lc.group_size,
                lc.staleness,
                lc.effective_kappa,
                args.steps,
                group_size=lc.group_size,
                groups_per_request=2,
                max_outstanding_groups=lc.effective_outstanding,
                measure_from_step=1,
                t_train_cv=m["t_train_cv"],
            )
            b_sim, b_real = sim[SIM.bubble_ratio], m[COL.bubble_ratio]
            m["bubble_ratio_sim"] = b_sim
            m["abs_diff"] = abs(b_sim - b_real)
            out.append(m)
            print(
                f"workers={n}: measured B={b_real:.3f} simulated B={b_sim:.3f} "
                f"(T_train {m[COL.t_train]:.3f}s cv {m['t_train_cv']:.2f}, "
                f"T_bcast {m[COL.t_bcast]:.3f}s, mu/worker {m['mu_per_worker']:.0f}/s)"
            )
    write_result(args.json, {"results": out})
    worst = max(r["abs_diff"] for r in out)
    print(f"largest |simulated - measured| = {worst:.3f} (target <= 0.05)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
