"""Scenario files for the discrete-event simulator (``echo-rl sim SCENARIO.toml``).

A scenario describes one simulated Echo run: the learner (docs/design.md §3, §4), the worker pool (mu_i,
c_i, links), how rollouts are generated, the broadcast (docs/design.md §5), provisioning (selection and
the closed-loop controller) and churn. Validated like ``echo_rl.core.config``: typed sections,
``extra="forbid"``, and every error names the key, the bad value and the fix.

Units: seconds, trajectories/s, $/h, Mbit/s (decimal), decimal GB for the snapshot.
Relative paths inside a scenario (``pool.file``, ``churn.trace``) are relative to the TOML file;
``echo_rl/provisioning/sim/population.py`` reads them and draws the pool.
"""

from __future__ import annotations

import difflib
import math
import tomllib
from collections.abc import Iterable
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from echo_rl.core.config import StalenessRules, apply_override, known_keys, parse_override
from echo_rl.core.errors import EchoError


class ScenarioError(EchoError, ValueError):
    """A scenario problem, phrased for the user: key, value, fix."""

    default_reason = "scenario"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RunSection(_Section):
    name: str = "sim"
    seed: int = 0
    steps: int = Field(100, gt=0)  # learner steps to simulate
    # Workers start with snapshot v0 installed (a run in progress); false: v0 is broadcast at t=0
    # and the first step waits for it.
    warm_start: bool = True
    # Aggregates (bubble ratio, cost, ...) count steps >= this index (skip the pipeline fill).
    measure_from_step: int = Field(0, ge=0)
    # Abort (result "stalled") when the learner waits this long for one batch.
    stall_timeout_s: float = Field(7 * 24 * 3600.0, gt=0)

    @model_validator(mode="after")
    def _measure_inside_run(self) -> RunSection:
        if self.measure_from_step >= self.steps:
            raise ValueError(
                f"measure_from_step={self.measure_from_step} leaves no step of "
                f"steps={self.steps} to measure; set run.measure_from_step < "
                f"run.steps"
            )
        return self


class LearnerSection(StalenessRules, _Section):
    t_train_s: float = Field(60.0, gt=0)  # T_train, seconds per learner step
    t_train_cv: float = Field(0.0, ge=0)  # lognormal spread of T_train per step (0: constant)
    prompts_per_step: int = Field(32, gt=0)
    group_size: int = Field(16, gt=0)  # N = prompts_per_step x group_size
    staleness: int = Field(3, ge=0)  # S; 0 = synchronous (kappa 1, no overlap)
    kappa: int = Field(0, ge=0)  # 0: max(1, S-1) (docs/design.md §3)
    price_per_hour: float = Field(3.06, ge=0)  # p_learner, A100 80GB (paper Table 1)
    # Groups issued-and-unfinished plus waiting in the buffer; 0: 2 x prompts_per_step, as in
    # learner.max_outstanding_groups (echo_rl/control/work.py). Keeps the fleet from running ahead.
    max_outstanding_groups: int = Field(0, ge=0)

    @property
    def n(self) -> int:
        return self.prompts_per_step * self.group_size

    @model_validator(mode="after")
    def _checks(self) -> LearnerSection:
        self.check_kappa()
        if self.max_outstanding_groups and self.max_outstanding_groups < self.prompts_per_step:
            raise ValueError(
                f"max_outstanding_groups={self.max_outstanding_groups} is below "
                f"prompts_per_step={self.prompts_per_step}: the learner could never "
                f"assemble a batch; raise learner.max_outstanding_groups (or 0)"
            )
        return self


class WorkerClass(_Section):
    name: str = "gpu"
    count: int = Field(gt=0)
    mu: float = Field(gt=0)  # trajectories/s delivered by one worker of this class
    price: float = Field(ge=0)  # $/h
    mu_sigma: float = Field(0.0, ge=0)  # lognormal spread of mu between workers
    price_sigma: float = Field(0.0, ge=0)
    # Explicit per-worker prices (length count) instead of price/price_sigma, e.g. a
    # marketplace's listing; overrides `price`.
    prices: list[float] | None = None
    down_mbit: float | None = Field(None, gt=0)  # None: pool.down_mbit
    up_mbit: float | None = Field(None, gt=0)  # None: pool.up_mbit
    reachable: float | None = Field(None, ge=0, le=1)  # fraction reachable; None: pool's

    @model_validator(mode="after")
    def _prices_length(self) -> WorkerClass:
        if self.prices is not None:
            if len(self.prices) != self.count:
                raise ValueError(
                    f"class {self.name!r}: prices has {len(self.prices)} entries "
                    f"but count={self.count}; give one price per worker"
                )
            if any(not (p >= 0 and math.isfinite(p)) for p in self.prices):
                raise ValueError(f"class {self.name!r}: prices must be finite $/h >= 0")
        return self


