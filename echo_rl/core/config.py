"""One typed configuration for every Echo process.

Loaded from TOML, overridden from the command line with ``--set section.key=value`` (the value is
parsed as TOML, so ``--set learner.max_steps=50`` and ``--set model.name="/models/qwen3"`` both
work), and validated at load. Every error names the key, the bad value and how to fix it.

The learner holds the whole config; a worker receives the parts it needs (``WorkerView``) in the
join acknowledgement, so both sides derive their behaviour from the same file.
"""

from __future__ import annotations

import difflib
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from echo_rl.core.addresses import is_loopback

# The sections and helpers live in modules of their own (each under 500 lines); ``echo_rl.core.config``
# stays the one import for all of them.
from echo_rl.core.config_learner import (
    DEFAULT_PORT,
    DEFAULT_RELAY_PORT,
    LAYOUT_SPAN,
    HeldoutConfig,
    LearnerConfig,
    ListenPorts,
    LoraConfig,
    StalenessRules,
)
from echo_rl.core.config_sections import (
    GENERATION_KEYS,
    AdapterConfig,
    BufferConfig,
    ConfigError,
    MetricsConfig,
    ModelConfig,
    QuickstartConfig,
    TransportConfig,
    WorkerConfig,
    _Section,
    check_device,
)
from echo_rl.core.config_security import SecurityConfig
from echo_rl.core.config_toml import (
    RENAMED,
    apply_override,
    dump_toml,
    known_keys,
    parse_override,
    renamed_hint,
)

__all__ = [
    "GENERATION_KEYS",
    "AdapterConfig",
    "BroadcastConfig",
    "BufferConfig",
    "ConfigError",
    "DEFAULT_PORT",
    "DEFAULT_RELAY_PORT",
    "EchoConfig",
    "HeldoutConfig",
    "LAYOUT_SPAN",
    "LearnerConfig",
    "ListenPorts",
    "LoraConfig",
    "MetricsConfig",
    "ModelConfig",
    "ProvisioningConfig",
    "QuickstartConfig",
    "SecurityConfig",
    "StalenessRules",
    "TransportConfig",
    "WorkerConfig",
    "apply_override",
    "check_device",
    "dump_toml",
    "known_keys",
    "load_config",
    "parse_override",
]


class BroadcastConfig(_Section):
    # Chains (peer-to-peer), star, or star-unlimited (benchmark baselines).
    topology: Literal["chains", "star", "star-unlimited"] = "chains"
    # Chunk size in MiB, a whole number of KiB (0.25: 256 KiB); every chunk is hashed and
    # verified at every hop.
    chunk_mib: float = Field(1.0, gt=0)
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"  # dtype of the published weights
    # How float32 weights become bf16 ones (docs/broadcast.md, "Snapshot precision"):
    # "dither" rounds each weight up when the fraction of a unit it lies above the lower bf16
    # value passes a threshold drawn once per weight and run (unbiased across weights; a
    # publication changes only the weights that crossed theirs); "stochastic" draws fresh
    # thresholds every version (deltas about 3.5x dither's); "nearest" sends a weight back to its
    # start until its update passes half a unit: a full fine-tune at lr 1e-5 then samples a
    # policy far behind the learner's.
    rounding: Literal["dither", "stochastic", "nearest"] = "dither"
    window: int = Field(4, gt=0)  # chunk requests in flight per stream
    uplink_mbit: float = Field(0.0, ge=0)  # learner uplink U: plans k = U/b chains; 0 = unknown
    link_mbit: float = Field(0.0, ge=0)  # nominal worker link b; 0 = median of declared rates
    timeout_s: float = Field(10.0, gt=0)  # a source silent this long is replaced
    q: float = Field(1.0, gt=0, le=1)  # T_bcast = time until this fraction of workers installed
    # Delta snapshots (docs/broadcast.md): publish what changed since the previous version,
    # rebuilt bit-exact by the workers; a worker without the base fetches a keyframe from a peer.
    delta: bool = True
    keyframe_every: int = Field(10, ge=1)  # every K-th publication is full; 1 = never a delta
    # A delta bigger than this share of the full payload is published as a keyframe instead.
    delta_max_ratio: float = Field(0.8, gt=0, le=1)
    # NAT traversal (docs/nat.md): the learner's reflector classifies each worker at join, and a
    # worker behind an endpoint-independent NAT relays through punched TCP links. Off: every
    # worker that offers a relay endpoint is trusted to be reachable (the old behaviour).
    nat_traversal: bool = True
    punch_timeout_s: float = Field(
        10.0, gt=0, le=120
    )  # a link not open by then: the child is a tail
    # Relay reports (docs/security.md, "Relay reports"): a reporter is kept off the relay it
    # reported for report_avoid_s; a relay is convicted (out of the plan, or out of parent
    # positions) by reports of one kind from this many distinct assigned children, or by the
    # learner's own probe, for relay_mark_s (doubled at each repeat), then probed again.
    convict_after: int = Field(2, ge=1)
    report_avoid_s: float = Field(600.0, gt=0)
    relay_mark_s: float = Field(60.0, gt=0)

    @field_validator("chunk_mib")
    @classmethod
    def _whole_kib(cls, value: float) -> float:
        if not (value * 1024).is_integer():
            raise ValueError(
                f"a chunk is a whole number of KiB, and {value} MiB is {value * 1024:g} "
                f"KiB: use a multiple of 1/1024 MiB (0.25 = 256 KiB, 1.0 = 1024 KiB)"
            )
        return value

    @property
    def chunk_bytes(self) -> int:
        return int(self.chunk_mib * 2**20)


