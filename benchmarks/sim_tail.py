"""The long-tail cut in the simulator at 1,000 workers (docs/scheduling.md, "Long-tail cut").

    .venv/bin/python benchmarks/sim_tail.py

Runs ``examples/sim/tail-1k.toml`` (1,000 workers, rollout-bound, sample lengths geometric with
mean 2,000 tokens, cap 8,192) with ``rollout.tail_cut`` 0 and 0.75, for decode steps whose cost
is flat in the batch's rows (``rollout.decode_row_cost = 0``: a GPU's memory-bound decode),
half and half, and in proportion to the rows (1: a CPU). Prints a table (cost per step, bubble,
step time, groups dropped as stale, and the cut's ratio to no cut); writes
benchmarks/results/sim_tail.json with the machine.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.sim_rows import save_sim, summary_row  # noqa: E402

SCENARIO = ROOT / "examples" / "sim" / "tail-1k.toml"


def one(tail: float, row_cost: float) -> dict[str, Any]:
    from echo_rl.provisioning.sim.core import Sim
    from echo_rl.provisioning.sim.scenario import load_scenario

    sc = load_scenario(
        SCENARIO, [f"rollout.tail_cut={tail}", f"rollout.decode_row_cost={row_cost}"]
    )
    r = Sim(sc).run()
    s = r["summary"]
    assert not s["stalled"] and s["staleness_max"] <= sc.learner.staleness
    return {
        "tail_cut": tail,
        "decode_row_cost": row_cost,
        **summary_row(s),
    }


def main() -> int:
    rows = [one(t, rc) for rc in (0.0, 0.5, 1.0) for t in (0.0, 0.75)]
    lines = [
        f"{'row cost':>9}{'tail_cut':>9}{'$/step':>9}{'bubble':>8}{'s/step':>8}"
        f"{'stale traj':>12}{'ratio':>8}"
    ]
    for r in rows:
        base = next(
            b for b in rows if b["decode_row_cost"] == r["decode_row_cost"] and not b["tail_cut"]
        )
        r["ratio_vs_no_cut"] = base["cost_per_step"] / r["cost_per_step"]
        lines.append(
            f"{r['decode_row_cost']:>9}{r['tail_cut']:>9}{r['cost_per_step']:>9.3f}"
            f"{r['bubble_ratio']:>8.1%}{r['step_s']:>8.1f}{r['dropped_stale']:>12,}"
            f"{r['ratio_vs_no_cut']:>8.2f}"
        )
    table = "\n".join(lines)
    save_sim(
        "benchmarks/sim_tail.py",
        ROOT / "benchmarks" / "results" / "sim_tail.json",
        str(SCENARIO.relative_to(ROOT)),
        rows,
        table,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
