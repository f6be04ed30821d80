"""Regenerate the simulator's paper reproductions and scale run (docs/simulator.md).

    .venv/bin/python benchmarks/reproduce_sim.py [--only fig3c,fig4,table2,scale,churn,churn_seeds,central]
                                                 [--out benchmarks/results/sim]

* fig3c  -- bubble ratio against pool size for S = 2, 3, 4 (paper Fig. 3c), from
            examples/sim/fig3c-bubble.toml; workers pause for each broadcast (as echo_rl/worker/agent.py
            does today) and, dotted, keep generating while downloading;
* fig4   -- T_bcast against N for star-unlimited, star-limited and chains (paper Fig. 4), from
            examples/sim/fig4-broadcast.toml, homogeneous and heterogeneous links;
* table2 -- the ablation table (paper Table 2) from examples/sim/table2-ablation.toml;
* scale  -- examples/sim/scale-10k.toml (10,000 workers, 100 steps) with its wall time, and the
            same run with the controller fed deliveries, and capacity (the oracle);
* churn  -- examples/sim/churn-controller.toml, the three controller measurements;
* churn_seeds -- the same scenario's default (busy) and oracle (capacity) runs over run.seed =
            1..6: one seed's ratio ranges 0.93-1.31 (the README's row states the spread, not
            one seed's value; the churn part above is seed 1);
* central -- examples/sim/centralized-8b.toml: Echo against rollouts on the learner's own A100s
            (sync on 8, async 4 + 4) and the saving as the A100's rollout rate grows.

Every result JSON carries the machine it ran on (echo_rl.core.machine.machine_info).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from echo_rl.core.steprow import COL  # noqa: E402
from echo_rl.provisioning import capacity  # noqa: E402
from echo_rl.provisioning.sim.api import simulate  # noqa: E402
from echo_rl.provisioning.sim.plots import _plt, plot_run  # noqa: E402
from echo_rl.provisioning.sim.report import _json_default, print_report  # noqa: E402
from echo_rl.provisioning.sim.summary import SIM  # noqa: E402

EX = ROOT / "examples" / "sim"
OUT = ROOT / "benchmarks" / "results" / "sim"
PAPER_TABLE2 = {  # ECHO-2 Table 2: (#machines, cost/step $, T_bcast s, wait s)
    "full": (9, 8.098, 1437, 0.0),
    "w/o P2P (9)": (9, 8.432, 1830, 131.9),
    "w/o P2P (10)": (10, 8.630, 1872, 84.1),
    "w/o cost": (9, 9.339, 1437, 0.0),
}


def _machine() -> dict[str, Any]:
    import numpy
    import simpy

    from echo_rl.core.machine import machine_info

    info = machine_info()
    info.update(numpy=numpy.__version__, simpy=simpy.__version__)
    return info


def _write(out: Path, name: str, data: dict[str, Any]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    data.setdefault("machine", _machine())
    data.setdefault("generated_by", "benchmarks/reproduce_sim.py")
    data.setdefault("started_at", time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    path = out / f"{name}.json"
    path.write_text(json.dumps(data, indent=1, default=_json_default) + "\n")
    return path


def _track(items: list, label: str):
    from rich.progress import track

    return track(items, description=label, transient=True)


def _console():
    from rich.console import Console

    return Console()


def _pool(count: int, mu: float, price: float) -> list[dict[str, Any]]:
    return [{"name": "rtx5090", "count": count, "mu": mu, "price": price}]


# ------------------------------------------------------------------------------ Fig. 3c


FIG3C_SIZES = [
    2,
    3,
    4,
    5,
    6,
    7,
    8,
    9,
    10,
    12,
    14,
    16,
    18,
    20,
    22,
    24,
    26,
    28,
    30,
    32,
    34,
    36,
    40,
    44,
    48,
]


def fig3c(out: Path) -> dict[str, Any]:
    path = EX / "fig3c-bubble.toml"
    mu, price = 0.28, 0.35
    jobs = [(S, gdd, n) for S in (2, 3, 4) for gdd in (False, True) for n in FIG3C_SIZES]
    rows = []
    for S, gdd, n in _track(jobs, "Fig. 3c sweep"):
        r = simulate(
            path,
            {
                "learner.staleness": S,
                "pool.classes": _pool(n, mu, price),
                "rollout.generate_during_download": gdd,
            },
            machine=False,
        )
        s = r["summary"]
        rows.append(
            {
                "S": S,
                "generate_during_download": gdd,
                "workers": n,
                "capacity": n * mu,
                COL.bubble_ratio: s[COL.bubble_ratio],
                SIM.wait_s_per_step: s[SIM.wait_s_per_step],
                COL.staleness_max: s[COL.staleness_max],
                "t_bcast_s": s[SIM.t_bcast_mean_s],
                "kappa": s["kappa"],
                COL.dropped_stale: s["trajectories"][COL.dropped_stale],
            }
        )
    L = {"t_train_s": 1631.2, "n": 2048}
    summary = []
    for S in (2, 3, 4):
        sub = [r for r in rows if r["S"] == S]
        kappa, t_b = sub[0]["kappa"], sub[0]["t_bcast_s"]
        req = capacity.mu_req(L["n"], kappa, L["t_train_s"], t_b)
        item = {"S": S, "kappa": kappa, "t_bcast_s": t_b, "mu_req": req, "mu_req_workers": req / mu}
        for gdd in (False, True):
            pts = [r for r in sub if r["generate_during_download"] == gdd]
            zero = [r["workers"] for r in pts if r[COL.bubble_ratio] < 0.01]
            first = min(zero) if zero else None
            # smallest pool from which every larger pool in the sweep stays below 1 %
            stable = next(
                (
                    r["workers"]
                    for r in pts
                    if all(q[COL.bubble_ratio] < 0.01 for q in pts if q["workers"] >= r["workers"])
                ),
                None,
            )
            key = "continue" if gdd else "pause"
            item[f"threshold_workers_{key}"] = stable
            item[f"first_below_1pct_{key}"] = first
            item[f"max_staleness_{key}"] = max(r[COL.staleness_max] for r in pts)
        summary.append(item)
    data = {
        "benchmark": "sim-fig3c",
        "scenario": str(path.relative_to(ROOT)),
        "worker_mu": mu,
        "n_per_step": L["n"],
        "t_train_s": L["t_train_s"],
        "throughput_floor_N_over_T": L["n"] / L["t_train_s"],
        "summary": summary,
        "rows": rows,
    }
    _write(out, "fig3c", data)
    _plot_fig3c(data, out / "fig3c.png")
    t = _table(
        "Fig. 3c: bubble ratio vs pool size (RTX 5090 at 0.28 traj/s each)",
        [
            "S",
            "kappa",
            "T_bcast (s)",
            "mu_req (traj/s)",
            "= workers",
            "B<1% from (pause)",
            "B<1% from (download in bg)",
            "s_max",
        ],
    )
    for it in summary:
        t.add_row(
            str(it["S"]),
            str(it["kappa"]),
            f"{it['t_bcast_s']:.0f}",
            f"{it['mu_req']:.3f}",
            f"{it['mu_req_workers']:.1f}",
            str(it["threshold_workers_pause"]),
            str(it["threshold_workers_continue"]),
            f"{max(it['max_staleness_pause'], it['max_staleness_continue'])}",
        )
    _console().print(t)
    return data


def _plot_fig3c(data: dict[str, Any], path: Path) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 5))
    colors = {2: "tab:red", 3: "tab:blue", 4: "tab:green"}
    for it in data["summary"]:
        S = it["S"]
        for gdd, style in ((False, "-o"), (True, ":")):
            pts = [r for r in data["rows"] if r["S"] == S and r["generate_during_download"] == gdd]
            ax.plot(
                [r["workers"] for r in pts],
                [r[COL.bubble_ratio] for r in pts],
                style,
                color=colors[S],
                ms=3,
                label=(
                    f"S={S} (kappa={it['kappa']})" if not gdd else f"S={S}, download in background"
                ),
            )
        ax.axvline(it["mu_req_workers"], color=colors[S], ls="--", lw=1)
    ax.axvline(
        data["throughput_floor_N_over_T"] / data["worker_mu"],
        color="gray",
        ls="-.",
        lw=1,
        label="N / T_train (throughput floor)",
    )
    ax.set_xlabel("rollout pool size (RTX 5090 workers, 0.28 traj/s each)")
    ax.set_ylabel("learner bubble ratio B")
    ax.set_title("Bubble ratio vs pool size (dashed: predicted threshold mu_req / mu)")
    ax.legend(fontsize=8)
    ax.set_ylim(bottom=0)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------ Fig. 4


FIG4_N = [1, 2, 4, 8, 10, 16, 24, 32, 48, 64, 96, 128]
TOPOLOGIES = ["star-unlimited", "star", "chains"]


def fig4(out: Path) -> dict[str, Any]:
    path = EX / "fig4-broadcast.toml"
    variants = {
        "homogeneous": {},
        "consumer": {"pool.up_mbit": 40.0, "pool.up_sigma": 0.5, "pool.reachable": 0.9},
    }
    jobs = [(v, topo, n) for v in variants for topo in TOPOLOGIES for n in FIG4_N]
    rows = []
    for v, topo, n in _track(jobs, "Fig. 4 sweep"):
        over = {"broadcast.topology": topo, "pool.classes": _pool(n, 0.28, 0.35)}
        over.update(variants[v])
        r = simulate(path, over, machine=False)
        pubs = [p for p in r["publications"] if p["recipients"]]
        rows.append(
            {
                "links": v,
                "topology": topo,
                "workers": n,
                "t_bcast_s": statistics.mean(p["t_bcast_s"] for p in pubs),
                "lower_bound_s": pubs[0]["lower_bound_s"],
                "streams": pubs[0]["streams"],
                "egress_gb": pubs[0]["egress_gb"],
                "mode": pubs[0]["mode"],
            }
        )
    data = {
        "benchmark": "sim-fig4",
        "scenario": str(path.relative_to(ROOT)),
        "snapshot_gb": 16.4,
        "uplink_mbit": 1000,
        "link_mbit": 100,
        "rows": rows,
    }
    _write(out, "fig4", data)
    _plot_fig4(data, out / "fig4.png")
    t = _table(
        "Fig. 4: T_bcast (s) vs N, 16.4 GB snapshot, U = 1000, b = 100 Mbit/s",
        [
            "links",
            "N",
            "star-unlimited",
            "star-limited",
            "chains",
            "lower bound",
            "chains / star-unl.",
            "star-lim. / chains",
        ],
    )
    for v in variants:
        for n in FIG4_N:
            got = {r["topology"]: r for r in rows if r["links"] == v and r["workers"] == n}
            su, st, ch = (got[x]["t_bcast_s"] for x in TOPOLOGIES)
            t.add_row(
                v,
                str(n),
                f"{su:.0f}",
                f"{st:.0f}",
                f"{ch:.0f}",
                f"{got['chains']['lower_bound_s']:.0f}",
                f"{ch / su:.3f}",
                f"{st / ch:.2f}",
            )
    _console().print(t)
    return data


def _plot_fig4(data: dict[str, Any], path: Path) -> None:
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8), sharey=True)
    style = {
        "star-unlimited": ("tab:green", "s-"),
        "star": ("tab:red", "o-"),
        "chains": ("tab:blue", "^-"),
    }
    names = {
        "star-unlimited": "star-unlimited",
        "star": "star-limited",
        "chains": "chains (P2P, pipelined)",
    }
    for ax, v in zip(axes, ("homogeneous", "consumer")):
        for topo in TOPOLOGIES:
            pts = [r for r in data["rows"] if r["links"] == v and r["topology"] == topo]
            c, m = style[topo]
            ax.plot(
                [r["workers"] for r in pts],
                [r["t_bcast_s"] for r in pts],
                m,
                color=c,
                ms=4,
                label=names[topo],
            )
        lb = [r for r in data["rows"] if r["links"] == v and r["topology"] == "chains"]
        ax.plot(
            [r["workers"] for r in lb], [r["lower_bound_s"] for r in lb], "k:", label="lower bound"
        )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("active workers N")
        ax.set_title(
            "100 Mbit/s down and up"
            if v == "homogeneous"
            else "100 down, ~40 up (lognormal, sigma 0.5), 10% behind NAT"
        )
        ax.legend(fontsize=8)
    axes[0].set_ylabel("T_bcast (s), all workers installed")
    fig.suptitle("Broadcast time vs fleet size: 16.4 GB snapshot, learner uplink 1000 Mbit/s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------ Table 2


def table2(out: Path) -> dict[str, Any]:
    path = EX / "table2-ablation.toml"
    rows_def = [
        ("full", {}, [0]),
        ("w/o P2P (9)", {"broadcast.topology": "star", "provisioning.active": 9}, [0]),
        ("w/o P2P (10)", {"broadcast.topology": "star", "provisioning.active": 10}, [0]),
        ("w/o cost", {"provisioning.selection": "random"}, [0, 1, 2, 3, 4]),
    ]
    rows = []
    for name, over, seeds in _track(rows_def, "Table 2"):
        runs = []
        for seed in seeds:
            r = simulate(path, dict(over, **{"run.seed": seed}), machine=False)
            runs.append(r["summary"] | {"initial": r["initial"]})
        mean = lambda k: statistics.mean(x[k] for x in runs)  # noqa: B023, E731
        rows.append(
            {
                "method": name,
                "machines": mean(SIM.active_mean),
                SIM.cost_per_step_usd: mean(SIM.cost_per_step_usd),
                "t_bcast_s": mean(SIM.t_bcast_mean_s),
                "wait_s": mean(SIM.wait_s_per_step),
                COL.bubble_ratio: mean(COL.bubble_ratio),
                COL.staleness_max: max(x[COL.staleness_max] for x in runs),
                SIM.usd_per_1k_trajectories: mean(SIM.usd_per_1k_trajectories),
                "worker_cost_per_hour": mean_initial(runs, "cost_per_hour"),
                "seeds": seeds,
                "runs": runs,
                "overrides": over,
                "paper": dict(
                    zip(
                        ("machines", SIM.cost_per_step_usd, "t_bcast_s", "wait_s"),
                        PAPER_TABLE2[name],
                    )
                ),
            }
        )
    full = rows[0]
    for r in rows:
        r["cost_vs_full"] = r[SIM.cost_per_step_usd] / full[SIM.cost_per_step_usd]
        r["paper"]["cost_vs_full"] = r["paper"][SIM.cost_per_step_usd] / PAPER_TABLE2["full"][1]
    data = {
        "benchmark": "sim-table2",
        "scenario": str(path.relative_to(ROOT)),
        "prices": {"learner_per_hour": 3.06, "worker_list_per_hour": 0.35},
        "rows": rows,
    }
    _write(out, "table2", data)
    t = _table(
        "Table 2 (simulated; paper's figures in brackets)",
        [
            "method",
            "#mach",
            "cost/step ($)",
            "T_bcast (s)",
            "wait (s)",
            "B",
            "cost vs full (paper)",
        ],
    )
    for r in rows:
        p = r["paper"]
        t.add_row(
            r["method"],
            f"{r['machines']:.0f} [{p['machines']}]",
            f"{r[SIM.cost_per_step_usd]:.3f} [{p[SIM.cost_per_step_usd]}]",
            f"{r['t_bcast_s']:.0f} [{p['t_bcast_s']}]",
            f"{r['wait_s']:.1f} [{p['wait_s']}]",
            f"{r[COL.bubble_ratio]:.2%}",
            f"{r['cost_vs_full']:.3f} [{p['cost_vs_full']:.3f}]",
        )
    _console().print(t)
    return data


def mean_initial(runs: list[dict[str, Any]], key: str) -> float:
    return statistics.mean(x["initial"][key] for x in runs)


# ------------------------------------------------------------------------------ scale, churn


def _full_run(out: Path, scenario: str, name: str, over: dict[str, Any]) -> dict[str, Any]:
    r = simulate(EX / scenario, dict(over, **{"run.name": name}), progress=True)
    r["command"] = (
        f".venv/bin/python -m echo_rl.provisioning.sim examples/sim/{scenario}"
        + "".join(f" --set {k}={json.dumps(v)}" for k, v in over.items())
    )
    _write(out, name, r)
    plot_run(r, out)
    print_report(r)
    return r


def _measures(out: Path, toml: str, name: str) -> dict[str, Any]:
    """The controller fed busy time (the default, as the learner feeds it), deliveries over
    wall time, and the capacity oracle."""
    runs = {"busy": _full_run(out, toml, name, {})}
    for measure in ("delivered", "capacity"):
        runs[measure] = _full_run(out, toml, f"{name}-{measure}", {"provisioning.measure": measure})
    return {m: r["summary"] for m, r in runs.items()}


def scale(out: Path) -> dict[str, Any]:
    return _measures(out, "scale-10k.toml", "scale-10k")


def churn(out: Path) -> dict[str, Any]:
    return _measures(out, "churn-controller.toml", "churn-controller")


CHURN_SEEDS = (1, 2, 3, 4, 5, 6)


def churn_seeds(out: Path) -> dict[str, Any]:
    """Cost per step of the controller fed busy time over the capacity oracle's, per seed:
    churn makes one seed's figure swing (which workers leave, and when), so the figure is the
    spread over seeds, both measures on the same seed (the same churn)."""
    rows = []
    for seed in _track(list(CHURN_SEEDS), "churn seeds"):
        summary = {
            m: simulate(
                EX / "churn-controller.toml",
                {"run.seed": seed, "provisioning.measure": m},
            )["summary"]
            for m in ("busy", "capacity")
        }
        cost = {m: r["cost_per_step_usd"] for m, r in summary.items()}
        rows.append(
            {
                "seed": seed,
                **cost,
                "ratio": cost["busy"] / cost["capacity"],
                "bubble": summary["busy"]["bubble_ratio"],
            }
        )
    ratios = [r["ratio"] for r in rows]
    data = {
        "scenario": "examples/sim/churn-controller.toml",
        "rows": rows,
        "ratio_mean": statistics.mean(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "bubble_max": max(r["bubble"] for r in rows),
    }
    _write(out, "churn-seeds", data)
    t = _table(
        "churn-controller: cost per step, busy over the capacity oracle",
        ["seed", "busy $", "oracle $", "ratio"],
    )
    for r in rows:
        t.add_row(str(r["seed"]), f"{r['busy']:.3f}", f"{r['capacity']:.3f}", f"{r['ratio']:.3f}")
    t.add_row("mean", "", "", f"{data['ratio_mean']:.3f}")
    _console().print(t)
    return data


def central(out: Path) -> dict[str, Any]:
    """Echo against rollouts on the learner's own A100s (examples/sim/centralized-8b.toml): sync
    on 8 GPUs, async 4 + 4, and the saving as the A100's rollout rate grows."""
    from echo_rl.provisioning.sim.report import print_centralized

    base = _full_run(out, "centralized-8b.toml", "centralized-8b", {})
    rows = list(base["centralized"]["baselines"])
    sweep = []
    for mu in (0.3165, 0.5, 0.75, 1.0, 1.25):
        for mode, t_train in (("sync", 203.9), ("async", 407.8)):
            r = simulate(
                EX / "centralized-8b.toml",
                {
                    "centralized.mu_per_gpu": mu,
                    "centralized.modes": [mode],
                    "centralized.t_train_s": t_train,
                },
            )
            row = r["centralized"]["baselines"][0]
            if mu == 0.3165 and mode == "async":
                rows.append(row)
            sweep.append({"mu_per_gpu": mu, "a100_vs_5090": mu / 0.28, **row})
    base["centralized"]["baselines"] = rows
    print_centralized(base["centralized"], _console())
    t = _table(
        "Echo's saving as one A100's rollout rate grows (RTX 5090: 0.28 traj/s)",
        ["A100 traj/s", "A100 / 5090", "sync cost", "Echo saves", "async cost", "Echo saves"],
    )
    for mu in sorted({x["mu_per_gpu"] for x in sweep}):
        s_, a_ = (
            next(x for x in sweep if x["mu_per_gpu"] == mu and x["mode"] == m)
            for m in ("sync", "async")
        )
        t.add_row(
            f"{mu:g}",
            f"{mu / 0.28:.2f}",
            f"${s_[SIM.cost_per_step_usd]:.3f}",
            f"{s_['echo_saving']:.1%}",
            f"${a_[SIM.cost_per_step_usd]:.3f}",
            f"{a_['echo_saving']:.1%}",
        )
    _console().print(t)
    data = {
        "echo": base["summary"],
        "centralized": base["centralized"],
        "sweep": sweep,
        "command": ".venv/bin/python benchmarks/reproduce_sim.py --only central",
    }
    _write(out, "centralized-8b-comparison", data)
    return data


def _table(title: str, cols: list[str]):
    from rich.table import Table

    t = Table(title=title)
    for c in cols:
        t.add_column(c, justify="right")
    return t


PARTS = {
    "fig3c": fig3c,
    "fig4": fig4,
    "table2": table2,
    "scale": scale,
    "churn": churn,
    "churn_seeds": churn_seeds,
    "central": central,
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default=",".join(PARTS), help=f"comma list of {', '.join(PARTS)}")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    parts = [x.strip() for x in args.only.split(",") if x.strip()]
    bad = [x for x in parts if x not in PARTS]
    if bad:
        print(f"unknown part(s) {bad}; choose from {list(PARTS)}", file=sys.stderr)
        return 2
    for part in parts:
        t0 = time.perf_counter()
        PARTS[part](args.out)
        print(f"{part}: {time.perf_counter() - t0:.1f} s wall")
    return 0


if __name__ == "__main__":
    sys.exit(main())