class ProvisioningConfig(_Section):
    """The closed-loop controller (docs/design.md §4). Off: every joined worker is active."""

    enabled: bool = False  # off: every joined worker is active
    alpha: float = Field(1.1, ge=1.0)  # safety factor on mu_req
    delta: float = Field(0.2, gt=0)  # release margin: release above (alpha + delta) * mu_req
    window_s: float = Field(60.0, gt=0)  # a condition must hold this long before acting
    tau_s: float = Field(60.0, gt=0)  # EWMA time constant of measured throughput
    warmup_s: float = Field(30.0, ge=0)  # a newly active worker keeps its prior this long
    # The first joiners start active (bootstrap), only while no worker has been measured yet.
    initial_active: int = Field(1, ge=1)
    # No worker gets throughput credit before it delivers (docs/security.md, "Measured, not
    # declared"). When measured capacity is short, at most this many unmeasured workers are
    # active at once on probation (cheapest first) so they can be measured; one that delivers
    # nothing within warmup_s + window_s goes back to standby. 0: only measured workers.
    probation_slots: int = Field(4, ge=0)
    # The delivery clock starts at the probationer's first work request (model loaded,
    # snapshot installed); one that never asks within this long also goes back to standby.
    probation_ready_s: float = Field(600.0, gt=0)
    # A probation lasts warmup_s + window_s plus two generation times of one group: the
    # fleet's measured time once anyone delivered, this many seconds before (a SmolLM2 group
    # on a CPU takes tens of seconds; the toy task's a fraction of one).
    probation_group_s: float = Field(30.0, ge=0)
    # Staleness is not free (docs/security.md): a trajectory admitted s
    # versions behind counts 1 - staleness_discount * s / learner.staleness in its worker's
    # throughput credit (fresh: 1, at the edge: 1 - staleness_discount). 0: staleness is free.
    staleness_discount: float = Field(0.5, ge=0, lt=1)


