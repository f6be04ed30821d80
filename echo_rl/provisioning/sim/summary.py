"""The simulator's summary of a run (``result["summary"]`` of ``simulate``), as one declared
type: the contract between the simulator, its report and plots, the centralized comparison and
the benchmarks that set simulated figures beside measured ones. Where a field means what the
learner's step row means it has the same name (``bubble_ratio``, ``staleness_max``,
``staleness_mean``, ``wall_s``: ``echo_rl.core.steprow``).

The result files keep the summary as JSON (``to_json``, the order it has always had);
``from_json`` reads one tolerantly: a missing field is None, an unknown one is ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from types import SimpleNamespace
from typing import Any

from echo_rl.core.jsontypes import JsonObject


@dataclass
class SimSummary:
    """Figures over the measured steps (``run.measure_from_step`` on) unless said otherwise."""

    steps_done: int | None = None  # steps simulated, all of them
    steps_measured: int | None = None  # steps the figures below are over
    stalled: bool | None = None  # the learner starved: no admissible data within the limit
    bubble_ratio: float | None = None  # sum(wait) / sum(wait + train)
    wait_s_per_step: float | None = None  # s the learner waited, mean per step
    t_train_s_per_step: float | None = None  # s training, mean per step
    staleness_max: int | None = None  # versions
    staleness_mean: float | None = None  # versions
    cost_per_step_usd: float | None = None  # $: fleet and learner per step
    usd_per_1k_trajectories: float | None = None  # $ per 1,000 trained trajectories
    cost_total_usd: float | None = None  # $ over the measured steps
    t_bcast_mean_s: float | None = None  # s: mean broadcast time of the publications
    t_bcast_max_s: float | None = None  # s
    publications: int | None = None  # publications that reached a worker
    active_mean: float | None = None  # active workers, mean over steps
    mu_active_mean: float | None = None  # trajectories/s of the active workers, mean
    mu_req_at_mean_t_bcast: float | None = None  # trajectories/s the learner needs (capacity)
    kappa: int | None = None  # steps per publication
    n_per_step: int | None = None  # trajectories per step
    sim_time_s: float | None = None  # simulated seconds, the whole run
    trajectories: dict[str, int] | None = None  # delivered/admitted/trained/dropped/lost
    events: dict[str, int] | None = None  # installs, leaves, joins, activations, releases, short
    wall_s: float | None = None  # s of real time the simulation took
    cpu_s: float | None = None  # this process's CPU s: robust to other load on the machine
    planner_wall_s: float | None = None  # s of real time in the broadcast planner

    def to_json(self) -> JsonObject:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> SimSummary:
        return cls(**{k: v for k, v in doc.items() if k in _NAMES})


_NAMES = frozenset(f.name for f in fields(SimSummary))

# The summary's keys as constants (``SIM.bubble_ratio == "bubble_ratio"``), for tables and
# frames that need them as strings.
SIM = SimpleNamespace(**{n: n for n in sorted(_NAMES)})


@dataclass
class Baseline:
    """One centralized baseline (``echo_rl.provisioning.sim.centralized``): the same steps on a rented
    GPU cluster, synchronous or asynchronous."""

    mode: str  # "sync" or "async"
    gpus: int
    generating_gpus: int
    training_gpus: int
    gpu_price: float  # $/h per GPU
    mu_per_gpu: float  # trajectories/s per generating GPU
    t_train_s: float  # s per step
    step_s: float  # s per step, mean
    t_gen_s: float  # s generating a step's rollouts, mean
    bubble_ratio: float  # the trainer's share of the step spent waiting for rollouts
    cost_per_step_usd: float
    usd_per_1k_trajectories: float

    def to_json(self) -> JsonObject:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Baseline:
        """From a result file's row (its ``echo_saving``, added by ``compare``, left out)."""
        return cls(**{f.name: doc[f.name] for f in fields(cls)})
