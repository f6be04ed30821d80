"""An offline bound for several jobs on one fleet (docs/multirun.md, "An offline bound").

No exact offline optimum of the shared schedule is computed (it is a scheduling problem over
the phases; RollMux notes it is NP-hard). What is computed here is a linear relaxation that
every schedule keeping the staleness bound must satisfy, online or offline, so its optimum
bounds theirs from above. Per job ``j`` and time cell ``k`` (cells: every phase boundary of
every job in the horizon; inside one, every job's step time and rollout length are constant),
``x`` = learner steps taken and ``p`` = batches' worth of rollouts generated:

- the learner: ``x <= cell length / t_train`` (it never waits), and in all at most the whole
  steps it finishes in the horizon that way;
- the fleet: in each cell, the rollouts generated for all jobs need at most the cell's
  worker-seconds (``p x B x G x gen_scale / mu`` summed over jobs <= length x the fleet's
  total speed);
- no step trains what was not generated: by the end of each cell, steps <= batches generated;
- staleness: a batch trained at step ``v`` comes from a snapshot ``u >= v - S``, and
  snapshots are published every ``kappa`` steps, so by the end of each cell a job has
  generated at most ``S - kappa + 1`` batches (at least 1) beyond the steps it has taken.

Loads and snapshot syncs cost nothing here, and steps and batches may be fractional: each
only loosens the bound. Two optima are taken with scipy's HiGHS: the most steps in all (the
whole bill's bound, since both modes pay the same bill), and the largest ``r`` such that every
job gets at least ``r`` times its dedicated steps (the bound on "every job at least r times
better", a job's cost counted as what it pays dedicated).
"""

from __future__ import annotations

from typing import TypedDict

import numpy as np

from echo_rl.provisioning.sim.multijob import steps_if_never_waiting
from echo_rl.provisioning.sim.multijob_scenario import MultiScenario


def _grid(sc: MultiScenario) -> list[float]:
    """Cell edges: 0, every job's phase boundaries in the horizon, the horizon."""
    H = sc.run.horizon_s
    edges = {0.0, H}
    for j in sc.jobs:
        t = 0.0
        while t < H:  # phase_at(t) holds from t until the next boundary
            x = (t + j.phase_offset_s) % j.cycle_s
            acc = 0.0
            for p in j.phases:
                acc += p.duration_s
                if x < acc - 1e-9:
                    t += acc - x
                    break
            else:
                t += j.cycle_s - x
            if t < H:
                edges.add(round(t, 6))
    return sorted(edges)


class OfflineBound(TypedDict):
    """``offline_bound``'s optima: the most steps in all, and the best share for every job."""

    cells: int  # grid cells of the relaxation
    steps_most: list[float]  # per job, at the most steps in all
    bill_bound: float | None  # those steps over the dedicated ones (None: no dedicated step)
    every_job_bound: float  # the largest r with every job at r x its dedicated steps
    steps_every_job: list[float]  # per job, at that r


def offline_bound(sc: MultiScenario, dedicated_steps: list[int], capacity: float) -> OfflineBound:
    """The relaxation's two optima for ``sc``; ``capacity``: the fleet's total speed (average
    workers' worth). ``dedicated_steps``: each job's steps on its dedicated split."""
    from scipy.optimize import linprog

    edges = _grid(sc)
    length = np.diff(edges)
    J, K = len(sc.jobs), len(length)
    n = 2 * J * K  # x[j, k] at j * K + k, then p[j, k] at J * K + j * K + k
    upper = np.full(n, np.inf)
    work = np.zeros((J, K))  # worker-seconds per batch generated in cell k
    rows: list[np.ndarray] = []
    rhs: list[float] = []
    for j, spec in enumerate(sc.jobs):
        ahead = max(1, spec.staleness - spec.kappa + 1)
        for k in range(K):
            ph = spec.phase_at((edges[k] + edges[k + 1]) / 2)
            upper[j * K + k] = length[k] / ph.t_train_s
            work[j, k] = spec.prompts_per_step * spec.group_size * ph.gen_scale / spec.mu
            done = np.zeros(n)  # cumulative steps - cumulative batches, by the end of cell k
            done[j * K : j * K + k + 1] = 1.0
            done[J * K + j * K : J * K + j * K + k + 1] = -1.0
            rows += [done, -done]  # steps <= batches; batches <= steps + ahead
            rhs += [0.0, float(ahead)]
        whole = np.zeros(n)  # whole steps finished in the horizon: the learner's own ceiling
        whole[j * K : (j + 1) * K] = 1.0
        rows.append(whole)
        rhs.append(steps_if_never_waiting(spec, sc.run.horizon_s))
    for k in range(K):
        fleet = np.zeros(n)
        fleet[J * K + k : 2 * J * K : K] = work[:, k]
        rows.append(fleet)
        rhs.append(capacity * length[k])
    A, b = np.array(rows), np.array(rhs)
    bounds = [(0.0, u if np.isfinite(u) else None) for u in upper]
    obj = np.concatenate([np.ones(J * K), np.zeros(J * K)])
    most = linprog(-obj, A_ub=A, b_ub=b, bounds=bounds, method="highs")
    assert most.status == 0, most.message
    # max r: every job's steps >= r x its dedicated steps (one more variable, r, last)
    share = np.zeros((J, n + 1))
    for j, d in enumerate(dedicated_steps):
        share[j, j * K : (j + 1) * K] = -1.0
        share[j, -1] = float(max(d, 1))
    A2 = np.vstack([np.hstack([A, np.zeros((len(A), 1))]), share])
    c = np.zeros(n + 1)
    c[-1] = -1.0
    fair = linprog(
        c,
        A_ub=A2,
        b_ub=np.concatenate([b, np.zeros(J)]),
        bounds=[*bounds, (0, None)],
        method="highs",
    )
    assert fair.status == 0, fair.message
    steps = [float(most.x[j * K : (j + 1) * K].sum()) for j in range(J)]
    ded_total = sum(dedicated_steps)
    return {
        "cells": K,
        "steps_most": steps,
        "bill_bound": sum(steps) / ded_total if ded_total else None,
        "every_job_bound": float(fair.x[-1]),
        "steps_every_job": [float(fair.x[j * K : (j + 1) * K].sum()) for j in range(J)],
    }


def fleet_capacity(sc: MultiScenario) -> float:
    """The fleet's total speed as ``multijob_report.compare`` draws it (same seed)."""
    rng = np.random.default_rng(sc.run.seed)
    s = sc.fleet.speed_sigma
    if not s:
        return float(sc.fleet.workers)
    return float(rng.lognormal(-s * s / 2, s, sc.fleet.workers).sum())
