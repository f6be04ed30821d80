"""Shared against dedicated for a multi-job scenario: runs both modes of
``echo_rl.provisioning.sim.multijob``, attributes the fleet's cost to jobs, adds the bounds, and prints
and plots the comparison (``benchmarks/sim_multirun.py`` is the command).

Attribution: the fleet (every worker, whole horizon) is paid in both modes. Dedicated: a job
pays for its own workers. Shared: a job pays for the worker-seconds it used (loads + generation,
at each worker's price), and the fleet's idle seconds are spread over the jobs in proportion to
that use, so the jobs' shares add up to the fleet's bill. Each job also pays its own learner.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import NotRequired, TypedDict

import numpy as np

from echo_rl.provisioning.sim.multijob import JobStats, MultiSim
from echo_rl.provisioning.sim.multijob_scenario import JobSection, MultiScenario


def demand_workers(job: JobSection) -> float:
    """Average-speed workers the job needs to keep its learner busy, time-averaged over its
    phases: B x G x gen_scale / (mu x T_train) per phase."""
    tot = sum(
        p.duration_s * job.prompts_per_step * job.group_size * p.gen_scale / (job.mu * p.t_train_s)
        for p in job.phases
    )
    return tot / job.cycle_s


def split(sc: MultiScenario, rng: np.random.Generator) -> list[int]:
    """Each worker's dedicated job: counts by demand (largest remainder, at least one each) or
    equal, workers drawn in random order so every job gets the same mix of speeds."""
    n, J = sc.fleet.workers, len(sc.jobs)
    want = (
        np.array([demand_workers(j) for j in sc.jobs])
        if sc.dedicated.split == "demand"
        else np.ones(J)
    )
    share = want / want.sum() * (n - J)
    counts = np.floor(share).astype(int) + 1
    for k in np.argsort(-(share - np.floor(share)))[: n - int(counts.sum())]:
        counts[k] += 1
    owner = np.repeat(np.arange(J), counts)
    return [int(k) for k in owner[rng.permutation(n)]]


class JobRow(TypedDict):
    """One job in one mode (``compare`` adds the two ratios to the shared mode's rows)."""

    name: str
    S: int  # its staleness bound
    steps: int
    steps_if_learner_never_waits: float
    usd_per_step: float | None  # learner and fleet share (None: no step)
    fleet_usd_per_step: float | None
    bound_fleet_usd_per_step: float | None  # the packing bound's fleet cost
    staleness_max: int
    learner_wait_fraction: float
    dropped_groups: int
    cold_loads: int
    warm_loads: int
    worker_s: float
    switch_s: float
    ratio: NotRequired[float | None]  # dedicated / shared $ per step
    fleet_cost_over_bound: NotRequired[float | None]


class ModeResult(TypedDict):
    """One mode (dedicated or shared) of a scenario."""

    jobs: list[JobRow]
    idle_fraction: float
    switch_fraction: float
    sync_fraction: float
    fleet_usd: float
    usd_per_total_step: float | None
    held_per_minute: dict[str, list[float]]  # per job, mean workers held per minute


class MultiComparison(TypedDict):
    """``compare``'s result: both modes of one scenario on the same workers."""

    name: str
    workers: int
    resident_models: int
    reach: str
    horizon_s: float
    split: str
    dedicated_workers: dict[str, int]
    dedicated: ModeResult
    shared: ModeResult
    wall_s: float


def _mode(sc: MultiScenario, owner: list[int], speed: np.ndarray, shared: bool) -> ModeResult:
    stats = MultiSim(sc, owner, speed, shared).run()
    H, n = sc.run.horizon_s, sc.fleet.workers
    fleet_usd = sc.fleet.price * n * H / 3600.0
    mean_speed = float(np.mean(speed))
    used_usd = sum(s.used_usd for s in stats) or 1.0
    jobs = []
    for k, (spec, s) in enumerate(zip(sc.jobs, stats, strict=True)):
        if shared:
            fleet_part = fleet_usd * s.used_usd / used_usd
        else:
            fleet_part = sc.fleet.price * owner.count(k) * H / 3600.0
        jobs.append(_job_row(spec, s, fleet_part, H, mean_speed, sc.fleet.price))
    used = sum(s.used_s for s in stats)
    steps = sum(s.steps for s in stats)
    total = fleet_usd + sum(j.learner_price * H / 3600.0 for j in sc.jobs)
    return {
        "jobs": jobs,
        "idle_fraction": 1.0 - used / (n * H),
        "switch_fraction": sum(s.switch_s for s in stats) / (n * H),
        "sync_fraction": sum(s.sync_s for s in stats) / (n * H),
        "fleet_usd": fleet_usd,
        "usd_per_total_step": total / steps if steps else None,
        "held_per_minute": {spec.name: s.held_per_minute for spec, s in zip(sc.jobs, stats)},
    }


def _job_row(
    spec: JobSection, s: JobStats, fleet_usd: float, H: float, mean_speed: float, price: float
) -> JobRow:
    learner = spec.learner_price * H / 3600.0
    per = (lambda x: x / s.steps) if s.steps else (lambda x: None)
    # The packing bound: only the worker-seconds its trained groups need, at mean speed.
    bound = s.bound_s / mean_speed * price / 3600.0
    return {
        "name": spec.name,
        "S": spec.staleness,
        "steps": s.steps,
        "steps_if_learner_never_waits": s.steps_bound,
        "usd_per_step": per(learner + fleet_usd),
        "fleet_usd_per_step": per(fleet_usd),
        "bound_fleet_usd_per_step": per(bound),
        "staleness_max": s.staleness_max,
        "learner_wait_fraction": s.wait_s / H,
        "dropped_groups": s.dropped_groups,
        "cold_loads": s.cold,
        "warm_loads": s.warm,
        "worker_s": s.used_s,
        "switch_s": s.switch_s,
    }


def compare(sc: MultiScenario) -> MultiComparison:
    """Both modes of one scenario, on the same workers; ratio = dedicated / shared $ per step."""
    t0 = time.perf_counter()
    rng = np.random.default_rng(sc.run.seed)
    s = sc.fleet.speed_sigma
    speed = rng.lognormal(-s * s / 2, s, sc.fleet.workers) if s else np.ones(sc.fleet.workers)
    owner = split(sc, rng)
    ded = _mode(sc, owner, speed, shared=False)
    sh = _mode(sc, owner, speed, shared=True)
    for d, x in zip(ded["jobs"], sh["jobs"], strict=True):
        assert x["staleness_max"] <= x["S"] and d["staleness_max"] <= d["S"]
        du, xu = d["usd_per_step"], x["usd_per_step"]
        x["ratio"] = du / xu if du is not None and xu else None
        b, fu = x["bound_fleet_usd_per_step"], x["fleet_usd_per_step"]  # both None or neither
        x["fleet_cost_over_bound"] = fu / b if b and fu is not None else None
    return {
        "name": sc.run.name,
        "workers": sc.fleet.workers,
        "resident_models": sc.fleet.resident_models,
        "reach": sc.fleet.reach,
        "horizon_s": sc.run.horizon_s,
        "split": sc.dedicated.split,
        "dedicated_workers": {j.name: owner.count(k) for k, j in enumerate(sc.jobs)},
        "dedicated": ded,
        "shared": sh,
        "wall_s": time.perf_counter() - t0,
    }


def table(res: MultiComparison) -> str:
    """The comparison as a fixed-width text table."""
    ded, sh = res["dedicated"], res["shared"]
    head = (
        f"{res['name']}: {res['workers']} workers, K={res['resident_models']}, "
        f"dedicated split by {res['split']} {res['dedicated_workers']}"
    )
    cols = f"{'job':<12}{'S':>3}{'steps d/s':>11}{'ded $/step':>12}{'shr $/step':>12}"
    cols += f"{'ratio':>7}{'s_max d/s':>10}{'x bound':>9}{'cold/warm':>11}"
    lines = [head, cols]
    for d, x in zip(ded["jobs"], sh["jobs"], strict=True):
        lines.append(
            f"{x['name']:<12}{x['S']:>3}{d['steps']:>5}/{x['steps']:<5}"
            f"{_usd(d['usd_per_step']):>12}{_usd(x['usd_per_step']):>12}"
            f"{_num(x['ratio'], 'x'):>7}{d['staleness_max']:>5}/{x['staleness_max']:<4}"
            f"{_num(x['fleet_cost_over_bound'], 'x'):>9}"
            f"{x['cold_loads']:>6}/{x['warm_loads']:<4}"
        )
    lines.append(
        f"fleet idle: dedicated {ded['idle_fraction']:.1%}, shared {sh['idle_fraction']:.1%}; "
        f"model loads: dedicated {ded['switch_fraction']:.1%}, shared {sh['switch_fraction']:.1%}; "
        f"snapshot syncs {ded['sync_fraction']:.1%} / {sh['sync_fraction']:.1%}\n"
        f"$/total step (all learners + fleet): dedicated "
        f"{_usd(ded['usd_per_total_step'])}, shared {_usd(sh['usd_per_total_step'])}"
    )
    return "\n".join(lines)


def _usd(x: float | None) -> str:
    return "-" if x is None else f"${x:.3f}"


def _num(x: float | None, unit: str) -> str:
    return "-" if x is None else f"{x:.2f}{unit}"


def plot(results: list[MultiComparison], path: str | Path) -> Path:
    """Per scenario: dedicated/shared $ per step per job (bars), and the workers each job
    holds over time in shared mode (the phases handing the fleet back and forth)."""
    from echo_rl.provisioning.sim.plots import _plt

    plt = _plt()
    fig, ax = plt.subplots(2, len(results), figsize=(4.5 * len(results), 7), squeeze=False)
    for c, res in enumerate(results):
        a = ax[0][c]
        names = [j["name"] for j in res["shared"]["jobs"]]
        x = np.arange(len(names))
        a.bar(
            x - 0.2,
            [j["usd_per_step"] or 0 for j in res["dedicated"]["jobs"]],
            0.4,
            label="dedicated",
        )
        a.bar(x + 0.2, [j["usd_per_step"] or 0 for j in res["shared"]["jobs"]], 0.4, label="shared")
        a.set_xticks(x, names, fontsize=8)
        a.set_ylim(0, max(j["usd_per_step"] or 0 for j in res["dedicated"]["jobs"]) * 1.35)
        a.set_ylabel("$ per learner step")
        a.set_title(res["name"], fontsize=10)
        a.legend(fontsize=8, loc="upper right")
        for k, (d, s) in enumerate(zip(res["dedicated"]["jobs"], res["shared"]["jobs"])):
            if s["ratio"]:
                top = max(d["usd_per_step"] or 0, s["usd_per_step"] or 0)
                a.text(k, top * 1.02, f"{s['ratio']:.2f}x", ha="center", fontsize=8)
        a = ax[1][c]
        for name, held in res["shared"]["held_per_minute"].items():
            a.plot([(k + 1) / 60 for k in range(len(held))], held, label=name)
        a.set_xlabel("hours")
        a.set_ylabel("workers held, shared (1-min mean)")
        a.legend(fontsize=8)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out
