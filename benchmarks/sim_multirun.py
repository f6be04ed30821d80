"""Several RL jobs on one fleet of 1,000 rollout workers: shared against dedicated, simulated
(echo_rl/provisioning/sim/multijob.py; docs/multirun.md).

    .venv/bin/python benchmarks/sim_multirun.py [--only multirun-2,multirun-3] [--no-sweep]
        [--json benchmarks/results/sim_multirun.json] [--plot docs/img/sim_multirun.png]
        [--sweep-plot docs/img/sim_multirun_sweep.png] [--horizon SECONDS] [--warm-s SECONDS]
        [--set SECTION.KEY=VALUE ...]

Runs every scenario below in both modes on the same workers and prints, per job: steps done,
$ per step dedicated and shared (learner + its part of the fleet), their ratio, S, the largest
staleness trained in each mode, the shared fleet cost per step against the packing bound, and
the cold/warm model loads; per scenario: the fleet's idle, model-load and snapshot-sync
fractions in each mode and the $ per step over all jobs. The variants beside the example files
are the controls: the same two jobs in phase, K = 1 (no second model in host memory), four
jobs with K = 3, and the three- and four-job mixes against an equal dedicated split.
Last, the 2-, 3- and 4-job files (and 2 jobs with K = 1, 4 jobs with K = 4) with
``fleet.policy = "turns"``: the real worker's policy (echo_rl/worker/sharing.py) in place of the
simulator's heuristic; then the 2-, 3-, 4-job files and 4 jobs with K = 4 with two variants of
it: ``"turns-decay"`` (books decaying, tau 60 s and 300 s), ``"turns-need"`` (decayed books,
each job's weight times its learner's need) and ``"turns-needfirst"`` (the asking job with the
highest need, ties to the least decayed books per weight).

Then the sweep (echo_rl/provisioning/sim/multijob_sweep.py): the 2-, 3- and 4-job files with every
job's learner step-time contrast between its phases set to 1 (no phases), 2, 4 (the files
as written) and 8, time-averaged demand kept, phases offset as in the files and aligned (all
rollout-bound at once); one line per setting: the worst and best job's ratio, the whole bill's,
the fleet idle in each mode, steps against the learners' ceiling, and staleness against S.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from echo_rl.core.machine import write_result  # noqa: E402
from echo_rl.provisioning.sim.multijob_bound import fleet_capacity, offline_bound  # noqa: E402
from echo_rl.provisioning.sim.multijob_report import compare, plot, table  # noqa: E402
from echo_rl.provisioning.sim.multijob_scenario import MultiScenario, multi_from_dict  # noqa: E402
from echo_rl.provisioning.sim.multijob_sweep import (  # noqa: E402
    sweep_plot,
    sweep_row,
    sweep_table,
    with_contrast,
)

EX = ROOT / "examples" / "sim"
# (label, example file, overrides "section.key": value): the headline files, then the controls.
SCENARIOS: list[tuple[str, str, dict[str, Any]]] = [
    ("multirun-2", "multirun-2.toml", {}),
    ("multirun-3", "multirun-3.toml", {}),
    ("multirun-4", "multirun-4.toml", {}),
    ("multirun-2-inphase", "multirun-2-inphase.toml", {}),
    ("multirun-2-K1", "multirun-2.toml", {"fleet.resident_models": 1}),
    ("multirun-4-K3", "multirun-4.toml", {"fleet.resident_models": 3}),
    # Every worker holds all four models in host memory (four 3-7B models: 28-56 GB of RAM).
    ("multirun-4-K4", "multirun-4.toml", {"fleet.resident_models": 4, "fleet.reach": "any"}),
    # The demand split is not the cheapest dedicated baseline for every job: show equal too.
    ("multirun-3-equal", "multirun-3.toml", {"dedicated.split": "equal"}),
    ("multirun-4-equal", "multirun-4.toml", {"dedicated.split": "equal"}),
    # The worker's own policy (echo_rl/worker/sharing.py Turns) in place of the heuristic: per device,
    # the asking job with the least device-seconds per weight; K = models on the device.
    ("multirun-2-turns", "multirun-2.toml", {"fleet.policy": "turns"}),
    # echo-worker's default, --resident 1: one model on the device, every switch warm.
    (
        "multirun-2-K1-turns",
        "multirun-2.toml",
        {"fleet.resident_models": 1, "fleet.policy": "turns"},
    ),
    ("multirun-3-turns", "multirun-3.toml", {"fleet.policy": "turns"}),
    ("multirun-4-turns", "multirun-4.toml", {"fleet.policy": "turns"}),
    (
        "multirun-4-K4-turns",
        "multirun-4.toml",
        {"fleet.resident_models": 4, "fleet.reach": "any", "fleet.policy": "turns"},
    ),
    # Two variants of turns a worker and a learner could implement: "turns-decay" (the books
    # decay, tau 60 s and 300 s: recent fairness) and "turns-need" (tau 300 s, each weight
    # times the learner's need: required workers / workers it holds, sent in heartbeat acks);
    # and "turns-needfirst" (the asking job with the highest need, ties within 5 % to the
    # least decayed device-seconds per weight, tau 300 s).
]
K4 = {"fleet.resident_models": 4, "fleet.reach": "any"}
VARIANTS = [
    ("turns-decay60", {"fleet.policy": "turns-decay", "fleet.turns_tau_s": 60.0}),
    ("turns-decay300", {"fleet.policy": "turns-decay", "fleet.turns_tau_s": 300.0}),
    ("turns-need", {"fleet.policy": "turns-need"}),
    ("turns-needfirst", {"fleet.policy": "turns-needfirst"}),
]
for _label, _file, _base in [
    ("multirun-2", "multirun-2.toml", {}),
    ("multirun-3", "multirun-3.toml", {}),
    ("multirun-4", "multirun-4.toml", {}),
    ("multirun-4-K4", "multirun-4.toml", K4),
]:
    SCENARIOS += [(f"{_label}-{v}", _file, {**_base, **o}) for v, o in VARIANTS]


# The sweep: (job count, example file), contrasts, and which contrasts also run aligned (c = 1
# has no phases, so aligned and offset are the same run).
SWEEP_FILES = [(2, "multirun-2.toml"), (3, "multirun-3.toml"), (4, "multirun-4.toml")]
CONTRASTS = [1.0, 2.0, 4.0, 8.0]
ALIGNED = [4.0, 8.0]

_memo: dict[str, dict[str, Any]] = {}
EXTRA: dict[str, Any] = {}  # --set: on top of every scenario's own overrides, and the sweep's


def _compare(sc: MultiScenario) -> dict[str, Any]:
    """``compare``, once per distinct scenario (the run name aside): the simulation is
    deterministic, so the sweep's c = 4 offset runs are the headline files' runs."""
    dump = sc.model_dump()
    dump["run"].pop("name")
    key = json.dumps(dump, sort_keys=True)
    if key not in _memo:
        _memo[key] = compare(sc)
    return _memo[key]


def load(
    file: str,
    overrides: dict[str, Any] | None = None,
    horizon: float | None = None,
    warm_s: float | None = None,
) -> MultiScenario:
    data = tomllib.loads((EX / file).read_text())
    if horizon:  # --horizon: every scenario and the sweep over a longer (or shorter) run
        data["run"]["horizon_s"] = horizon
    if warm_s is not None:  # --warm-s: every job's switch from host memory (docs/gpu.md)
        for job in data["jobs"]:
            job["warm_s"] = warm_s
        data["run"]["name"] += f", warm_s={warm_s:g}"
    overrides = {**(overrides or {}), **EXTRA}
    for key, value in overrides.items():
        section, name = key.split(".")
        data.setdefault(section, {})[name] = value
    if overrides:
        data["run"]["name"] += ", " + ", ".join(f"{k}={v}" for k, v in overrides.items())
    return multi_from_dict(data)


def run(
    label: str,
    file: str,
    overrides: dict[str, Any],
    horizon: float | None = None,
    warm_s: float | None = None,
) -> dict[str, Any]:
    sc = load(file, overrides, horizon, warm_s)
    res = dict(_compare(sc))
    ded = [j["steps"] for j in res["dedicated"]["jobs"]]
    res["offline_bound"] = offline_bound(sc, ded, fleet_capacity(sc))
    res["label"], res["file"], res["overrides"] = label, f"examples/sim/{file}", overrides
    return res


def sweep(horizon: float | None = None, warm_s: float | None = None) -> list[dict[str, Any]]:
    rows = []
    for _, file in SWEEP_FILES:
        base = load(file, horizon=horizon, warm_s=warm_s)
        for c in CONTRASTS:
            for aligned in (False, True) if c in ALIGNED else (False,):
                sc = with_contrast(base, c, aligned)
                row = sweep_row(_compare(sc), c, aligned, sc)
                row["file"] = f"examples/sim/{file}"
                rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="", help="comma-separated labels (default: all)")
    ap.add_argument("--json", default=str(ROOT / "benchmarks/results/sim_multirun.json"))
    ap.add_argument("--plot", default=str(ROOT / "docs/img/sim_multirun.png"))
    ap.add_argument("--sweep-plot", default=str(ROOT / "docs/img/sim_multirun_sweep.png"))
    ap.add_argument(
        "--sweep",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the phase-contrast sweep (default: on)",
    )
    ap.add_argument(
        "--horizon",
        type=float,
        default=None,
        help="simulated seconds for every scenario and the sweep (default: each file's, 2,400)",
    )
    ap.add_argument(
        "--warm-s",
        type=float,
        default=None,
        help="every job's warm_s, a switch from host memory (default: each file's, 2.5 s; "
        "docs/gpu.md measured 0.23 s for a 3B model on an H200)",
    )
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="a fleet or run setting for every scenario and the sweep, e.g. fleet.policy=turns-need",
    )
    args = ap.parse_args(argv)
    EXTRA.clear()
    for item in args.set:
        key, sep, raw = item.partition("=")
        if not sep or key.count(".") != 1:
            ap.error(f"--set {item!r}: write SECTION.KEY=VALUE, e.g. fleet.reach=any")
        try:  # a TOML value (1, 0.5, true); anything else is a string (turns-need, any)
            EXTRA[key] = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            EXTRA[key] = raw
    only = {x for x in args.only.split(",") if x}
    t0 = time.perf_counter()
    results = []
    for label, file, overrides in SCENARIOS:
        if only and label not in only:
            continue
        res = run(label, file, overrides, args.horizon, args.warm_s)
        b = res["offline_bound"]
        print(
            table(res) + f"\noffline bound (docs/multirun.md): whole bill {b['bill_bound']:.2f}x; "
            f"every job at most {b['every_job_bound']:.2f}x its dedicated steps"
            f"\n({res['wall_s']:.1f} s)\n",
            flush=True,
        )
        results.append(res)
    headline = [r for r in results if r["label"] in ("multirun-2", "multirun-3", "multirun-4")]
    if args.plot and headline:
        print(f"plot: {plot(headline, args.plot)}")
    rows = []
    if args.sweep:
        t1 = time.perf_counter()
        rows = sweep(args.horizon, args.warm_s)
        print(
            "sweep: ratio = dedicated / shared $ per step (min, max over jobs; bill = all "
            "learners + fleet); c = learner step time, learner-bound / rollout-bound phase\n"
            + sweep_table(rows)
            + f"\n({time.perf_counter() - t1:.1f} s)\n",
            flush=True,
        )
        if args.sweep_plot:
            print(f"sweep plot: {sweep_plot(rows, args.sweep_plot)}")
    if args.json:
        write_result(
            args.json,
            {
                "generated_by": "benchmarks/sim_multirun.py",
                "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "wall_s": time.perf_counter() - t0,
                "scenarios": results,
                "sweep": rows,
            },
        )
        print(f"json: {args.json}")
    print(f"total {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
