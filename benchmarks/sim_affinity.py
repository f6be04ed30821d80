"""Hardware-affinity routing in the simulator at 1,000 workers (docs/scheduling.md, "Affinity").

    .venv/bin/python benchmarks/sim_affinity.py

Runs ``examples/sim/affinity-1k.toml`` (1,000 workers, rollout-bound; a quarter of the tasks
long, samples' lengths geometric with mean 2,000 tokens up to 8,192, the rest mean 300) with
``rollout.affinity`` false and true, for three fleets: one kind of GPU (the control: speeds
spread only by a lognormal sigma of 0.2), and half RTX 5090s with half cards 3x and 6x
slower; each with 2 groups a request (the file's, as ``worker.groups_per_request``) and with 1.
A request lasts as long as its longest sample, so with 2 groups routing also puts like lengths
in one request; with 1 only the speeds are left to it. The routing is the learner's own picker
(``echo_rl.data.affinity.Picker``). Prints a table
(cost per step, bubble, step time, largest staleness, and affinity's ratio to none); writes
benchmarks/results/sim_affinity.json with the machine.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.sim_rows import save_sim, summary_row  # noqa: E402

SCENARIO = ROOT / "examples" / "sim" / "affinity-1k.toml"
# fleet label -> the slower half's speed and price (the file's first class: RTX 5090s, mu 0.2)
FLEETS = {
    "one kind": {"mu": 0.2, "price": 0.35},
    "half 3x slower": {"mu": 0.07, "price": 0.15},  # as the file
    "half 6x slower": {"mu": 0.0333, "price": 0.08},
}


def one(fleet: str, affinity: bool, gpr: int) -> dict[str, Any]:
    from echo_rl.provisioning.sim.core import Sim
    from echo_rl.provisioning.sim.scenario import apply_overrides, read_toml, scenario_from_dict

    data = apply_overrides(
        read_toml(SCENARIO),
        [f"rollout.affinity={str(affinity).lower()}", f"rollout.groups_per_request={gpr}"],
    )
    data["pool"]["classes"][1].update(FLEETS[fleet])
    sc = scenario_from_dict(data, SCENARIO.parent)
    s = Sim(sc).run()["summary"]
    assert not s["stalled"] and s["staleness_max"] <= sc.learner.staleness
    return {
        "fleet": fleet,
        "groups_per_request": gpr,
        "affinity": affinity,
        **summary_row(s),
    }


def main() -> int:
    rows = [one(f, a, g) for g in (2, 1) for f in FLEETS for a in (False, True)]
    lines = [
        f"{'fleet':<16}{'groups/req':>11}{'affinity':>9}{'$/step':>9}{'bubble':>8}{'s/step':>8}"
        f"{'stale traj':>12}{'s_max':>6}{'ratio':>8}"
    ]
    for r in rows:
        base = next(
            b
            for b in rows
            if (b["fleet"], b["groups_per_request"]) == (r["fleet"], r["groups_per_request"])
            and not b["affinity"]
        )
        r["ratio_vs_off"] = base["cost_per_step"] / r["cost_per_step"]
        lines.append(
            f"{r['fleet']:<16}{r['groups_per_request']:>11}{str(r['affinity']):>9}"
            f"{r['cost_per_step']:>9.3f}"
            f"{r['bubble_ratio']:>8.1%}{r['step_s']:>8.1f}{r['dropped_stale']:>12,}"
            f"{r['staleness_max']:>6}{r['ratio_vs_off']:>8.2f}"
        )
    table = "\n".join(lines)
    save_sim(
        "benchmarks/sim_affinity.py",
        ROOT / "benchmarks" / "results" / "sim_affinity.json",
        str(SCENARIO.relative_to(ROOT)),
        rows,
        table,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
