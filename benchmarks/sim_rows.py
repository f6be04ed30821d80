"""What the single-job simulator's before/after benchmarks (sim_tail.py, sim_affinity.py) keep
of a run, and their result file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from echo_rl.core.machine import write_result


def summary_row(s: dict[str, Any]) -> dict[str, Any]:
    """A run's figures from ``Sim(...).run()["summary"]``."""
    return {
        "cost_per_step": s["cost_per_step_usd"],
        "bubble_ratio": s["bubble_ratio"],
        "step_s": s["t_train_s_per_step"] + s["wait_s_per_step"],
        "dropped_stale": s["trajectories"]["dropped_stale"],
        "staleness_max": s["staleness_max"],
    }


def save_sim(script: str, out: Path, scenario: str, rows: list[dict[str, Any]], table: str) -> None:
    print(table)
    write_result(out, {"generated_by": script, "scenario": scenario, "rows": rows, "table": table})
    print(f"wrote {out}")
