"""PNG plots of a simulator result (matplotlib, Agg backend; imported only when plotting)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from echo_rl.provisioning.sim.summary import SimSummary

if TYPE_CHECKING:
    from echo_rl.provisioning.sim.core import SimResult


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_run(result: SimResult, out_dir: str | Path) -> list[Path]:
    """One 2x2 figure per run: learner wait and staleness per step, active set and capacity
    over time, T_bcast per publication, cost per step. Returns the files written."""
    from echo_rl.provisioning.sim.core import scenario_number, scenario_value

    plt = _plt()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    s = SimSummary.from_json(result["summary"])
    name = scenario_value(result, "run", "name")
    staleness = scenario_number(result, "learner", "staleness")
    q = scenario_number(result, "broadcast", "q")
    steps = result["steps"]
    fig, ax = plt.subplots(2, 2, figsize=(12, 8))
    fig.suptitle(
        f"{name}: B = {s.bubble_ratio:.2%}, s_max = {s.staleness_max} "
        f"(S = {staleness}), ${s.cost_per_step_usd:.3f}/step"
        if s.bubble_ratio is not None
        else name
    )

    a = ax[0][0]
    x = [r["step"] for r in steps]
    a.bar(x, [r["wait_s"] for r in steps], color="tab:red", label="T_wait (s)")
    a.set_xlabel("learner step")
    a.set_ylabel("T_wait (s)")
    a2 = a.twinx()
    a2.step(
        x, [r["staleness"] for r in steps], where="mid", color="tab:blue", label="staleness s_t"
    )
    a2.axhline(staleness, color="tab:blue", ls=":", lw=1)
    a2.set_ylabel("staleness (versions)")
    a2.set_ylim(bottom=0, top=staleness + 1)
    a.set_title("learner wait and staleness per step (dotted: S)")

    a = ax[0][1]
    tl = result["active_timeline"]
    if tl:
        t = [r[0] / 3600 for r in tl] + [(s.sim_time_s or 0.0) / 3600]
        n = [r[1] for r in tl] + [tl[-1][1]]
        mu = [r[2] for r in tl] + [tl[-1][2]]
        a.step(t, n, where="post", color="tab:green", label="active workers")
        a.set_ylabel("active workers")
        a.set_ylim(bottom=0)
        a3 = a.twinx()
        a3.step(t, mu, where="post", color="tab:purple", label="sum mu (active)")
        req = [(tt / 3600, r) for tt, r in result["mu_req_history"] if r is not None]
        if req:
            alpha = scenario_number(result, "provisioning", "alpha")
            a3.step(
                [r[0] for r in req] + [(s.sim_time_s or 0.0) / 3600],
                [alpha * r[1] for r in req] + [alpha * req[-1][1]],
                where="post",
                color="tab:purple",
                ls="--",
                label="alpha x mu_req",
            )
        a3.set_ylabel("trajectories/s")
        a3.set_ylim(bottom=0)
        a3.legend(loc="lower right", fontsize=8)
    a.set_xlabel("simulated time (h)")
    a.set_title("active set over time")

    a = ax[1][0]
    pubs = [p for p in result["publications"] if p["recipients"]]
    if pubs:
        a.plot(
            [p["version"] for p in pubs],
            [p["t_bcast_s"] for p in pubs],
            "o-",
            label=f"T_bcast (q={q:g})",
        )
        if q < 1:
            a.plot(
                [p["version"] for p in pubs],
                [p["tail_s"] for p in pubs],
                "-",
                color="tab:gray",
                lw=1,
                label="last recipient (q=1)",
            )
        lbs = [(p["version"], p["lower_bound_s"]) for p in pubs if p["lower_bound_s"]]
        if lbs:
            a.plot(
                [v for v, _ in lbs], [b for _, b in lbs], "k:", label="lower bound (all recipients)"
            )
        a.axhline(
            scenario_number(result, "learner", "t_train_s"),
            color="tab:red",
            ls="--",
            lw=1,
            label="T_train",
        )
        a.legend(fontsize=8)
    a.set_xlabel("published version")
    a.set_ylabel("seconds")
    a.set_title(f"broadcast per publication ({scenario_value(result, 'broadcast', 'topology')})")

    a = ax[1][1]
    a.plot(x, [r["cost_usd"] for r in steps], color="tab:orange")
    a.set_xlabel("learner step")
    a.set_ylabel("$ per step")
    a.set_title("cost per step (learner + active workers)")
    a.set_ylim(bottom=0)

    fig.tight_layout()
    path = out / f"{name}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]