class PoolSection(_Section):
    # Sources (any combination): explicit classes, a CSV file, or a random fleet drawn like
    # echo_rl.provisioning.sim.pools.random_pool (a mix of GPU classes, lognormal speeds, marketplace prices).
    classes: list[WorkerClass] = Field(default_factory=list)
    file: str = ""  # CSV with columns mu,price[,down_mbit,up_mbit,reachable,id]
    random_workers: int = Field(0, ge=0)
    mu_scale: float = Field(1.0, gt=0)  # multiplies random_workers' mu (task speed)
    # Links for workers that do not set their own.
    down_mbit: float = Field(100.0, gt=0)
    up_mbit: float = Field(100.0, gt=0)
    link_sigma: float = Field(0.0, ge=0)  # lognormal spread of every worker's down and up
    up_sigma: float | None = Field(None, ge=0)  # spread of up alone; None: link_sigma
    reachable: float = Field(1.0, ge=0, le=1)  # fraction that accepts inbound connections

    @model_validator(mode="after")
    def _has_workers(self) -> PoolSection:
        if not self.classes and not self.file and not self.random_workers:
            raise ValueError(
                "the pool is empty: add [[pool.classes]] (count, mu, price), "
                "pool.file (CSV) or pool.random_workers"
            )
        return self


class RolloutSection(_Section):
    groups_per_request: int = Field(2, gt=0)  # as worker.groups_per_request
    duration_sigma: float = Field(0.1, ge=0)  # lognormal spread of each request's duration
    # false (echo_rl/worker/agent.py today): a worker finishes its current request, then fetches and
    # installs the new snapshot before generating again -- no rollouts during its broadcast.
    # true: it keeps generating with the old snapshot while the new one downloads and pauses
    # only for broadcast.reload_s.
    generate_during_download: bool = False
    # Sample lengths within a request (echo_rl/provisioning/sim/tail.py). 0: no length model, a
    # request lasts groups x G / mu (times the jitter). > 0: each sample's length is geometric
    # with this mean, cut at length_cap; a request lasts as many decode steps as its longest
    # sample, scaled so that its mean duration is still groups x G / mu.
    length_mean: float = Field(0.0, ge=0)
    length_cap: int = Field(1024, gt=0)
    # worker.tail_cut (docs/scheduling.md): with a length model, a request stops once this
    # share of its fresh samples ended; the groups still running are carried into the
    # worker's next request and finish there.
    tail_cut: float = Field(0.0, ge=0, lt=1)
    # Share of a decode step's cost that grows with the rows it computes: 0, a GPU's
    # memory-bound decode (a step costs the same for 8 rows or 32); 1, a CPU's.
    decode_row_cost: float = Field(0.0, ge=0, le=1)
    # Two kinds of task (echo_rl/provisioning/sim/tail.py): this share of groups are long tasks, whose
    # samples have mean length_mean; the others are short, mean short_mean. 0: one kind.
    long_share: float = Field(0.0, ge=0, le=1)
    short_mean: float = Field(0.0, ge=0)
    # learner.affinity (docs/scheduling.md): a grant takes, from a window of the next
    # affinity_window tasks, the one whose expected length ranks where the worker's speed
    # ranks, by the learner's own picker (echo_rl/data/affinity.py). Off: tasks in drawn order.
    affinity: bool = False
    affinity_window: int = Field(64, ge=2, le=4096)


class BroadcastSection(_Section):
    # "fixed": every worker installs broadcast.fixed_s after publication (for replaying a
    # measured T_bcast, e.g. sim-vs-reality); the others use echo_rl.broadcast.planner's model.
    topology: Literal["chains", "star", "star-unlimited", "fixed"] = "chains"
    snapshot_gb: float = Field(1.0, gt=0)  # M, decimal GB
    uplink_mbit: float | None = Field(1000.0, gt=0)  # learner U; needed by chains and star
    chunk_mib: float = Field(1.0, gt=0)
    latency_ms: float = Field(0.0, ge=0)  # per hop
    reload_s: float = Field(0.0, ge=0)  # load weights into the inference engine after download
    q: float = Field(1.0, gt=0, le=1)  # T_bcast = until this fraction of recipients installed
    fixed_s: float = Field(0.0, ge=0)  # topology = "fixed" only
    reattach_s: float = Field(1.0, ge=0)  # delay for a chain child whose relay left
    extra_chains: bool = True  # planner option (more chains for poor uploaders)
    # Above this many recipients the planner runs on binned peers (see echo_rl.provisioning.sim).
    plan_max_peers: int = Field(256, ge=8)

    @property
    def snapshot_bytes(self) -> int:
        return int(round(self.snapshot_gb * 1e9))

    @property
    def chunk_bytes(self) -> int:
        return int(round(self.chunk_mib * (1 << 20)))

    @model_validator(mode="after")
    def _uplink_needed(self) -> BroadcastSection:
        if self.topology in ("chains", "star") and self.uplink_mbit is None:
            raise ValueError(
                f"topology {self.topology!r} needs the learner uplink: set "
                f"broadcast.uplink_mbit (Mbit/s), or use topology = "
                f'"star-unlimited"'
            )
        return self


