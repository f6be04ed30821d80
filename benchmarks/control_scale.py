"""How large a fleet one learner core serves: the load model (echo_rl.provisioning.sim.control_load) fed
with the costs benchmarks/load_control.py measured, from 100 to 100,000 workers, with the
heartbeat and poll periods fixed (before issue 38) and scaled to the fleet (now).

    .venv/bin/python benchmarks/control_scale.py [--from benchmarks/results/load_control.json]
        # writes benchmarks/results/control_scale.json and docs/img/control_scale.png
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SIZES = [100, 300, 1_000, 3_000, 10_000, 30_000, 100_000]


def main(argv: list[str] | None = None) -> int:
    from echo_rl.provisioning.sim.control_load import ControlCosts, curve, saturation

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--from", dest="source", type=Path, default=ROOT / "benchmarks/results/load_control.json"
    )
    ap.add_argument("--json", type=Path, default=ROOT / "benchmarks/results/control_scale.json")
    ap.add_argument("--plot", type=Path, default=ROOT / "docs/img/control_scale.png")
    args = ap.parse_args(argv)
    measured = json.loads(args.source.read_text())
    run = max(measured["results"], key=lambda r: r["workers"])  # the largest fleet measured
    costs = ControlCosts(**run["cpu"]["model"])
    hb_s, budget = run["heartbeat_s"], run["heartbeats_per_s"]
    rows = curve(costs, hb_s, budget, SIZES)
    out = {
        "source": str(args.source.relative_to(ROOT))
        if args.source.is_relative_to(ROOT)
        else str(args.source),
        "measured_at_workers": run["workers"],
        "machine": measured.get("machine"),
        "costs": run["cpu"]["model"],
        "heartbeat_s": hb_s,
        "heartbeats_per_s": budget,
        "saturates_at": {
            "fixed": saturation(costs, hb_s, budget, False),
            "scaled": saturation(costs, hb_s, budget, True),
        },
        "core_share": rows,
    }
    args.json.write_text(json.dumps(out, indent=2))
    print(f"costs measured at {run['workers']} workers: {run['cpu']['model']}")
    print(f"{'workers':>9} {'fixed':>8} {'scaled':>8}   (share of one core)")
    for r in rows:
        print(f"{r['workers']:>9,} {r['fixed']:>8.2f} {r['scaled']:>8.2f}")
    print(
        f"one core saturates at {out['saturates_at']['fixed']:,} workers (fixed periods) and "
        f"{out['saturates_at']['scaled']:,} (scaled, transport.heartbeats_per_s = {budget:g})"
    )
    _plot(rows, out, args.plot)
    return 0


def _plot(rows: list[dict], out: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4))
    n = [r["workers"] for r in rows]
    ax.loglog(n, [r["fixed"] for r in rows], "o-", label="fixed periods (1 s beat, 0.5 s poll)")
    ax.loglog(
        n,
        [r["scaled"] for r in rows],
        "s-",
        label=f"scaled (transport.heartbeats_per_s = {out['heartbeats_per_s']:g})",
    )
    ax.axhline(1.0, color="grey", ls="--", lw=1)
    ax.text(n[0], 1.08, "one core", color="grey")
    ax.set_xlabel("workers")
    ax.set_ylabel("learner control loop: share of one core")
    ax.set_title(f"control-plane load (costs measured at {out['measured_at_workers']} workers)")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
