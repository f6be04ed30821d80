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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from echo.addresses import is_loopback, public_host_problem

# The sections and helpers live in modules of their own (each under 500 lines); ``echo.config``
# stays the one import for all of them.
from echo.config_sections import (
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
from echo.config_security import SecurityConfig
from echo.config_toml import (
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


class StalenessRules:
    """What the learner and the simulator derive from the same fields (staleness, kappa,
    prompts_per_step, max_outstanding_groups): one definition for both."""

    staleness: int
    kappa: int
    prompts_per_step: int
    max_outstanding_groups: int

    @property
    def effective_kappa(self) -> int:
        return self.kappa or max(1, self.staleness - 1)  # docs/design.md §3

    @property
    def effective_outstanding(self) -> int:
        return self.max_outstanding_groups or 2 * self.prompts_per_step

    def check_kappa(self) -> None:
        # S = 0 (synchronous) publishes every step: kappa 1 is the one period it allows.
        if self.kappa > max(1, self.staleness):
            raise ValueError(
                f"kappa={self.kappa} exceeds staleness={self.staleness}: every publication would "
                f"arrive too late; set learner.kappa <= learner.staleness (or 0 for max(1, S-1))"
            )


DEFAULT_PORT = 5555  # learner.port when the learner listens beyond loopback (docs/ports.md)
DEFAULT_RELAY_PORT = 5560  # a worker's relay (its punch port: + 1) when it listens beyond loopback
LAYOUT_SPAN = 4  # ports after learner.port: chunks +1, reflectors +2 and +3, dashboard +4


@dataclass(frozen=True)
class ListenPorts:
    """Every port the learner listens on, resolved from the config (0: the OS picks)."""

    control: int
    chunks: int
    reflectors: tuple[int, int]
    metrics: int

    def named(self) -> dict[str, int]:
        """Config key -> port, for messages (the reflector's two as one key each)."""
        return {
            "learner.port": self.control,
            "learner.chunk_port": self.chunks,
            "learner.reflector_ports[0]": self.reflectors[0],
            "learner.reflector_ports[1]": self.reflectors[1],
            "metrics.port": self.metrics,
        }

    def reusing(self, previous: ListenPorts) -> ListenPorts:
        """Each port the OS would pick taken from ``previous`` (a resumed run's), so the fleet
        finds the learner where it was; a port the config fixes stays as it is."""
        return ListenPorts(
            self.control or previous.control,
            self.chunks or previous.chunks,
            (
                self.reflectors[0] or previous.reflectors[0],
                self.reflectors[1] or previous.reflectors[1],
            ),
            self.metrics or previous.metrics,
        )


class LoraConfig(_Section):
    """LoRA through peft (docs/learner.md, "LoRA"): the learner trains a low-rank adapter on the
    frozen base model, and every published version carries only the adapter's tensors plus the
    base model's content hash; workers hold the base model and apply each version's adapter."""

    enabled: bool = False  # train a LoRA adapter instead of every weight of the model
    rank: int = Field(16, gt=0)  # r: each adapted layer gets A (r x in) and B (out x r)
    alpha: float = Field(32.0, gt=0)  # the adapter's output is scaled by alpha / rank
    # Dropout on the adapter's input while training. 0 keeps the learner's forward passes
    # deterministic, so the step-start log-probs and the trained ones see the same function.
    dropout: float = Field(0.0, ge=0, lt=1)
    # Modules to adapt: a list of module names (["q_proj", "v_proj"]: every module whose name
    # ends so), or "all-linear" (every linear layer but the output head, peft's keyword).
    target_modules: str | list[str] = "all-linear"

    @field_validator("target_modules")
    @classmethod
    def _targets(cls, value: str | list[str]) -> str | list[str]:
        if isinstance(value, str) and value != "all-linear":
            raise ValueError(f'give a list of module names (["{value}"]) or "all-linear"')
        if isinstance(value, list) and (not value or not all(v.strip() for v in value)):
            raise ValueError('name at least one module (["q_proj", "v_proj"]), or use "all-linear"')
        return value


class LearnerConfig(StalenessRules, _Section):
    host: str = "127.0.0.1"  # address the control plane binds (0.0.0.0: every interface)
    # The address workers reach the learner at ("" = host): every endpoint the learner hands
    # out (join line, snapshot source, reflectors, learner.json) names it. Required when host
    # is a wildcard (0.0.0.0, ::); set it too behind a NAT or port forward (a cloud VM's public IP).
    public_host: str = ""
    # The learner's ports (docs/ports.md): the control plane listens on port, snapshot chunks
    # on port + 1, the NAT reflector on port + 2 and port + 3, the dashboard (metrics.port) on
    # port + 4. Unset: 5555 when host is reachable from other machines, 0 on loopback (tests,
    # the quickstart, several runs on one machine). 0: the OS picks every one of them.
    port: int | None = Field(None, ge=0, le=65535)
    chunk_port: int | None = Field(None, ge=0, le=65535)  # unset: port + 1 (0 when port is 0)
    # The reflector's two TCP listeners (docs/nat.md). Unset: [port + 2, port + 3].
    reflector_ports: list[int] | None = None
    max_steps: int = Field(200, gt=0)  # learner steps, then the run ends and workers are told
    # Prompt groups per learner step (N = this x group_size).
    prompts_per_step: int = Field(32, gt=0)
    group_size: int = Field(16, ge=2)  # samples per prompt: GRPO normalises rewards within a group
    lr: float = Field(1e-3, gt=0)  # Adam learning rate
    updates_per_step: int = Field(2, gt=0)  # optimiser updates (mini-batches) per learner step
    # Rows per forward and backward pass, each rank (0: a rank's whole mini-batch at once, the
    # fastest for small models). The activations kept for backward grow with it: the learner's
    # step-time memory above its training state (docs/memory.md); learner.host_memory_gb lowers
    # it when the run would not fit. Gradients accumulate across micro-batches; the update is
    # the mini-batch's, whatever the split.
    micro_batch_rows: int = Field(0, ge=0)
    # Recompute each decoder layer's activations in backward instead of keeping them (a second
    # forward of each layer): the step-time memory of long sequences (docs/memory.md).
    gradient_checkpointing: bool = False
    # Host memory the learner may use, in GiB (2^30 bytes; 0: no budget). At start-up the learner says what the
    # run needs (echo/memplan.py) and, over budget, turns gradient checkpointing on and then
    # passes fewer rows at a time; a run that cannot fit is refused with what it needs.
    host_memory_gb: float = Field(0.0, ge=0)
    # S. 0 is synchronous: only the current version's trajectories train, so every step waits
    # for its own broadcast and rollouts (the baseline of benchmarks/staleness_sweep.py).
    staleness: int = Field(2, ge=0)
    kappa: int = Field(0, ge=0)  # 0: derive max(1, S-1)
    # --- GRPO objective (docs/design.md §7; docs/learner.md maps every key onto TRL's GRPOConfig).
    # Clip range [1 - epsilon, 1 + epsilon_high] of the ratio (TRL epsilon, epsilon_high).
    epsilon: float = Field(0.2, gt=0, lt=1)
    epsilon_high: float = Field(0.0, ge=0)  # 0: = epsilon (symmetric); DAPO uses 0.28
    # Behaviour-policy correction w from exp(logp_old - logp_behaviour) (TRL
    # vllm_importance_sampling_mode / _clip_max): *_truncate caps w at is_cap, *_mask zeroes it
    # above is_cap; token_* per token, sequence_* one w per sequence (product of token ratios).
    # "none": w = 1, no correction (trains stale samples as if on-policy; the sweep's "IS off").
    is_mode: Literal[
        "token_truncate", "token_mask", "sequence_truncate", "sequence_mask", "none"
    ] = "token_truncate"
    is_cap: float = Field(2.0, gt=0)  # C, the cap of is_mode
    # The clipped ratio per token, or one per sequence = exp(mean token log-ratio), i.e. GSPO
    # (TRL importance_sampling_level).
    importance_sampling_level: Literal["token", "sequence"] = "token"
    beta: float = Field(0.0, ge=0)  # KL weight (TRL beta); > 0 keeps a reference model
    # Multiply the k3 KL term by the ratio (TRL use_bias_correction_kl, DeepSeek-V3.2).
    use_bias_correction_kl: bool = False
    # Advantages (r - group mean) / (std + adv_eps), std of the group, of the whole step's
    # batch, or none (TRL scale_rewards; "none" is Dr. GRPO's).
    scale_rewards: Literal["group", "batch", "none"] = "group"
    # Added to the standard deviation when normalising advantages.
    adv_eps: float = Field(1e-4, gt=0)
    # How per-token terms become the loss (TRL loss_type): token-mean = bnpo/dapo (over the
    # mini-batch's tokens), seq-mean = grpo (per sequence, then over sequences),
    # seq-mean-token-sum-norm = dr_grpo (token sums / (sequences * worker.max_new_tokens)).
    loss_agg: Literal["token-mean", "seq-mean", "seq-mean-token-sum-norm"] = "token-mean"
    # Zero the loss of completions that hit max_new_tokens without end-of-sequence (TRL
    # mask_truncated_completions); they still count in the advantages.
    mask_truncated_completions: bool = False
    torch_threads: int = Field(1, gt=0)  # CPU threads of the learner's torch
    max_outstanding_groups: int = Field(0, ge=0)  # 0: 2 * prompts_per_step
    # A granted group not delivered this long is granted again.
    lease_timeout_s: float = Field(30.0, gt=0)
    wait_timeout_s: float = Field(120.0, gt=0)  # give up when no admissible data this long
    price_per_hour: float = Field(0.0, ge=0)  # the learner's own price, $/h, in the cost per step
    checkpoint: bool = True  # checkpoint before every publication (needed for --resume)
    # Published versions (the delta encoder's base, the versions audits and workers may still
    # need) live in files under <run dir>/spill, read through memory maps, instead of in RAM
    # (docs/memory.md). Off: each is held as bytes.
    spill_payloads: bool = True
    fsync: bool = True  # fsync the buffer log before acknowledging (off only for benchmarks)
    # Admission bounds (dataplane/records.py): a record whose |reward| exceeds this is rejected
    # ("reward_out_of_range"). Raise it if an adapter's rewards are legitimately larger; the cap
    # of 1e30 keeps rewards, their squares and the advantages finite in float32/float64.
    max_abs_reward: float = Field(1e6, gt=0, le=1e30)
    # Lowest behaviour log-prob accepted on any token, masked or not ("logprob_below_floor"):
    # a sampled token is never this unlikely; -1e39 would become -inf in float32.
    min_behaviour_logprob: float = Field(-1e4, ge=-1e30, lt=0)
    # Where the policy trains: auto (cuda:LOCAL_RANK if a GPU is visible, else cpu), cpu, cuda,
    # cuda:N. On a GPU with bf16 the weights and Adam stay float32 and the forward runs in bf16.
    device: str = "auto"
    lora: LoraConfig = Field(default_factory=LoraConfig)  # [learner.lora]

    _device = field_validator("device")(check_device)

    @model_validator(mode="after")
    def _kappa_within_budget(self) -> LearnerConfig:
        self.check_kappa()
        return self

    @property
    def base_port(self) -> int:
        """learner.port, or its default: fixed off loopback, the OS's choice on loopback."""
        if self.port is not None:
            return self.port
        return 0 if is_loopback(self.host) else DEFAULT_PORT

    @model_validator(mode="after")
    def _ports_fit(self) -> LearnerConfig:
        refl = self.reflector_ports
        if refl is not None and (len(refl) != 2 or not all(0 <= p <= 65535 for p in refl)):
            raise ValueError(
                f"learner.reflector_ports={refl!r}: the NAT reflector listens on two TCP ports; "
                f"give two ports in 0-65535 (0: the OS picks), e.g. [5557, 5558]"
            )
        derived = self.chunk_port is None or self.reflector_ports is None
        if derived and self.base_port + LAYOUT_SPAN > 65535:
            raise ValueError(
                f"learner.port={self.base_port}: the ports after it (chunks, reflectors, dashboard: "
                f"port + 1 to port + {LAYOUT_SPAN}) run past 65535; set learner.port <= "
                f"{65535 - LAYOUT_SPAN}, or learner.chunk_port and learner.reflector_ports yourself"
            )
        return self

    @model_validator(mode="after")
    def _advertises_a_usable_address(self) -> LearnerConfig:
        problem = public_host_problem(self.host, self.public_host)
        if problem:
            raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _objective_is_consistent(self) -> LearnerConfig:
        if self.epsilon_high and self.epsilon_high < self.epsilon:
            raise ValueError(
                f"epsilon_high={self.epsilon_high} is below epsilon={self.epsilon}: the upper clip "
                f"would be tighter than the lower one; set learner.epsilon_high >= learner.epsilon "
                f"(or 0 for a symmetric clip)"
            )
        if self.is_mode.endswith("_mask") and self.is_cap <= 1.0:
            raise ValueError(
                f"is_cap={self.is_cap} with is_mode={self.is_mode!r} zeroes every token whose "
                f"behaviour policy was less likely than the learner's; set learner.is_cap > 1 "
                f"(TRL uses 3.0) or a *_truncate is_mode"
            )
        return self


class BroadcastConfig(_Section):
    # Chains (peer-to-peer), star, or star-unlimited (benchmark baselines).
    topology: Literal["chains", "star", "star-unlimited"] = "chains"
    # Chunk size in MiB, a whole number of KiB (0.25: 256 KiB); every chunk is hashed and
    # verified at every hop.
    chunk_mib: float = Field(1.0, gt=0)
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"  # dtype of the published weights
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
        if self.learner.lora.enabled and self.worker.backend != "transformers":
            raise ValueError(
                f"learner.lora.enabled with worker.backend={self.worker.backend!r}: only the "
                f"transformers backend applies LoRA adapters so far; set worker.backend = "
                f'"transformers", or learner.lora.enabled = false'
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
        }


# ----------------------------------------------------------------------------- loading


def _explain(err: ValidationError, data: dict[str, Any]) -> str:
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
    data: dict[str, Any] = {}
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
