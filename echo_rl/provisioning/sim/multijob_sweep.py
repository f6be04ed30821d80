"""When sharing a fleet pays: the phase-contrast sweep of ``benchmarks/sim_multirun.py``
(docs/multirun.md).

Contrast ``c`` = a job's learner step time in its learner-bound phase / in its rollout-bound
phase. ``with_contrast`` rescales a scenario's two step-time levels per job to ``x`` and
``c x``, keeping each phase's duration and the job's time-averaged worker demand (the sum over
phases of duration / step time) as they were, so the dedicated demand split and the fleet's
headroom do not move with ``c``; only how unevenly each job's demand is spread over its cycle
does. ``c = 1`` is a job without phases (the control), and the example files are ``c = 4``.
``aligned`` puts every job's phases in step (all rollout-bound at once): sharing's control.

Each row also carries the offline bounds (echo_rl/provisioning/sim/multijob_bound.py): with the fleet
and every learner paid for the whole horizon in both modes, the whole bill is the same shared
and dedicated, so its ratio is shared steps / dedicated steps, and no schedule keeping the
staleness bound takes more steps than the linear relaxation there allows. ``bill_bound``: the
largest whole-bill ratio any sharing policy, offline or not, could reach on that fleet;
``every_job_bound``: the largest ``r`` with every job at ``r`` times its dedicated steps;
``ceiling_bound``: the learners' own ceiling alone (every batch ready when they are free).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

import numpy as np

from echo_rl.provisioning.sim.multijob_bound import OfflineBound, fleet_capacity, offline_bound
from echo_rl.provisioning.sim.multijob_scenario import MultiScenario, multi_from_dict

if TYPE_CHECKING:
    from echo_rl.provisioning.sim.multijob_report import MultiComparison


def with_contrast(sc: MultiScenario, contrast: float, aligned: bool = False) -> MultiScenario:
    """The scenario with every job's step-time contrast set to ``contrast`` (its shortest step
    time's phases are the rollout-bound ones, all others learner-bound), the time-averaged
    demand kept, and with ``aligned`` every ``phase_offset_s`` set to 0."""
    if contrast < 1:
        raise ValueError(f"contrast = {contrast}: use 1 (no phases) or more")
    data = copy.deepcopy(sc.model_dump())
    for job in data["jobs"]:
        phases = job["phases"]
        lo = min(p["t_train_s"] for p in phases)
        rate = sum(p["duration_s"] / p["t_train_s"] for p in phases)  # steps per cycle
        d_lo = sum(p["duration_s"] for p in phases if p["t_train_s"] == lo)
        d_hi = sum(p["duration_s"] for p in phases) - d_lo
        x = (d_lo + d_hi / contrast) / rate
        for p in phases:
            p["t_train_s"] = round(x if p["t_train_s"] == lo else x * contrast, 6)
        if aligned:
            job["phase_offset_s"] = 0.0
    data["run"]["name"] = (
        f"{len(data['jobs'])} jobs, {'aligned' if aligned else 'offset'}, contrast {contrast:g}"
    )
    return multi_from_dict(data)


class SweepRow(TypedDict):
    """One sweep setting (``sweep_row``): the ratios, the bounds and the steps behind them."""

    jobs: int
    phases: str  # "aligned" or "offset"
    contrast: float
    ratio_min: float | None  # the worst job's dedicated / shared $ per step
    ratio_max: float | None
    ratio_per_job: dict[str, float | None]
    ratio_whole_bill: float | None
    idle_dedicated: float
    idle_shared: float
    ceiling_bound: float | None
    bill_bound: float | None  # offline bounds (None without the scenario)
    every_job_bound: float | None
    steps_dedicated: int
    steps_shared: int
    steps_ceiling: float
    staleness_max_dedicated: list[int]
    staleness_max_shared: list[int]
    S: list[int]


def sweep_row(
    res: MultiComparison, contrast: float, aligned: bool, sc: MultiScenario | None = None
) -> SweepRow:
    """One sweep setting, from ``multijob_report.compare``'s result; with ``sc`` (the scenario
    it ran) the offline bounds too."""
    ded, sh = res["dedicated"], res["shared"]
    ratios = [j["ratio"] for j in sh["jobs"]]
    for d, s in zip(ded["jobs"], sh["jobs"], strict=True):
        assert d["staleness_max"] <= d["S"] and s["staleness_max"] <= s["S"], (d, s)
    whole = (
        ded["usd_per_total_step"] / sh["usd_per_total_step"]
        if ded["usd_per_total_step"] and sh["usd_per_total_step"]
        else None
    )
    steps_ded = sum(j["steps"] for j in ded["jobs"])
    ceiling = sum(j["steps_if_learner_never_waits"] for j in sh["jobs"])
    lp: OfflineBound | None = (
        offline_bound(sc, [j["steps"] for j in ded["jobs"]], fleet_capacity(sc))
        if sc is not None
        else None
    )
    return {
        "jobs": len(sh["jobs"]),
        "phases": "aligned" if aligned else "offset",
        "contrast": contrast,
        "ratio_min": min(r for r in ratios if r is not None) if any(ratios) else None,
        "ratio_max": max(r for r in ratios if r is not None) if any(ratios) else None,
        "ratio_per_job": {s["name"]: s["ratio"] for s in sh["jobs"]},
        "ratio_whole_bill": whole,
        "idle_dedicated": ded["idle_fraction"],
        "idle_shared": sh["idle_fraction"],
        "ceiling_bound": ceiling / steps_ded if steps_ded else None,
        "bill_bound": lp["bill_bound"] if lp is not None else None,
        "every_job_bound": lp["every_job_bound"] if lp is not None else None,
        "steps_dedicated": steps_ded,
        "steps_shared": sum(j["steps"] for j in sh["jobs"]),
        "steps_ceiling": ceiling,
        "staleness_max_dedicated": [j["staleness_max"] for j in ded["jobs"]],
        "staleness_max_shared": [j["staleness_max"] for j in sh["jobs"]],
        "S": [j["S"] for j in sh["jobs"]],
    }


def sweep_table(rows: list[SweepRow]) -> str:
    """The sweep as a fixed-width text table, one line per setting."""
    cols = (
        f"{'jobs':>4} {'phases':<8}{'c':>3}{'ratio min':>10}{'max':>6}{'bill':>6}"
        f"{'bound bill/every':>17}"
        f"{'idle d/s':>13}{'steps d/s/ceil':>16}  s_max d/s vs S (per job)"
    )
    lines = [cols]
    for r in rows:
        smax = " ".join(
            f"{d}/{s}<={S}"
            for d, s, S in zip(
                r["staleness_max_dedicated"], r["staleness_max_shared"], r["S"], strict=True
            )
        )
        steps = f"{r['steps_dedicated']}/{r['steps_shared']}/{r['steps_ceiling']:g}"
        lines.append(
            f"{r['jobs']:>4} {r['phases']:<8}{r['contrast']:>3g}"
            f"{_x(r['ratio_min']):>10}{_x(r['ratio_max']):>6}{_x(r['ratio_whole_bill']):>6}"
            f"{_x(r['bill_bound']):>11}/{_x(r['every_job_bound']):<5}"
            # max(0, .): a fleet busy throughout computes as -1e-17 idle, printed "-0.0%"
            f"{max(0.0, r['idle_dedicated']):>7.1%}/{max(0.0, r['idle_shared']):<5.1%}"
            f"{steps:>16}  {smax}"
        )
    return "\n".join(lines)


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def sweep_plot(rows: list[SweepRow], path: str | Path, target: float = 1.3) -> Path:
    """Dedicated/shared $ per step against contrast, one colour per job count: the band spans
    the jobs' ratios (its lower edge, the worst job, is the line), dashed the whole bill,
    open triangles the offline bound on the worst job, dotted the aligned control's whole bill; the
    horizontal line is the target."""
    from echo_rl.provisioning.sim.plots import _plt

    plt = _plt()
    fig, a = plt.subplots(figsize=(7, 4.5))
    for n, colour in zip(sorted({r["jobs"] for r in rows}), ("C0", "C1", "C2", "C3"), strict=False):
        off = sorted(
            (r for r in rows if r["jobs"] == n and r["phases"] == "offset"),
            key=lambda r: r["contrast"],
        )
        c = np.array([r["contrast"] for r in off])
        lo = np.array([r["ratio_min"] for r in off])
        hi = np.array([r["ratio_max"] for r in off])
        a.plot(c, lo, "o-", color=colour, label=f"{n} jobs offset: worst job")
        a.fill_between(c, lo, hi, color=colour, alpha=0.15)
        a.plot(c, [r["ratio_whole_bill"] for r in off], "--", color=colour, lw=1)
        # The offline bound on every job (multijob_bound.py): no policy lifts the worst above it.
        a.plot(c, [r["every_job_bound"] for r in off], "^", color=colour, ms=6, mfc="none")
        al = sorted(
            (
                r
                for r in rows
                if r["jobs"] == n and (r["phases"] == "aligned" or r["contrast"] == 1)
            ),
            key=lambda r: r["contrast"],
        )
        a.plot(
            [r["contrast"] for r in al],
            [r["ratio_whole_bill"] for r in al],
            ":",
            color=colour,
            marker="x",
            label=f"{n} jobs aligned (bill)",
        )
    a.axhline(target, color="k", lw=1, ls="-.", label=f"target {target}x")
    a.axhline(1.0, color="grey", lw=0.8)
    a.set_xscale("log", base=2)
    a.set_xticks(
        sorted({r["contrast"] for r in rows}),
        [f"{c:g}" for c in sorted({r["contrast"] for r in rows})],
    )
    a.set_xlabel("phase contrast: learner step time, learner-bound / rollout-bound phase")
    a.set_ylabel("dedicated / shared $ per step")
    a.set_title(
        "When sharing pays (band: all jobs; dashed: whole bill; triangles: bound, worst job)",
        fontsize=10,
    )
    a.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out
