"""One typed configuration for every Echo process.

Loaded from TOML, overridden from the command line with ``--set section.key=value`` (the value is
parsed as TOML, so ``--set learner.max_steps=50`` and ``--set model.name="/models/qwen3"`` both
work), and validated at load. Every error names the key, the bad value and how to fix it.

The learner holds the whole config; a worker receives the parts it needs (``WorkerView``) in the
join acknowledgement, so both sides derive their behaviour from the same file.
"""

from __future__ import annotations

import difflib
import re
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


class ConfigError(ValueError):
    """A configuration problem, phrased for the user: key, value, fix."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


DEVICE_SPEC = re.compile(r"auto|cpu|cuda(:\d+)?")


def check_device(value: str) -> str:
    """``auto``, ``cpu``, ``cuda`` or ``cuda:N``; resolved to a torch device by
    ``echo.models.resolve_device`` in the process that uses it."""
    if not DEVICE_SPEC.fullmatch(value):
        raise ValueError(f"unknown device {value!r}: use auto (a GPU if there is one, else the "
                         f"CPU), cpu, cuda or cuda:N")
    return value


class ModelConfig(_Section):
    # "tiny-qwen3" builds a random-init Qwen3 and a character tokenizer locally (no download);
    # anything else is a path to a Hugging Face model directory on disk.
    name: str = "tiny-qwen3"
    hidden_size: int = Field(64, gt=0)
    intermediate_size: int = Field(256, gt=0)
    num_layers: int = Field(2, gt=0)
    num_heads: int = Field(4, gt=0)
    num_kv_heads: int = Field(2, gt=0)
    head_dim: int = Field(16, gt=0)
    max_positions: int = Field(64, gt=0)
    seed: int = 0


class AdapterConfig(_Section):
    name: str = "toy-add"
    # Adapter-specific options, validated by the adapter itself at start-up.
    options: dict[str, Any] = Field(default_factory=dict)
    # Options per adapter name ([adapter.presets.math] ...): a config can carry settings for
    # several tasks so that switching task is only the ``name`` line. ``options`` wins.
    presets: dict[str, dict[str, Any]] = Field(default_factory=dict)

    @property
    def effective_options(self) -> dict[str, Any]:
        return {**self.presets.get(self.name, {}), **self.options}


class StalenessRules:
    """What the learner and the simulator derive from the same fields (staleness, kappa,
    prompts_per_step, max_outstanding_groups): one definition for both."""

    staleness: int
    kappa: int
    prompts_per_step: int
    max_outstanding_groups: int

    @property
    def effective_kappa(self) -> int:
        return self.kappa or max(1, self.staleness - 1)  # DESIGN 3

    @property
    def effective_outstanding(self) -> int:
        return self.max_outstanding_groups or 2 * self.prompts_per_step

    def check_kappa(self) -> None:
        if self.kappa > self.staleness:
            raise ValueError(
                f"kappa={self.kappa} exceeds staleness={self.staleness}: every publication would "
                f"arrive too late; set learner.kappa <= learner.staleness (or 0 for max(1, S-1))")


class LearnerConfig(StalenessRules, _Section):
    host: str = "127.0.0.1"
    port: int = Field(0, ge=0, le=65535)  # 0: the OS picks a free port
    max_steps: int = Field(200, gt=0)
    prompts_per_step: int = Field(32, gt=0)
    group_size: int = Field(16, ge=2)
    lr: float = Field(1e-3, gt=0)
    updates_per_step: int = Field(2, gt=0)
    staleness: int = Field(2, ge=1)  # S
    kappa: int = Field(0, ge=0)  # 0: derive max(1, S-1)
    epsilon: float = Field(0.2, gt=0, lt=1)
    is_cap: float = Field(2.0, gt=0)  # C, truncated importance-sampling cap
    beta: float = Field(0.0, ge=0)
    adv_eps: float = Field(1e-4, gt=0)
    loss_agg: Literal["token-mean", "seq-mean"] = "token-mean"
    torch_threads: int = Field(1, gt=0)
    max_outstanding_groups: int = Field(0, ge=0)  # 0: 2 * prompts_per_step
    lease_timeout_s: float = Field(30.0, gt=0)
    wait_timeout_s: float = Field(120.0, gt=0)  # give up when no admissible data this long
    price_per_hour: float = Field(0.0, ge=0)
    checkpoint: bool = True  # checkpoint before every publication (needed for --resume)
    fsync: bool = True  # fsync the buffer log before acknowledging (off only for benchmarks)
    # Where the policy trains: auto (cuda:LOCAL_RANK if a GPU is visible, else cpu), cpu, cuda,
    # cuda:N. On a GPU with bf16 the weights and Adam stay float32 and the forward runs in bf16.
    device: str = "auto"

    _device = field_validator("device")(check_device)

    @model_validator(mode="after")
    def _kappa_within_budget(self) -> "LearnerConfig":
        self.check_kappa()
        return self


class BufferConfig(_Section):
    capacity_groups: int = Field(256, gt=0)


class WorkerConfig(_Section):
    groups_per_request: int = Field(2, gt=0)
    max_new_tokens: int = Field(4, gt=0)
    temperature: float = Field(1.0, gt=0)
    torch_threads: int = Field(1, gt=0)
    heartbeat_s: float = Field(1.0, gt=0)
    max_unacked_batches: int = Field(8, gt=0)
    backend: Literal["transformers"] = "transformers"
    # Where a worker generates: auto (cuda:0 if the worker has a GPU, else cpu), cpu, cuda,
    # cuda:N. The model runs in bf16 on a GPU that supports it, float32 on the CPU.
    device: str = "auto"

    _device = field_validator("device")(check_device)


class BroadcastConfig(_Section):
    topology: Literal["chains", "star", "star-unlimited"] = "chains"
    chunk_kib: int = Field(1024, gt=0)
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    window: int = Field(4, gt=0)  # chunk requests in flight per stream
    uplink_mbit: float = Field(0.0, ge=0)  # learner uplink U: plans k = U/b chains; 0 = unknown
    link_mbit: float = Field(0.0, ge=0)  # nominal worker link b; 0 = median of declared rates
    timeout_s: float = Field(10.0, gt=0)  # a source silent this long is replaced
    q: float = Field(1.0, gt=0, le=1)  # T_bcast = time until this fraction of workers installed


class TransportConfig(_Section):
    max_message_mib: float = Field(16.0, gt=0)
    heartbeat_timeout_s: float = Field(5.0, gt=0)
    request_timeout_s: float = Field(10.0, gt=0)


class ProvisioningConfig(_Section):
    """The closed-loop controller (DESIGN 4). Off: every joined worker is active."""

    enabled: bool = False
    alpha: float = Field(1.1, ge=1.0)  # safety factor on mu_req
    delta: float = Field(0.2, gt=0)  # release margin: release above (alpha + delta) * mu_req
    window_s: float = Field(60.0, gt=0)  # a condition must hold this long before acting
    tau_s: float = Field(60.0, gt=0)  # EWMA time constant of measured throughput
    warmup_s: float = Field(30.0, ge=0)  # a newly active worker keeps its prior this long
    initial_active: int = Field(1, ge=1)  # the first joiners start active (bootstrap)
    mu_prior: float = Field(1.0, gt=0)  # trajectories/s assumed for a worker before any measurement


class MetricsConfig(_Section):
    """The learner's /metrics (Prometheus), /health and live dashboard."""

    enabled: bool = True
    host: str = "127.0.0.1"  # keep it local or on a private network: no authentication
    port: int = Field(0, ge=0, le=65535)  # 0: the OS picks; the address is in learner.json