class ProvisioningSection(_Section):
    # Initial active set. greedy/ours/exact: echo_rl.provisioning.selection against alpha*mu_req;
    # random: random order until alpha*mu_req (the paper's "w/o cost" ablation); all: everyone.
    # first: the first `active` present workers in pool order (the learner's boot: its first
    # `initial_active` joiners start active).
    selection: Literal["ours", "greedy", "exact", "random", "all", "first"] = "ours"
    # > 0: activate exactly this many workers (in the selection's order: by unit cost for
    # greedy/ours/exact, random for random) instead of meeting alpha*mu_req.
    active: int = Field(0, ge=0)
    controller: bool = True  # closed loop (echo_rl.provisioning.controller.Controller)
    alpha: float = Field(1.1, gt=0)
    delta: float = Field(0.2, ge=0)
    window_s: float = Field(60.0, ge=0)
    tau_s: float = Field(60.0, gt=0)
    warmup_s: float = Field(30.0, ge=0)
    tick_s: float = Field(10.0, gt=0)
    # What the controller observes. "busy": every delivered batch with the seconds the worker
    # spent generating it, as the real learner server feeds it (echo_rl/control/deliveries.py: the batch's
    # gen_s), so throughput is delivered / busy time. "delivered": deliveries over wall time
    # (the learner before it fed busy time); that rate is capped by the work the learner
    # hands out and by install pauses, so it measures demand once the fleet is large enough.
    # "capacity": each active, installed worker's nominal mu_i x time (an oracle).
    measure: Literal["busy", "delivered", "capacity"] = "busy"
    # What the controller knows of a worker before it delivers. "none", as the real learner
    # (echo_rl/control/members.py: no credit before delivery): unmeasured workers are activated on
    # probation. "nominal": each worker's mu_i as a trusted prior (the oracle's knowledge).
    prior: Literal["none", "nominal"] = "none"
    # The real config's keys, with its defaults (echo_rl/core/config.py ProvisioningConfig).
    probation_slots: int = Field(4, ge=0)
    probation_ready_s: float = Field(600.0, gt=0)

    @model_validator(mode="after")
    def _first_needs_count(self) -> ProvisioningSection:
        if self.selection == "first" and self.active <= 0:
            raise ValueError(
                'provisioning.selection = "first" boots the first '
                "provisioning.active workers: set provisioning.active >= 1"
            )
        return self

    # T_bcast behind mu_req before the first publication is measured; None: the planner's
    # prediction for the initial active set.
    t_bcast_initial_s: float | None = Field(None, ge=0)


class ChurnSection(_Section):
    leave_per_hour: float = Field(0.0, ge=0)  # per present worker
    rejoin_per_hour: float = Field(0.0, ge=0)  # per absent worker (0: gone for good)
    start_absent: float = Field(0.0, ge=0, lt=1)  # fraction absent at t=0 (may join later)
    # CSV with columns time_s,worker,event (event: leave | join; worker: pool index or id).
    # A worker whose first traced event is "join" starts absent.
    trace: str = ""
    heartbeat_timeout_s: float = Field(15.0, ge=0)  # until the controller forgets a leaver


CentralizedMode = Literal["sync", "async"]
_BOTH_MODES: tuple[CentralizedMode, ...] = ("sync", "async")


