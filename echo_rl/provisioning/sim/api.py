"""The simulator's public API: ``run_scenario`` (a loaded ``Scenario``), ``simulate`` (a TOML path,
a raw dict or a ``Scenario``) and ``simulate_fixed`` (a real run's parameters, for
sim-vs-reality checks)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import simpy

from echo_rl.core.jsontypes import JsonObject, JsonValue
from echo_rl.provisioning.sim.core import Sim, SimResult
from echo_rl.provisioning.sim.scenario import (
    Scenario,
    apply_overrides,
    load_scenario,
    scenario_from_dict,
)
from echo_rl.provisioning.sim.summary import SimSummary


def run_scenario(sc: Scenario, *, progress: bool = False, machine: bool = True) -> SimResult:
    """Simulate one scenario; returns the result dict (summary, steps, publications, ...)."""
    if progress:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )

        with Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("steps"),
            TimeElapsedColumn(),
            transient=True,
        ) as bar:
            task = bar.add_task(f"simulating {sc.run.name}", total=sc.run.steps)
            result = Sim(sc, on_step=lambda _s: bar.advance(task)).run()
    else:
        result = Sim(sc).run()
    if sc.centralized.enabled:
        from echo_rl.provisioning.sim.centralized import compare

        result["centralized"] = compare(sc, SimSummary.from_json(result["summary"]))
    if machine:
        from echo_rl.core.machine import machine_info

        info = machine_info()
        info.update(numpy=np.__version__, simpy=simpy.__version__)
        result["machine"] = info
    result["started_at"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    return result


def simulate(
    scenario: str | Path | dict[str, object] | Scenario,
    overrides: list[str] | dict[str, object] | None = None,
    *,
    progress: bool = False,
    machine: bool = True,
) -> SimResult:
    """Simulate a scenario given as a TOML path, a raw dict (TOML layout) or a ``Scenario``."""
    if isinstance(scenario, Scenario):
        sc = scenario
        if overrides:
            data = apply_overrides(sc.model_dump(), overrides)
            sc = scenario_from_dict(data, sc.base_dir)
    elif isinstance(scenario, dict):
        sc = scenario_from_dict(apply_overrides(json.loads(json.dumps(scenario)), overrides or []))
    else:
        sc = load_scenario(scenario, overrides)
    return run_scenario(sc, progress=progress, machine=machine)


def simulate_fixed(
    n_workers: int,
    mu_per_worker: float,
    t_train: float,
    t_bcast: float,
    N: int,
    S: int,
    kappa: int,
    steps: int,
    *,
    group_size: int = 16,
    groups_per_request: int = 2,
    max_outstanding_groups: int = 0,
    duration_sigma: float = 0.1,
    t_train_cv: float = 0.0,
    generate_during_download: bool = False,
    measure_from_step: int = 0,
    seed: int = 0,
) -> JsonObject:
    """The parameters of a real (e.g. loopback) run, simulated: for sim-vs-reality checks.

    ``n_workers`` identical workers of ``mu_per_worker`` trajectories/s, all active, no
    controller, no churn; every publication installs on every worker ``t_bcast`` seconds
    after it is made (topology ``fixed``: replay the measured ``T_bcast``); ``N`` rollouts per
    step in groups of ``group_size`` (``N`` must be a multiple); ``kappa`` as the run used
    (0: ``max(1, S-1)``). The other knobs mirror the real learner/worker config
    (``learner.max_outstanding_groups``, ``worker.groups_per_request``).

    Returns the summary dict: ``bubble_ratio``, ``wait_s_per_step``, ``staleness_max``,
    ``staleness_mean``, ``trajectories`` (delivered/admitted/dropped_stale), ``sim_time_s``, ...
    plus ``per_step_wait_s`` and ``per_step_staleness``.
    """
    if N % group_size:
        raise ValueError(
            f"N={N} is not a multiple of group_size={group_size}: N = prompts x group_size"
        )
    data = {
        "run": {
            "name": "fixed",
            "seed": seed,
            "steps": steps,
            "measure_from_step": measure_from_step,
        },
        "learner": {
            "t_train_s": t_train,
            "t_train_cv": t_train_cv,
            "prompts_per_step": N // group_size,
            "group_size": group_size,
            "staleness": S,
            "kappa": kappa,
            "price_per_hour": 0.0,
            "max_outstanding_groups": max_outstanding_groups,
        },
        "pool": {
            "classes": [{"name": "worker", "count": n_workers, "mu": mu_per_worker, "price": 0.0}]
        },
        "rollout": {
            "groups_per_request": groups_per_request,
            "duration_sigma": duration_sigma,
            "generate_during_download": generate_during_download,
        },
        "broadcast": {"topology": "fixed", "fixed_s": t_bcast, "uplink_mbit": None},
        "provisioning": {"selection": "all", "controller": False},
    }
    res = simulate(data, machine=False)
    out = dict(res["summary"])
    waits: list[JsonValue] = [s["wait_s"] for s in res["steps"]]
    staleness: list[JsonValue] = [s["staleness"] for s in res["steps"]]
    out["per_step_wait_s"] = waits
    out["per_step_staleness"] = staleness
    return out