class QuickstartConfig(_Section):
    workers: int = Field(4, gt=0)
    worker_prices: list[float] = Field(default_factory=lambda: [0.35])


class EchoConfig(_Section):
    run_name: str = "echo"
    seed: int = 0
    model: ModelConfig = Field(default_factory=ModelConfig)
    adapter: AdapterConfig = Field(default_factory=AdapterConfig)
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    buffer: BufferConfig = Field(default_factory=BufferConfig)
    worker: WorkerConfig = Field(default_factory=WorkerConfig)
    broadcast: BroadcastConfig = Field(default_factory=BroadcastConfig)
    transport: TransportConfig = Field(default_factory=TransportConfig)
    provisioning: ProvisioningConfig = Field(default_factory=ProvisioningConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    quickstart: QuickstartConfig = Field(default_factory=QuickstartConfig)

    @model_validator(mode="after")
    def _buffer_holds_a_step(self) -> "EchoConfig":
        if self.buffer.capacity_groups < self.learner.prompts_per_step:
            raise ValueError(
                f"buffer.capacity_groups={self.buffer.capacity_groups} is smaller than "
                f"learner.prompts_per_step={self.learner.prompts_per_step}: the learner could "
                f"never assemble a batch; raise buffer.capacity_groups"
            )
        return self

    def worker_view(self) -> dict[str, Any]:
        """The part of the config a worker needs, sent to it on join."""
        return {
            "model": self.model.model_dump(),
            "adapter": {"name": self.adapter.name, "options": self.adapter.effective_options},
            "worker": self.worker.model_dump(),
            "broadcast": self.broadcast.model_dump(),
            "transport": self.transport.model_dump(),
            "group_size": self.learner.group_size,
        }


# ----------------------------------------------------------------------------- loading


def parse_override(item: str, error: type[Exception] = ConfigError) -> tuple[list[str], Any]:
    """``section.key=value`` (value in TOML syntax, a bare word being a string) -> (path,
    value). Shared with the simulator's scenarios, which raise their own ``error``."""
    if "=" not in item:
        raise error(f"override {item!r} has no '=': write --set section.key=value")
    key, raw = item.split("=", 1)
    key = key.strip()
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw  # a bare word is taken as a string: --set model.name=/models/qwen3
    return key.split("."), value


def apply_override(data: dict[str, Any], path: list[str], value: Any,
                   error: type[Exception] = ConfigError) -> None:
    node = data
    for part in path[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise error(f"override {'.'.join(path)}: {part!r} is not a table")
    node[path[-1]] = value


def known_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every dotted key of a config model (for "did you mean ...?" hints)."""
    keys = []
    for name, field in model.model_fields.items():
        keys.append(prefix + name)
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            keys.extend(known_keys(ann, prefix + name + "."))
    return keys


def _explain(err: ValidationError, data: dict[str, Any]) -> str:
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "(top level)"
        if e["type"] == "extra_forbidden":
            close = difflib.get_close_matches(key, known_keys(EchoConfig), n=1)
            hint = f"did you mean {close[0]!r}?" if close else "remove it (see examples/quickstart.toml)"
            lines.append(f"unknown key {key!r}: {hint}")
            continue
        value = e.get("input")
        msg = e["msg"].removeprefix("Value error, ")
        lines.append(f"{key} = {value!r}: {msg}; fix it in the TOML or with --set {key}=...")
    return "invalid config:\n  " + "\n  ".join(lines)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> EchoConfig:
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} not found: pass an existing TOML file "
                              f"(examples/quickstart.toml is a good start)")
        try:
            data = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {str(p)!r} is not valid TOML: {exc}") from None
    for item in overrides or []:
        apply_override(data, *parse_override(item))
    try:
        return EchoConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_explain(exc, data)) from None


def dump_toml(cfg: EchoConfig) -> str:
    """Resolved config as TOML (written into every run folder)."""
    def fmt(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
        if isinstance(v, list):
            return "[" + ", ".join(fmt(x) for x in v) + "]"
        if isinstance(v, dict):
            return "{" + ", ".join(f'"{k}" = {fmt(x)}' for k, x in v.items()) + "}"
        return repr(v)

    out = []
    data = cfg.model_dump()
    for k, v in data.items():
        if not isinstance(v, dict):
            out.append(f"{k} = {fmt(v)}")
    for k, v in data.items():
        if isinstance(v, dict):
            out.append(f"\n[{k}]")
            out.extend(f"{kk} = {fmt(vv)}" for kk, vv in v.items())
    return "\n".join(out) + "\n"
