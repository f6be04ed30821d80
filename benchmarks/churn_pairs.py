"""Churn repair, measured back to back (issue 31's guard on the relay-report rules).

Each pair runs ``python -m labs.broadcast_bench`` twice with the same seed on the same machine:
fault-free, then with ``--kill-fraction`` of the relays SIGKILLed at random moments of the
broadcast. Their children report the dead relays (timeout, disconnected) and re-attach
upstream; the ratio T_bcast(kill) / T_bcast(fault-free) shows what the repair costs.

    .venv/bin/python benchmarks/churn_pairs.py --pairs 3 [--out benchmarks/results/broadcast/churn_pairs.json]

Prints one line per pair and writes the pairs with the machine they ran on.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = [
    "--workers",
    "16",
    "--snapshot-mib",
    "64",
    "--uplink-mbit",
    "400",
    "--link-mbit",
    "100",
    "--topology",
    "chains",
]


def t_bcast(extra: list[str], seed: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "labs.broadcast_bench",
                *BENCH,
                "--seed",
                str(seed),
                "--json",
                str(out),
                *extra,
            ],
            check=True,
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            timeout=600,
        )
        [r] = json.loads(out.read_text())["results"]
        return float(r["t_bcast_s"])


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(ROOT))
    from echo_rl.core.machine import write_result

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--kill-fraction", type=float, default=0.25)
    ap.add_argument("--limit", type=float, default=1.10, help="the ratio a pair must stay within")
    ap.add_argument(
        "--out", type=Path, default=ROOT / "benchmarks/results/broadcast/churn_pairs.json"
    )
    args = ap.parse_args(argv)
    pairs = []
    for i in range(args.pairs):
        load = [round(os.getloadavg()[0], 2)]  # 1-minute load before each run: others' work shows
        clean = t_bcast([], seed=i)
        load.append(round(os.getloadavg()[0], 2))
        killed = t_bcast(["--kill-fraction", str(args.kill_fraction)], seed=i)
        pairs.append(
            {
                "seed": i,
                "fault_free_s": round(clean, 3),
                "killed_s": round(killed, 3),
                "ratio": round(killed / clean, 3),
                "load_1min": load,
            }
        )
        print(
            f"pair {i}: fault-free {clean:.2f} s, {args.kill_fraction:.0%} killed {killed:.2f} s, "
            f"ratio {killed / clean:.3f} (1-min load before each: {load[0]}, {load[1]})",
            flush=True,
        )
    within = sum(p["ratio"] <= args.limit for p in pairs)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_result(
        args.out,
        {
            "command": "benchmarks/churn_pairs.py " + " ".join(argv or sys.argv[1:]),
            "bench_args": BENCH,
            "kill_fraction": args.kill_fraction,
            "limit": args.limit,
            "within_limit": within,
            "pairs": pairs,
        },
    )
    print(f"{within} of {len(pairs)} pairs within {args.limit:.2f}x")
    return 0 if within == len(pairs) else 1


if __name__ == "__main__":
    sys.exit(main())