class EchoConfig(_Section):
    run_name: str = "echo"  # name of the run: runs/RUN_NAME-TIME/ unless --run-dir
    seed: int = 0  # seeds the prompt order (model.seed seeds the tiny model)
    model: ModelConfig = Field(default_factory=ModelConfig)
    adapter: AdapterConfig = Field(default_factory=AdapterConfig)
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    buffer: BufferConfig = Field(default_factory=BufferConfig)
    worker: WorkerConfig = Field(default_factory=WorkerConfig)
    broadcast: BroadcastConfig = Field(default_factory=BroadcastConfig)
    transport: TransportConfig = Field(default_factory=TransportConfig)
    provisioning: ProvisioningConfig = Field(default_factory=ProvisioningConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    security: SecurityConfig = Field(default_factory=SecurityConfig)
    quickstart: QuickstartConfig = Field(default_factory=QuickstartConfig)

    @model_validator(mode="after")
    def _preset_generation(self) -> EchoConfig:
        """The chosen task's generation settings, unless [worker] (or --set) gives its own."""
        for key, value in self.adapter.generation.items():
            if key not in self.worker.model_fields_set:
                setattr(self.worker, key, value)  # validated as [worker] would be
        return self

    @model_validator(mode="after")
    def _buffer_holds_a_step(self) -> EchoConfig:
        if self.buffer.capacity_groups < self.learner.prompts_per_step:
            raise ValueError(
                f"buffer.capacity_groups={self.buffer.capacity_groups} is smaller than "
                f"learner.prompts_per_step={self.learner.prompts_per_step}: the learner could "
                f"never assemble a batch; raise buffer.capacity_groups"
            )
        return self

    @model_validator(mode="after")
    def _lora_has_a_backend(self) -> EchoConfig:
        if self.learner.lora.enabled and self.worker.backend == "vllm":
            raise ValueError(
                f"learner.lora.enabled with worker.backend={self.worker.backend!r}: only the "
                f"engine and transformers backends apply LoRA adapters so far; set "
                f'worker.backend = "engine", or learner.lora.enabled = false'
            )
        return self

    @model_validator(mode="after")
    def _public_needs_security(self) -> EchoConfig:
        host = self.learner.host
        if not is_loopback(host) and not self.security.curve and not self.security.insecure:
            raise ValueError(
                f"learner.host={host!r} is not loopback and security.curve is off: strangers "
                f"could impersonate any worker; turn security.curve on, or pass --insecure "
                f"(security.insecure=true) if this network is private"
            )
        return self

    def listen_ports(self) -> ListenPorts:
        """The learner's ports (docs/ports.md): learner.port and the layout after it, each
        key that is set taking precedence over the layout."""
        lc, base = self.learner, self.learner.base_port

        def after(offset: int) -> int:
            return base + offset if base else 0

        refl = lc.reflector_ports or [after(2), after(3)]
        metrics = self.metrics.port if self.metrics.port is not None else after(LAYOUT_SPAN)
        return ListenPorts(
            base, after(1) if lc.chunk_port is None else lc.chunk_port, (refl[0], refl[1]), metrics
        )

    @model_validator(mode="after")
    def _ports_distinct(self) -> EchoConfig:
        named = self.listen_ports().named()
        if not self.metrics.enabled:
            named.pop("metrics.port")
        if not self.broadcast.nat_traversal:
            named.pop("learner.reflector_ports[0]")
            named.pop("learner.reflector_ports[1]")
        seen: dict[int, str] = {}
        for key, port in named.items():
            if port and port in seen:
                raise ValueError(
                    f"{seen[port]} and {key} are both {port}: each of the learner's sockets needs "
                    f"a port of its own; change one (docs/ports.md gives the layout)"
                )
            seen[port] = key
        return self

    def worker_view(self) -> dict[str, Any]:
        """The part of the config a worker needs, sent to it on join."""
        return {
            "model": self.model.model_dump(),
            "adapter": {"name": self.adapter.name, "options": self.adapter.effective_options},
            "worker": self.worker.model_dump(),
            "broadcast": self.broadcast.model_dump(),
            "transport": self.transport.model_dump(),
            "security": {
                "max_parked_per_peer": self.security.max_parked_per_peer,
                "peer_chunk_requests_per_s": self.security.peer_chunk_requests_per_s,
                "max_parked_total": self.security.max_parked_total,
            },
            "group_size": self.learner.group_size,
            # how versions are applied: a LoRA run's versions are adapters on the base model
            "lora": self.learner.lora.model_dump(),
            # this learner admits a multi-turn record's stats and cut (echo_rl/data/records.py);
            # a worker sends them only when told so, since an older learner refuses them
            "episode_stats": True,
        }


# ----------------------------------------------------------------------------- loading


def _explain(err: ValidationError, data: dict[str, object]) -> str:
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "(top level)"
        if e["type"] == "extra_forbidden" and key in RENAMED:
            lines.append(renamed_hint(key, e.get("input")))
            continue
        if e["type"] == "extra_forbidden":
            close = difflib.get_close_matches(key, known_keys(EchoConfig), n=1)
            hint = (
                f"did you mean {close[0]!r}?"
                if close
                else "remove it (see examples/quickstart.toml)"
            )
            lines.append(f"unknown key {key!r}: {hint}")
            continue
        value = e.get("input")
        msg = e["msg"].removeprefix("Value error, ")
        if not e["loc"] or isinstance(value, dict):
            # a rule across keys: its message names them and the fix; the input is a whole
            # section (or the whole config), not worth printing
            lines.append(msg)
            continue
        lines.append(f"{key} = {value!r}: {msg}; fix it in the TOML or with --set {key}=...")
    return "invalid config:\n  " + "\n  ".join(lines)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> EchoConfig:
    data: dict[str, object] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(
                f"config file {str(p)!r} not found: pass an existing TOML file "
                f"(examples/quickstart.toml is a good start)"
            )
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
