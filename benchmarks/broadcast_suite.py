"""Every broadcast figure the docs quote, in one command:

    .venv/bin/python benchmarks/broadcast_suite.py        # (as root for the netns tier)

Writes benchmarks/results/broadcast/<case>.json (raw results with the machine) and prints
each case's table. Cases follow the P2P broadcast issue's acceptance list.
"""

import asyncio
import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from echo_rl.core.machine import write_result  # noqa: E402
from labs import bare_chain  # noqa: E402
from labs.broadcast_bench import main, run_one  # noqa: E402
from labs.broadcast_root import BenchParams  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "broadcast"
BASE = ["--workers", "16", "--snapshot-mib", "64", "--uplink-mbit", "400", "--link-mbit", "100"]
CASES = {
    "n16-chains-vs-star": BASE + ["--topology", "chains,star,star-unlimited"],
    "n16-chains-kill25": BASE + ["--topology", "chains", "--kill-fraction", "0.25"],
    "n16-chains-corrupt1": BASE + ["--topology", "chains", "--corrupt-relays", "1"],
    "netns-n8-chains": [
        "--workers",
        "8",
        "--snapshot-mib",
        "64",
        "--uplink-mbit",
        "400",
        "--link-mbit",
        "100",
        "--topology",
        "chains",
        "--netns",
    ],
}

LOOPBACK = "loopback-4hop-unshaped"


def loopback_vs_bare(runs: int = 5, mib: int = 256, chunk_kib: int = 4096) -> int:
    """One chain of 4 relays, unshaped, 256 MiB in 4 MiB chunks, against a bare pyzmq chain of
    the same 4 hops (``labs.bare_chain``), alternating run by run: the ratio of the two
    throughputs is the figure (absolute MB/s differs threefold between machines). Each run
    also moves the payload with CurveZMQ on (every socket encrypted, pull tickets checked, as
    a real run has), reported beside it: ``echo_curve_mb_s``, ``ratio_curve``."""
    size = mib * 2**20
    rows = []
    for i in range(runs):
        r = asyncio.run(
            run_one(BenchParams(4, mib, 0, 0, "chains", chunk_kib=chunk_kib, chains=1, seed=i))
        )
        bare_s = bare_chain.run(4, size, chunk_kib * 1024)
        c = asyncio.run(
            run_one(
                BenchParams(
                    4, mib, 0, 0, "chains", chunk_kib=chunk_kib, chains=1, seed=i, curve=True
                )
            )
        )
        echo_mb, bare_mb = size / r["t_bcast_s"] / 1e6, size / bare_s / 1e6
        curve_mb = size / c["t_bcast_s"] / 1e6
        rows.append(
            {
                "run": i,
                "echo_mb_s": echo_mb,
                "bare_mb_s": bare_mb,
                "ratio": echo_mb / bare_mb,
                "echo_curve_mb_s": curve_mb,
                "ratio_curve": curve_mb / bare_mb,
                "corrupt_installs": r["corrupt_installs"] + c["corrupt_installs"],
                "installed": r["installed"],
                "echo": r,
            }
        )
        print(
            f"run {i}: echo {echo_mb:.0f} MB/s, bare pyzmq chain {bare_mb:.0f} MB/s, "
            f"ratio {echo_mb / bare_mb:.3f}; CurveZMQ on {curve_mb:.0f} MB/s, "
            f"ratio {curve_mb / bare_mb:.3f}",
            flush=True,
        )
    ratios = [x["ratio"] for x in rows]
    summary = {
        "ratio_median": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "echo_mb_s_median": statistics.median(x["echo_mb_s"] for x in rows),
        "bare_mb_s_median": statistics.median(x["bare_mb_s"] for x in rows),
        "echo_curve_mb_s_median": statistics.median(x["echo_curve_mb_s"] for x in rows),
        "ratio_curve_median": statistics.median(x["ratio_curve"] for x in rows),
    }
    print(json.dumps(summary))
    write_result(
        OUT / f"{LOOPBACK}.json", {"load": os.getloadavg(), "summary": summary, "runs": rows}
    )
    return 0


if __name__ == "__main__":
    OUT.mkdir(parents=True, exist_ok=True)
    wanted = sys.argv[1:] or [*CASES, LOOPBACK]
    for name in wanted:
        if name == LOOPBACK:
            print(f"== {name}")
            loopback_vs_bare()
            continue
        if "--netns" in CASES[name] and os.geteuid() != 0:
            print(f"skipping {name}: the netns tier needs root")
            continue
        print(f"== {name}")
        code = main(CASES[name] + ["--json", str(OUT / f"{name}.json")])
        if code:
            sys.exit(code)