class CentralizedSection(_Section):
    """Baselines with rollouts on the learner's own GPUs (echo_rl/provisioning/sim/centralized.py)."""

    enabled: bool = False
    gpus: int = Field(8, gt=0)
    gpu_price: float = Field(3.06, ge=0)  # $/h per GPU (paper: A100 80GB on Google Cloud)
    mu_per_gpu: float = Field(0.0, ge=0)  # trajectories/s one GPU generates; required when enabled
    train_gpus: int = Field(4, gt=0)  # async: GPUs that train; the rest generate
    # Time of one update on the training GPUs; None: learner.t_train_s (the same update).
    t_train_s: float | None = Field(None, gt=0)
    modes: list[CentralizedMode] = Field(default_factory=lambda: list(_BOTH_MODES))

    @model_validator(mode="after")
    def _usable(self) -> CentralizedSection:
        from echo_rl.provisioning.sim.centralized import check

        check(self)
        return self


class Scenario(_Section):
    run: RunSection = Field(default_factory=RunSection)
    learner: LearnerSection = Field(default_factory=LearnerSection)
    pool: PoolSection
    rollout: RolloutSection = Field(default_factory=RolloutSection)
    broadcast: BroadcastSection = Field(default_factory=BroadcastSection)
    provisioning: ProvisioningSection = Field(default_factory=ProvisioningSection)
    churn: ChurnSection = Field(default_factory=ChurnSection)
    centralized: CentralizedSection = Field(default_factory=CentralizedSection)
    # Where the TOML lives, to resolve pool.file and churn.trace; set by load_scenario.
    base_dir: str = ""


# ----------------------------------------------------------------------------- loading


def _known_keys() -> list[str]:
    return known_keys(Scenario) + [f"pool.classes.{k}" for k in WorkerClass.model_fields]


def _explain(err: ValidationError) -> str:
    return explain(
        err, _known_keys(), what="scenario", examples="examples/sim/*.toml", set_hint=True
    )


def explain(
    err: ValidationError, known: list[str], *, what: str, examples: str, set_hint: bool
) -> str:
    """A scenario's validation errors, one line each with its fix (``set_hint``: the file's
    keys can also be given with ``--set``). Shared by the single- and multi-job scenarios."""
    lines = []
    for e in err.errors():
        loc = [str(p) for p in e["loc"]]
        key = ".".join(loc) or "(top level)"
        plain = ".".join(p for p in loc if not p.isdigit())
        if e["type"] == "extra_forbidden":
            close = difflib.get_close_matches(plain, known, n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"remove it (see {examples})"
            lines.append(f"unknown key {key!r}: {hint}")
            continue
        if e["type"] == "missing":
            extra = f" (or --set {plain}=...)" if set_hint else ""
            lines.append(f"{key} is required: add it to the scenario{extra}")
            continue
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "value_error" and isinstance(e.get("input"), dict):
            lines.append(f"[{key}] {msg}")  # a check across keys of one table
            continue
        how = "fix it in the scenario" + (
            f" or with --set {key}=..." if set_hint and plain == key else ""
        )
        lines.append(f"{key} = {e.get('input')!r}: {msg}; {how}")
    return f"invalid {what}:\n  " + "\n  ".join(lines)


def apply_overrides(
    data: dict[str, object], overrides: list[str] | dict[str, object]
) -> dict[str, object]:
    """``section.key=value`` strings (or a ``{"section.key": value}`` dict) onto raw data."""
    items: Iterable[tuple[str | list[str], object]] = (
        overrides.items()
        if isinstance(overrides, dict)
        else (parse_override(o, ScenarioError) for o in overrides)
    )
    for key, value in items:
        apply_override(data, key.split(".") if isinstance(key, str) else key, value, ScenarioError)
    return data


def scenario_from_dict(data: dict[str, object], base_dir: str | Path = ".") -> Scenario:
    data = dict(data)
    data.setdefault("base_dir", str(base_dir))
    try:
        return Scenario.model_validate(data)
    except ValidationError as exc:
        raise ScenarioError(_explain(exc)) from None


def read_toml(path: str | Path) -> dict[str, object]:
    p = Path(path)
    if not p.is_file():
        raise ScenarioError(
            f"scenario file {str(p)!r} not found: pass an existing TOML file (see examples/sim/)"
        )
    try:
        return tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ScenarioError(f"scenario file {str(p)!r} is not valid TOML: {exc}") from None


def load_scenario(
    path: str | Path, overrides: list[str] | dict[str, object] | None = None
) -> Scenario:
    data = apply_overrides(read_toml(path), overrides or [])
    if "jobs" in data:  # examples/sim/multirun-*.toml: several jobs sharing one fleet
        raise ScenarioError(
            f"{path}: a multi-job scenario ([[jobs]] tables): run it with "
            f"python benchmarks/sim_multirun.py (docs/multirun.md), not as one job"
        )
    return scenario_from_dict(data, Path(path).resolve().parent)
