"""Several RL jobs on one fleet of 1,000 rollout workers: shared against dedicated, simulated
(provisioning/sim/multijob.py; docs/multirun-sim.md).

    .venv/bin/python benchmarks/sim_multirun.py [--only multirun-2,multirun-3]
        [--json benchmarks/results/sim_multirun.json] [--plot docs/img/sim_multirun.png]

Runs every scenario below in both modes on the same workers and prints, per job: steps done,
$ per step dedicated and shared (learner + its part of the fleet), their ratio, S, the largest
staleness trained in each mode, the shared fleet cost per step against the packing bound, and
the cold/warm model loads; per scenario: the fleet's idle, model-load and snapshot-sync
fractions in each mode and the $ per step over all jobs. The variants beside the example files
are the controls: the same two jobs in phase, K = 1 (no second model in host memory), four
jobs with K = 3, and the three- and four-job mixes against an equal dedicated split.
"""

from __future__ import annotations

import argparse
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from echo.machine import write_result  # noqa: E402
from provisioning.sim.multijob_report import compare, plot, table  # noqa: E402
from provisioning.sim.multijob_scenario import multi_from_dict  # noqa: E402

EX = ROOT / "examples" / "sim"
# (label, example file, overrides "section.key": value): the headline files, then the controls.
SCENARIOS: list[tuple[str, str, dict[str, Any]]] = [
    ("multirun-2", "multirun-2.toml", {}),
    ("multirun-3", "multirun-3.toml", {}),
    ("multirun-4", "multirun-4.toml", {}),
    ("multirun-2-inphase", "multirun-2-inphase.toml", {}),
    ("multirun-2-K1", "multirun-2.toml", {"fleet.resident_models": 1}),
    ("multirun-4-K3", "multirun-4.toml", {"fleet.resident_models": 3}),
    # The demand split is not the cheapest dedicated baseline for every job: show equal too.
    ("multirun-3-equal", "multirun-3.toml", {"dedicated.split": "equal"}),
    ("multirun-4-equal", "multirun-4.toml", {"dedicated.split": "equal"}),
]


def run(label: str, file: str, overrides: dict[str, Any]) -> dict[str, Any]:
    data = tomllib.loads((EX / file).read_text())
    for key, value in overrides.items():
        section, name = key.split(".")
        data.setdefault(section, {})[name] = value
    if overrides:
        data["run"]["name"] += ", " + ", ".join(f"{k}={v}" for k, v in overrides.items())
    res = compare(multi_from_dict(data))
    res["label"], res["file"], res["overrides"] = label, f"examples/sim/{file}", overrides
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="", help="comma-separated labels (default: all)")
    ap.add_argument("--json", default=str(ROOT / "benchmarks/results/sim_multirun.json"))
    ap.add_argument("--plot", default=str(ROOT / "docs/img/sim_multirun.png"))
    args = ap.parse_args(argv)
    only = {x for x in args.only.split(",") if x}
    t0 = time.perf_counter()
    results = []
    for label, file, overrides in SCENARIOS:
        if only and label not in only:
            continue
        res = run(label, file, overrides)
        print(table(res) + f"\n({res['wall_s']:.1f} s)\n", flush=True)
        results.append(res)
    headline = [r for r in results if r["label"] in ("multirun-2", "multirun-3", "multirun-4")]
    if args.plot and headline:
        print(f"plot: {plot(headline, args.plot)}")
    if args.json:
        write_result(
            args.json,
            {
                "generated_by": "benchmarks/sim_multirun.py",
                "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "wall_s": time.perf_counter() - t0,
                "scenarios": results,
            },
        )
        print(f"json: {args.json}")
    print(f"total {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
