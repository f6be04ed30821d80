"""One benchmark, the code before a change and after it, in the same run on the same machine.

    .venv/bin/python benchmarks/side_by_side.py --base REV --out DIR [--rounds 3] \
        [--key ours.tokens_per_s ...] -- benchmarks/bench_learner.py --preset small ...

The code at ``REV`` is checked out in its own git worktree (removed afterwards); the benchmark
script then runs from each tree in turn, ``--rounds`` times, alternating (before, after, before,
...), so that the machine's drift falls on both sides alike. Each run gets ``--json
DIR/<before|after>_<round>.json``; it imports the code of its own tree (the script's tree comes
first on ``sys.path``; the same venv and dependencies). ``DIR/side_by_side.json`` keeps, for
each ``--key`` (a dotted path into the benchmark's JSON), every run's value, the medians and
after / before; the table is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def dig(doc: Any, key: str) -> float:
    for part in key.split("."):
        doc = doc[part]
    return float(doc)


def git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout.strip()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        raise SystemExit("give the benchmark after --: ... -- benchmarks/bench_learner.py ...")
    cut = argv.index("--")
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="the revision before the change")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--key", action="append", default=[], help="dotted path into the JSON")
    a = ap.parse_args(argv[:cut])
    bench = argv[cut + 1 :]
    if not bench:
        raise SystemExit("no benchmark given after --")
    from echo_rl.core.machine import machine_info

    a.out = a.out.resolve()
    a.out.mkdir(parents=True, exist_ok=True)
    base = git("rev-parse", a.base)
    after_rev = git("rev-parse", "HEAD") + ("+changes" if git("status", "--porcelain") else "")
    runs: dict[str, list[dict[str, Any]]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "before"
        git("worktree", "add", "--detach", str(tree), base)
        try:
            for r in range(a.rounds):
                for side, root in (("before", tree), ("after", ROOT)):
                    out = a.out / f"{side}_{r}.json"
                    cmd = [sys.executable, str(root / bench[0]), *bench[1:], "--json", str(out)]
                    print(f"[{side} {r + 1}/{a.rounds}] {' '.join(cmd[1:])}", flush=True)
                    env = {**os.environ, "PYTHONPATH": str(root)}
                    subprocess.run(cmd, cwd=root, env=env, check=True, stdout=subprocess.DEVNULL)
                    runs[side].append(json.loads(out.read_text()))
        finally:
            git("worktree", "remove", "--force", str(tree))
    summary: dict[str, Any] = {
        "benchmark": "side_by_side",
        "before": base,
        "after": after_rev,
        "command": bench,
        "rounds": a.rounds,
        "machine": machine_info(),
        "keys": {},
    }
    print(f"{'key':40} {'before':>12} {'after':>12} {'after/before':>13}")
    for key in a.key:
        b = [dig(x, key) for x in runs["before"]]
        f = [dig(x, key) for x in runs["after"]]
        mb, mf = statistics.median(b), statistics.median(f)
        summary["keys"][key] = {"before": b, "after": f, "median_before": mb, "median_after": mf}
        summary["keys"][key]["after_over_before"] = mf / mb if mb else None
        print(f"{key:40} {mb:12.4g} {mf:12.4g} {mf / mb if mb else float('nan'):13.3f}")
    (a.out / "side_by_side.json").write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
