"""Sybil joins against a training learner (issue 31, item 5; docs/security.md, "Sybils").

    .venv/bin/python benchmarks/sybil_joins.py [--baseline-s 40] [--hold-s 30] [--json FILE]

A real learner in open mode (``security.join = "open"``, the documented limits: 50 joins/s,
1,024 sessions, the newcomer budget per /24) with 2 honest workers, the toy config of
``benchmarks/security_drill.py``. Its step rate is measured for ``--baseline-s`` seconds, then
during each flood of fresh CurveZMQ keys (``benchmarks/drill_sybil.py`` ``sybil_flood``, each in
its own process): 1,000 and 10,000 joins from one host, then 1,000 from 1,000 /24 networks (the
prefix budget does not bind; the learner-wide limits do). Each admitted Sybil heartbeats for
``--hold-s`` seconds, half report an install. Recorded per phase: steps/s against the baseline,
whether the learner is alive, the honest workers' admitted samples, the learner's counters.
Writes benchmarks/results/sybil_joins.json with the machine, the command and the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from security_drill import OVERRIDES, Fleet, Sampler, api_state, counters, delta  # noqa: E402

OPEN = [o for o in OVERRIDES if not o.startswith("security.join")] + ['security.join="open"']
PHASES = [
    ("one_host_1000", 1000, "one"),
    ("one_host_10000", 10000, "one"),
    ("many_prefixes_1000", 1000, "many"),
]


def _session_stats(url: str) -> dict[str, Any]:
    state = api_state(url)
    return {
        k: state.get(k) for k in ("sessions", "pending_workers", "notices", "slow") if k in state
    }


def phase(
    fleet: Fleet, sampler: Sampler, name: str, n: int, hosts: str, hold_s: float, base: float
) -> dict[str, Any]:
    url = fleet.info["metrics"]
    before, adm0 = counters(url), fleet.admitted()
    sampler.take()
    s0, t0 = fleet.step(), time.monotonic()
    argv = [
        sys.executable,
        str(Path(__file__).resolve()),
        "attack",
        "--n",
        str(n),
        "--hosts",
        hosts,
        "--hold-s",
        str(hold_s),
        "--line",
        fleet.line,
        "--run-dir",
        str(fleet.run),
    ]
    proc = fleet.group.start(
        f"sybil-{name}", argv, fleet.tmp / f"sybil-{name}.err", pipe_stdout=True
    )
    try:
        out, _ = proc.communicate(timeout=900)
        report = json.loads(out.decode().strip().splitlines()[-1])
    except (subprocess.TimeoutExpired, IndexError, ValueError):
        fleet.group.stop(f"sybil-{name}")
        report = {"error": (fleet.tmp / f"sybil-{name}.err").read_text()[-800:]}
    alive = fleet.alive("learner")
    wall = time.monotonic() - t0
    steps = (fleet.step() - s0) if alive else None
    adm1 = fleet.admitted() if alive else {}
    r = {
        "phase": name,
        "wall_s": round(wall, 1),
        "attacker": report,
        "learner_alive": alive,
        "steps_during": steps,
        "steps_per_s": round(steps / wall, 3) if steps is not None else 0.0,
        "honest_admitted": {w: adm1.get(w, 0) - adm0.get(w, 0) for w in ("w0", "w1")},
        "honest_alive": all(fleet.alive(w) for w in ("w0", "w1")),
        "counted": delta(counters(url), before) if alive else {},
        "learner": _session_stats(url) if alive else {},
        **sampler.take(),
        "load_avg_after": os.getloadavg(),
        "baseline_steps_per_s": base,
    }
    r["steps_vs_baseline"] = round(r["steps_per_s"] / max(base, 1e-9), 3)
    from drill_sybil import check_sybil

    r["problems"] = check_sybil(r)
    print(
        f"{name}: {r['steps_vs_baseline']}x, {r['problems'] or 'ok'}", file=sys.stderr, flush=True
    )
    return r


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline-s", type=float, default=40.0)
    ap.add_argument("--hold-s", type=float, default=30.0)
    ap.add_argument("--json", default=str(ROOT / "benchmarks/results/sybil_joins.json"))
    args = ap.parse_args(argv)
    from echo_rl.core.machine import write_result

    t0 = time.monotonic()
    load0 = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        fleet = Fleet(Path(tmp), OPEN)
        try:
            fleet.start()
            sampler = Sampler({"learner": fleet.pid("learner")})
            sampler.start()
            s0, b0 = fleet.step(), time.monotonic()
            time.sleep(args.baseline_s)
            wall = time.monotonic() - b0
            base = (fleet.step() - s0) / wall
            baseline = {
                "seconds": round(wall, 1),
                "steps_per_s": round(base, 3),
                **sampler.take(),
                "load_avg": os.getloadavg(),
            }
            print(f"baseline: {baseline}", file=sys.stderr, flush=True)
            phases = [
                phase(fleet, sampler, name, n, hosts, args.hold_s, base)
                for name, n, hosts in PHASES
                if fleet.alive("learner")
            ]
            rcs = fleet.stop()
        finally:
            fleet.group.stop_all()
    result = {
        "command": " ".join(
            [".venv/bin/python", "benchmarks/sybil_joins.py", *(argv or sys.argv[1:])]
        ),
        "overrides": OPEN,
        "load_avg_at_start": load0,
        "wall_s": round(time.monotonic() - t0, 1),
        "baseline": baseline,
        "phases": phases,
        "exit_codes": rcs,
        "target_met": all(not p["problems"] for p in phases) and len(phases) == len(PHASES),
    }
    write_result(args.json, result)
    print(
        json.dumps(
            {
                p["phase"]: [p["steps_vs_baseline"], p["attacker"].get("joined"), p["problems"]]
                for p in phases
            }
        ),
        flush=True,
    )
    return 0 if result["target_met"] else 1


def attack_main(argv: list[str]) -> int:
    from drill_attacks import Target
    from drill_sybil import sybil_flood

    ap = argparse.ArgumentParser(prog="sybil_joins.py attack")
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--hosts", choices=["one", "many"], default="one")
    ap.add_argument("--hold-s", type=float, default=30.0)
    ap.add_argument("--line", required=True)
    ap.add_argument("--run-dir", type=Path, required=True)
    args = ap.parse_args(argv)
    target = Target(args.line, args.run_dir, "", "", "")
    print(json.dumps(sybil_flood(target, args.n, args.hosts, args.hold_s), default=str), flush=True)
    target.ctx.destroy(linger=0)
    return 0


if __name__ == "__main__":
    sys.exit(attack_main(sys.argv[2:]) if sys.argv[1:2] == ["attack"] else main())
