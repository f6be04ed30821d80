"""The centralized baselines: rollouts on the learner's own data-center GPUs (docs/simulator.md,
"Against a centralized pipeline").

The paper's question Q1 (``003_48fccdc628deadaa.txt``): at matched quality, what does ECHO-2
cost against pipelines that generate their rollouts on the data-center GPUs? Two baselines, as
in its evaluation (verl and verl-async):

* ``sync``: the ``gpus`` generate the step's ``N`` trajectories, then train on them, then
  generate again. Nothing overlaps: a step is ``T_gen + T_train`` and every GPU is billed for
  both.
* ``async``: ``train_gpus`` train while the other ``gpus - train_gpus`` generate, the batch one
  version old (S = 1). A step is ``max(T_train, T_gen)``, and the idle side is billed too.

The same model, ``N`` and ``T_train`` as the scenario's learner: ``t_train_s`` is the time of one
update on the training GPUs (the learner's ``t_train_s`` by default). ``mu_per_gpu`` is one data-
center GPU's rollout rate for that model. Each generating GPU serves requests of
``rollout.groups_per_request`` groups with the scenario's lognormal duration spread, so a step
waits for its slowest GPU, as in the distributed run. Pure arithmetic on a seeded generator: no
event loop is needed when nothing joins, leaves or travels over a link.
"""

from __future__ import annotations

from typing import TypedDict

import numpy as np

from echo_rl.core.jsontypes import JsonObject
from echo_rl.provisioning.sim.scenario import CentralizedSection, Scenario
from echo_rl.provisioning.sim.summary import Baseline, SimSummary


class Comparison(TypedDict):
    """``compare``'s result (a sim result's ``centralized``)."""

    baselines: list[JsonObject]  # Baseline.to_json() and its echo_saving
    echo_cost_per_step_usd: float | None
    echo_bubble_ratio: float | None
    echo_saving_vs_cheapest: float | None


def check(c: CentralizedSection) -> None:
    if not c.enabled:
        return
    if c.mu_per_gpu <= 0:
        raise ValueError(
            "centralized.mu_per_gpu must be > 0 when centralized.enabled: one "
            "data-center GPU's rollout rate (trajectories/s) for the model"
        )
    if "async" in c.modes and c.train_gpus >= c.gpus:
        raise ValueError(
            f"centralized.train_gpus = {c.train_gpus} leaves no GPU of "
            f"centralized.gpus = {c.gpus} to generate; use fewer"
        )


def _gen_time(
    rng: np.random.Generator, n_traj: int, gpus: int, mu: float, per_request: int, sigma: float
) -> float:
    """Wall time for ``gpus`` GPUs to generate ``n_traj`` trajectories in requests of
    ``per_request``, each request's duration spread lognormally: the busiest GPU's total."""
    requests = -(-n_traj // per_request)
    base = per_request / mu
    spread = rng.lognormal(-sigma * sigma / 2, sigma, requests) if sigma else np.ones(requests)
    loads = np.zeros(gpus)
    for d in base * spread:  # each request goes to the GPU that frees up first
        loads[np.argmin(loads)] += d
    return float(loads.max())


def run_baseline(
    mode: str,
    c: CentralizedSection,
    *,
    n_traj: int,
    t_train: float,
    per_request: int,
    sigma: float,
    steps: int,
    seed: int,
) -> Baseline:
    rng = np.random.default_rng(seed)
    t_train = c.t_train_s or t_train
    gen_gpus = c.gpus if mode == "sync" else c.gpus - c.train_gpus
    step_s, wait_s, gen_s = [], [], []
    for _ in range(steps):
        t_gen = _gen_time(rng, n_traj, gen_gpus, c.mu_per_gpu, per_request, sigma)
        gen_s.append(t_gen)
        if mode == "sync":
            step, wait = t_gen + t_train, t_gen  # the trainer waits for every rollout
        else:
            step = max(t_train, t_gen)
            wait = step - t_train
        step_s.append(step)
        wait_s.append(wait)
    step_mean = float(np.mean(step_s))
    usd_per_step = c.gpus * c.gpu_price * step_mean / 3600.0
    return Baseline(
        mode=mode,
        gpus=c.gpus,
        generating_gpus=gen_gpus,
        training_gpus=c.gpus if mode == "sync" else c.train_gpus,
        gpu_price=c.gpu_price,
        mu_per_gpu=c.mu_per_gpu,
        t_train_s=t_train,
        step_s=step_mean,
        t_gen_s=float(np.mean(gen_s)),
        # the trainer's share of the step spent waiting for rollouts
        bubble_ratio=float(np.sum(wait_s) / np.sum(step_s)),
        cost_per_step_usd=usd_per_step,
        usd_per_1k_trajectories=1000.0 * usd_per_step / n_traj,
    )


def compare(sc: Scenario, echo_summary: SimSummary) -> Comparison:
    """Every enabled baseline beside the distributed run's cost per trained step."""
    c: CentralizedSection = sc.centralized
    check(c)
    L = sc.learner
    n_traj = L.prompts_per_step * L.group_size
    rows = [
        run_baseline(
            m,
            c,
            n_traj=n_traj,
            t_train=L.t_train_s,
            per_request=sc.rollout.groups_per_request * L.group_size,
            sigma=sc.rollout.duration_sigma,
            steps=sc.run.steps,
            seed=sc.run.seed,
        )
        for m in c.modes
    ]
    echo = echo_summary.cost_per_step_usd
    saving = [1.0 - echo / b.cost_per_step_usd if echo is not None else None for b in rows]
    out: list[JsonObject] = [{**b.to_json(), "echo_saving": s} for b, s in zip(rows, saving)]
    cheapest = min(range(len(rows)), key=lambda i: rows[i].cost_per_step_usd) if rows else None
    return {
        "baselines": out,
        "echo_cost_per_step_usd": echo,
        "echo_bubble_ratio": echo_summary.bubble_ratio,
        "echo_saving_vs_cheapest": saving[cheapest] if cheapest is not None else None,
    }
