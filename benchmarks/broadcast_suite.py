"""Every broadcast figure the docs quote, in one command:

    .venv/bin/python benchmarks/broadcast_suite.py        # (as root for the netns tier)

Writes benchmarks/results/broadcast/<case>.json (raw results with the machine) and prints
each case's table. Cases follow the P2P broadcast issue's acceptance list.
"""

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from broadcast.bench import main  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "broadcast"
BASE = ["--workers", "16", "--snapshot-mib", "64", "--uplink-mbit", "400", "--link-mbit", "100"]
CASES = {
    "n16-chains-vs-star": BASE + ["--topology", "chains,star,star-unlimited"],
    "n16-chains-kill25": BASE + ["--topology", "chains", "--kill-fraction", "0.25"],
    "n16-chains-corrupt1": BASE + ["--topology", "chains", "--corrupt-relays", "1"],
    "loopback-4hop-unshaped": ["--workers", "4", "--chains", "1", "--snapshot-mib", "256",
                               "--uplink-mbit", "0", "--link-mbit", "0", "--chunk-kib", "4096",
                               "--topology", "chains", "--repeat", "5"],
    "netns-n8-chains": ["--workers", "8", "--snapshot-mib", "64", "--uplink-mbit", "400",
                        "--link-mbit", "100", "--topology", "chains", "--netns"],
}

if __name__ == "__main__":
    OUT.mkdir(parents=True, exist_ok=True)
    wanted = sys.argv[1:] or list(CASES)
    for name in wanted:
        if "--netns" in CASES[name] and os.geteuid() != 0:
            print(f"skipping {name}: the netns tier needs root")
            continue
        print(f"== {name}")
        code = main(CASES[name] + ["--json", str(OUT / f"{name}.json")])
        if code:
            sys.exit(code)
