"""Scenario files for the multi-job simulator (``benchmarks/sim_multirun.py``,
``echo_rl/provisioning/sim/multijob.py``): several RL jobs, each with its own learner, model, staleness
bound and phases, on one fleet of rollout workers.

Validated like ``echo_rl.provisioning.sim.scenario``: typed sections, ``extra="forbid"``, and every error
names the key, the bad value and the fix (raised as ``ScenarioError``).

Units: seconds, trajectories/s, $/h. A job's phases repeat in a cycle from ``phase_offset_s``
(a job that starts halfway into its cycle is offset against one that starts at its beginning).
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from echo_rl.core.config import known_keys
from echo_rl.provisioning.sim.scenario import ScenarioError, explain


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RunSection(_Section):
    name: str = "multirun"
    seed: int = 0
    horizon_s: float = Field(7200.0, gt=0)  # simulated time; steps finished by then count


class FleetSection(_Section):
    workers: int = Field(1000, gt=0)
    price: float = Field(0.35, ge=0)  # $/h per worker (RTX 5090, docs/design.md §4)
    speed_sigma: float = Field(0.2, ge=0)  # lognormal spread of worker speed (same for all models)
    duration_sigma: float = Field(0.1, ge=0)  # lognormal jitter of each request's duration
    groups_per_request: int = Field(1, gt=0)
    # K: models a worker keeps resident (host memory); switching to one of them is warm,
    # to any other cold, evicting the least recently used. With policy = "turns": models on
    # the device (echo-worker's --resident), every loaded model staying in host memory.
    resident_models: int = Field(2, gt=0)
    # Shared mode, which jobs a worker may serve. "any": every job (a model it does not hold
    # is a cold load). "home": RollMux's co-execution groups -- each worker serves a fixed set
    # of K jobs (its dedicated job plus K - 1 others, spread evenly), all loaded before the
    # run, so switches stay warm; with K >= jobs the same as "any".
    reach: Literal["any", "home"] = "any"
    # Shared mode: each job's target is alpha x the workers that keep its learner busy (its
    # capacity requirement, docs/design.md §4, from its last step time); a free worker serves
    # the eligible job furthest below its weighted target, but stays on its current job unless
    # that one is over target and another is under target by more than this margin.
    target_alpha: float = Field(1.1, gt=0)
    stickiness: float = Field(0.1, ge=0)
    # Shared mode, how a free worker picks its next job. "target": the heuristic above.
    # "turns": the worker's own policy (echo_rl/worker/sharing.py ``Turns``): among its joined jobs
    # that ask (gate open, work to hand out), the one with the least device-seconds on THIS
    # worker per unit of weight; K = models on the device (LRU; the others wait in host
    # memory: a switch to one is warm), every joined model's first load cold.
    # "turns-decay": the same, each worker's books decaying with time constant turns_tau_s
    # (used = used x exp(-dt / tau) + new: recent fairness). "turns-need": decayed books, each
    # job's weight times its learner's need (required workers / workers it holds, >= 0.1).
    # "turns-needfirst": the asking job with the highest need, ties (needs within 5 %) to the
    # least decayed device-seconds per weight (echo_rl/provisioning/sim/multijob_turns.py).
    policy: Literal["target", "turns", "turns-decay", "turns-need", "turns-needfirst"] = "target"
    turns_tau_s: float = Field(300.0, gt=0)


class PhaseSection(_Section):
    duration_s: float = Field(gt=0)
    t_train_s: float = Field(gt=0)  # learner step time in this phase
    gen_scale: float = Field(1.0, gt=0)  # rollout duration multiplier (longer responses: > 1)


class JobSection(_Section):
    name: str
    mu: float = Field(gt=0)  # trajectories/s of an average worker on this job's model
    staleness: int = Field(ge=0)  # S
    prompts_per_step: int = Field(32, gt=0)  # groups per learner step (B)
    group_size: int = Field(16, gt=0)
    learner_price: float = Field(3.06, ge=0)  # $/h of this job's learner
    weight: float = Field(1.0, gt=0)  # share of the fleet when jobs contend
    cold_s: float = Field(60.0, ge=0)  # load the model from disk/network (not resident)
    warm_s: float = Field(5.0, ge=0)  # load it from host memory (resident)
    sync_s: float = Field(2.0, ge=0)  # fetch a newer snapshot of a resident model (delta)
    phase_offset_s: float = Field(0.0, ge=0)
    phases: list[PhaseSection] = Field(min_length=1)

    @property
    def kappa(self) -> int:
        return max(1, self.staleness - 1)  # docs/design.md §3's default

    @property
    def cycle_s(self) -> float:
        return sum(p.duration_s for p in self.phases)

    def phase_at(self, t: float) -> PhaseSection:
        x = (t + self.phase_offset_s) % self.cycle_s
        for p in self.phases:
            if x < p.duration_s:
                return p
            x -= p.duration_s
        return self.phases[-1]


class DedicatedSection(_Section):
    # How the dedicated baseline splits the fleet: "demand" in proportion to each job's
    # time-averaged worker demand (the split most favourable to dedicated that needs no
    # foresight), "equal" in equal parts.
    split: Literal["demand", "equal"] = "demand"


class MultiScenario(_Section):
    run: RunSection = Field(default_factory=RunSection)
    fleet: FleetSection = Field(default_factory=FleetSection)
    jobs: list[JobSection]
    dedicated: DedicatedSection = Field(default_factory=DedicatedSection)

    @model_validator(mode="after")
    def _checks(self) -> MultiScenario:
        if not self.jobs:
            raise ValueError(
                "no jobs: add at least one [[jobs]] table (name, mu, staleness, phases)"
            )
        names = [j.name for j in self.jobs]
        if len(set(names)) != len(names):
            raise ValueError(f"job names {names} repeat: give every [[jobs]] a distinct name")
        if len(self.jobs) > self.fleet.workers:
            raise ValueError(
                f"{len(self.jobs)} jobs on fleet.workers={self.fleet.workers}: dedicated mode "
                "needs a worker per job; raise fleet.workers"
            )
        return self


def _known_keys() -> list[str]:
    return (
        known_keys(MultiScenario)
        + [f"jobs.{k}" for k in JobSection.model_fields]
        + [f"jobs.phases.{k}" for k in PhaseSection.model_fields]
    )


def _explain(err: ValidationError) -> str:
    return explain(
        err,
        _known_keys(),
        what="multi-job scenario",
        examples="examples/sim/multirun-*.toml",
        set_hint=False,
    )


def multi_from_dict(data: dict[str, object]) -> MultiScenario:
    try:
        return MultiScenario.model_validate(data)
    except ValidationError as exc:
        raise ScenarioError(_explain(exc)) from None


def load_multi(path: str | Path) -> MultiScenario:
    p = Path(path)
    if not p.is_file():
        raise ScenarioError(
            f"scenario file {str(p)!r} not found: pass an existing TOML file "
            "(see examples/sim/multirun-*.toml)"
        )
    try:
        data = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ScenarioError(f"scenario file {str(p)!r} is not valid TOML: {exc}") from None
    return multi_from_dict(data)
