"""``echo-rl sim``: the command line and the printed report of a simulation."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from echo_rl.core.jsontypes import JsonValue
from echo_rl.core.steprow import COL
from echo_rl.provisioning.sim.scenario import ScenarioError, load_scenario
from echo_rl.provisioning.sim.summary import Baseline, SimSummary

if TYPE_CHECKING:
    from rich.console import Console

    from echo_rl.provisioning.sim.centralized import Comparison
    from echo_rl.provisioning.sim.core import SimResult


def print_report(result: SimResult, console: Console | None = None) -> None:
    from rich.console import Console
    from rich.table import Table

    from echo_rl.provisioning.sim.core import scenario_value

    console = console or Console()
    s = SimSummary.from_json(result["summary"])

    def sc(section: str, key: str) -> JsonValue:
        return scenario_value(result, section, key)

    traj, ev = s.trajectories or {}, s.events or {}  # a run's summary has both

    def f(x: object, fmt: str = ".4g") -> str:
        return "-" if x is None else format(x, fmt)

    t = Table(
        title=f"sim {sc('run', 'name')}: {result['pool']['workers']:,} candidate workers, "
        f"{s.steps_done} steps ({s.steps_measured} measured), "
        f"topology {sc('broadcast', 'topology')}"
    )
    t.add_column("metric")
    t.add_column("value", justify="right")
    rows = [
        ("bubble ratio B", f(s.bubble_ratio, ".2%") if s.bubble_ratio is not None else "-"),
        ("T_wait per step (s)", f(s.wait_s_per_step, ".1f")),
        ("T_train per step (s)", f(s.t_train_s_per_step, ".1f")),
        (
            "staleness max / mean (S)",
            f"{f(s.staleness_max, 'd')} / "
            f"{f(s.staleness_mean, '.2f')} "
            f"(S={sc('learner', 'staleness')}, kappa={s.kappa})",
        ),
        ("cost per step ($)", f(s.cost_per_step_usd, ".3f")),
        ("$ per 1k trained trajectories", f(s.usd_per_1k_trajectories, ".4f")),
        (
            "T_bcast mean / max (s)",
            f"{f(s.t_bcast_mean_s, '.1f')} / {f(s.t_bcast_max_s, '.1f')} ({s.publications} pubs)",
        ),
        ("active workers (mean)", f(s.active_mean, ".1f")),
        ("capacity active (mean, traj/s)", f(s.mu_active_mean, ".4g")),
        ("mu_req at mean T_bcast (traj/s)", f(s.mu_req_at_mean_t_bcast, ".4g")),
        (
            "trajectories trained / dropped stale / lost",
            f"{traj['trained']:,} / {traj[COL.dropped_stale]:,} / {traj['lost_to_churn']:,}",
        ),
        ("churn leaves / joins", f"{ev['leaves']} / {ev['joins']}"),
        (
            "controller activate / release / short",
            f"{ev['activations']} / {ev['releases']} / {ev['short']}",
        ),
        ("simulated time (h)", f(None if s.sim_time_s is None else s.sim_time_s / 3600, ".2f")),
        ("wall / CPU time (s)", f"{s.wall_s:.2f} / {s.cpu_s:.2f}"),
    ]
    for k, v in rows:
        t.add_row(k, v)
    console.print(t)
    if "centralized" in result:
        print_centralized(result["centralized"], console)
    for w in result["warnings"][:10]:
        console.print(f"[yellow]warning:[/] {w}")


def print_centralized(c: Comparison, console: Console) -> None:
    from rich.table import Table

    t = Table(
        title="against rollouts on the learner's own GPUs (echo_rl/provisioning/sim/centralized.py)"
    )
    for col in (
        "pipeline",
        "GPUs (train / generate)",
        "step (s)",
        "bubble",
        "cost / step",
        "Echo saves",
    ):
        t.add_column(col, justify="right")
    t.add_row(
        "Echo (this run)",
        "-",
        "-",
        f"{c['echo_bubble_ratio']:.2%}",
        f"${c['echo_cost_per_step_usd']:.3f}",
        "-",
    )
    for r in c["baselines"]:
        b = Baseline.from_json(r)
        t.add_row(
            f"centralized {b.mode}",
            f"{b.gpus} ({b.training_gpus} / {b.generating_gpus})",
            f"{b.step_s:.0f}",
            f"{b.bubble_ratio:.1%}",
            f"${b.cost_per_step_usd:.3f}",
            f"{r['echo_saving']:.1%}",
        )
    console.print(t)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="echo-rl sim",
        description="Discrete-event simulation of "
        "an Echo run (learner, fleet, broadcast, provisioning, churn).",
    )
    p.add_argument("scenario", help="scenario TOML (see examples/sim/)")
    p.add_argument("--json", type=Path, default=None, help="write the full result here")
    p.add_argument("--plots", type=Path, default=None, help="write PNG plots into this folder")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a scenario key, e.g. --set run.steps=20 (repeatable)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def main(argv: list[str] | None = None) -> int:
    from echo_rl.provisioning.sim.api import run_scenario

    args = build_parser().parse_args(argv)
    try:
        sc = load_scenario(args.scenario, args.overrides)
        result = run_scenario(sc, progress=not args.no_progress)
    except ScenarioError as err:
        print(f"echo-rl sim: {err}", file=sys.stderr)
        return 2
    print_report(result)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1, default=_json_default) + "\n")
        print(f"wrote {args.json}")
    if args.plots:
        from echo_rl.provisioning.sim.plots import plot_run

        for path in plot_run(result, args.plots):
            print(f"wrote {path}")
    return 1 if SimSummary.from_json(result["summary"]).stalled else 0


def _json_default(x: object) -> JsonValue:
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating,)):
        return float(x)
    if isinstance(x, np.ndarray):
        listed: JsonValue = x.tolist()
        return listed
    raise TypeError(f"not JSON serialisable: {type(x)}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
