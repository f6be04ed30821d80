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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from echo.addresses import is_loopback, public_host_problem


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
    hidden_size: int = Field(64, gt=0)  # tiny-qwen3 only (a real model brings its own config)
    intermediate_size: int = Field(256, gt=0)  # tiny-qwen3 only
    num_layers: int = Field(2, gt=0)  # tiny-qwen3 only
    num_heads: int = Field(4, gt=0)  # tiny-qwen3 only
    num_kv_heads: int = Field(2, gt=0)  # tiny-qwen3 only
    head_dim: int = Field(16, gt=0)  # tiny-qwen3 only
    max_positions: int = Field(64, gt=0)  # tiny-qwen3 only: longest prompt + completion, tokens
    seed: int = 0  # tiny-qwen3 only: seed of the random initialisation
    # tiny-qwen3 only: its character tokenizer. "arith" (24 tokens): digits, + - * = and a-f,
    # what the toy tasks need; "text" (100 tokens): those and every other printable ASCII
    # character, space and newline (ordinary text). A prompt the tokenizer cannot spell stops
    # the learner at start-up (docs/adapters.md, 'What is checked at start-up').
    tiny_vocab: Literal["arith", "text"] = "arith"


GENERATION_KEYS = ("max_new_tokens", "temperature")  # what a preset may set for [worker]


class AdapterConfig(_Section):
    # The task: toy-add, math, poker, or any installed adapter (docs/adapters.md).
    name: str = "toy-add"
    # Adapter-specific options, validated by the adapter itself at start-up.
    options: dict[str, Any] = Field(default_factory=dict)
    # Options per adapter name ([adapter.presets.math] ...): a config can carry settings for
    # several tasks so that switching task is only the ``name`` line. ``options`` wins. A
    # preset's ``generation`` table ([adapter.presets.math.generation] max_new_tokens = 16,
    # temperature = 1.0) sets the [worker] generation keys for that task, where [worker] does
    # not set them itself.
    presets: dict[str, dict[str, Any]] = Field(default_factory=dict)

    @property
    def effective_options(self) -> dict[str, Any]:
        preset = {k: v for k, v in self.presets.get(self.name, {}).items() if k != "generation"}
        return {**preset, **self.options}

    @property
    def generation(self) -> dict[str, Any]:
        """The chosen adapter's generation settings from its preset (may be empty)."""
        gen = self.presets.get(self.name, {}).get("generation", {})
        if not isinstance(gen, dict):
            raise ValueError(f"adapter.presets.{self.name}.generation must be a table "
                             f"(max_new_tokens, temperature), got {gen!r}")
        unknown = sorted(set(gen) - set(GENERATION_KEYS))
        if unknown:
            raise ValueError(f"adapter.presets.{self.name}.generation.{unknown[0]} is not a "
                             f"generation setting: use {', '.join(GENERATION_KEYS)}")
        return gen


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
                f"arrive too late; set learner.kappa <= learner.staleness (or 0 for max(1, S-1))")


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
        return {"learner.port": self.control, "learner.chunk_port": self.chunks,
                "learner.reflector_ports[0]": self.reflectors[0],
                "learner.reflector_ports[1]": self.reflectors[1], "metrics.port": self.metrics}

    def reusing(self, previous: "ListenPorts") -> "ListenPorts":
        """Each port the OS would pick taken from ``previous`` (a resumed run's), so the fleet
        finds the learner where it was; a port the config fixes stays as it is."""
        return ListenPorts(self.control or previous.control, self.chunks or previous.chunks,
                           (self.reflectors[0] or previous.reflectors[0],
                            self.reflectors[1] or previous.reflectors[1]),
                           self.metrics or previous.metrics)


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
    is_mode: Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask",
                     "none"] = "token_truncate"
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
    def _kappa_within_budget(self) -> "LearnerConfig":
        self.check_kappa()
        return self

    @property
    def base_port(self) -> int:
        """learner.port, or its default: fixed off loopback, the OS's choice on loopback."""
        if self.port is not None:
            return self.port
        return 0 if is_loopback(self.host) else DEFAULT_PORT

    @model_validator(mode="after")
    def _ports_fit(self) -> "LearnerConfig":
        refl = self.reflector_ports
        if refl is not None and (len(refl) != 2 or not all(0 <= p <= 65535 for p in refl)):
            raise ValueError(
                f"learner.reflector_ports={refl!r}: the NAT reflector listens on two TCP ports; "
                f"give two ports in 0-65535 (0: the OS picks), e.g. [5557, 5558]")
        derived = self.chunk_port is None or self.reflector_ports is None
        if derived and self.base_port + LAYOUT_SPAN > 65535:
            raise ValueError(
                f"learner.port={self.base_port}: the ports after it (chunks, reflectors, dashboard: "
                f"port + 1 to port + {LAYOUT_SPAN}) run past 65535; set learner.port <= "
                f"{65535 - LAYOUT_SPAN}, or learner.chunk_port and learner.reflector_ports yourself")
        return self

    @model_validator(mode="after")
    def _advertises_a_usable_address(self) -> "LearnerConfig":
        problem = public_host_problem(self.host, self.public_host)
        if problem:
            raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _objective_is_consistent(self) -> "LearnerConfig":
        if self.epsilon_high and self.epsilon_high < self.epsilon:
            raise ValueError(
                f"epsilon_high={self.epsilon_high} is below epsilon={self.epsilon}: the upper clip "
                f"would be tighter than the lower one; set learner.epsilon_high >= learner.epsilon "
                f"(or 0 for a symmetric clip)")
        if self.is_mode.endswith("_mask") and self.is_cap <= 1.0:
            raise ValueError(
                f"is_cap={self.is_cap} with is_mode={self.is_mode!r} zeroes every token whose "
                f"behaviour policy was less likely than the learner's; set learner.is_cap > 1 "
                f"(TRL uses 3.0) or a *_truncate is_mode")
        return self


class BufferConfig(_Section):
    # Groups the replay buffer holds; past it deliveries are refused (buffer_full).
    capacity_groups: int = Field(256, gt=0)


class WorkerConfig(_Section):
    # Groups one work request asks for (grown on long links).
    groups_per_request: int = Field(2, gt=0)
    # Longest completion; longer ones are cut (set it per task).
    max_new_tokens: int = Field(4, gt=0)
    # Sampling temperature. The learner computes its log-probs at the same temperature (logits /
    # temperature, as TRL does), so importance weights compare one distribution.
    temperature: float = Field(1.0, gt=0)
    # CPU threads of a worker's torch (echo-worker --threads overrides).
    torch_threads: int = Field(1, gt=0)
    heartbeat_s: float = Field(1.0, gt=0)  # seconds between a worker's heartbeats
    # Batches a worker holds unacknowledged before it stops generating.
    max_unacked_batches: int = Field(8, gt=0)
    # transformers (default; CPU or GPU) or vllm (CUDA only; pip install -e '.[vllm]' with the
    # CUDA build of torch, docs/worker.md). vllm_gpu_memory is the share of GPU memory vLLM takes.
    backend: Literal["transformers", "vllm"] = "transformers"
    # Share of GPU memory the vLLM engine takes (backend vllm).
    vllm_gpu_memory: float = Field(0.5, gt=0, le=1)
    # Where a worker generates: auto (cuda:0 if the worker has a GPU, else cpu), cpu, cuda,
    # cuda:N. The model runs in bf16 on a GPU that supports it, float32 on the CPU.
    device: str = "auto"
    # The dtype the transformers backend generates in (docs/memory.md): auto is bfloat16 on a GPU
    # that supports it and float32 on the CPU (bf16 kernels are slow there), or bfloat16 when a
    # volunteer's --host-memory-gb needs it. bfloat16 halves a CPU worker's model memory; its
    # log-probs lie 0.04 nats a token from the learner's float32 audits on SmolLM2
    # (benchmarks/bf16_logprobs.py), inside security.audit_logprob_tol.
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"

    _device = field_validator("device")(check_device)


class BroadcastConfig(_Section):
    # Chains (peer-to-peer), star, or star-unlimited (benchmark baselines).
    topology: Literal["chains", "star", "star-unlimited"] = "chains"
    # Chunk size; every chunk is hashed and verified at every hop.
    chunk_kib: int = Field(1024, gt=0)
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
    punch_timeout_s: float = Field(10.0, gt=0, le=120)  # a link not open by then: the child is a tail
    # Relay reports (docs/security.md, "Relay reports"): a reporter is kept off the relay it
    # reported for report_avoid_s; a relay is convicted (out of the plan, or out of parent
    # positions) by reports of one kind from this many distinct assigned children, or by the
    # learner's own probe, for relay_mark_s (doubled at each repeat), then probed again.
    convict_after: int = Field(2, ge=1)
    report_avoid_s: float = Field(600.0, gt=0)
    relay_mark_s: float = Field(60.0, gt=0)


class TransportConfig(_Section):
    # Largest message accepted; larger ones are refused (oversize).
    max_message_mib: float = Field(16.0, gt=0)
    # A worker silent this long is removed; its groups go to others. With the heartbeat period
    # lengthened for a large fleet (heartbeats_per_s), the timeout grows in proportion.
    heartbeat_timeout_s: float = Field(5.0, gt=0)
    # The learner's budget of heartbeats a second, the whole fleet together (docs/scale.md):
    # past worker.heartbeat_s x this many workers, each worker is told a longer period,
    # fleet size / heartbeats_per_s, so a heartbeat's cost stops growing with the fleet.
    # 0: every worker beats at worker.heartbeat_s whatever the fleet's size.
    heartbeats_per_s: float = Field(500.0, ge=0)
    # A worker's request unanswered this long is sent again.
    request_timeout_s: float = Field(10.0, gt=0)


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


class MetricsConfig(_Section):
    """The learner's /metrics (Prometheus), /health and live dashboard."""

    enabled: bool = True  # serve /metrics, /health, /api/state and the dashboard
    # Read-only pages, no authentication: keep it local or on a private network. At most 32
    # connections are served at once; idle ones close after 10 s (echo/metrics.py).
    host: str = "127.0.0.1"
    # Unset: learner.port + 4 (docs/ports.md; 0 when learner.port is 0). 0: the OS picks.
    # The address is in learner.json.
    port: int | None = Field(None, ge=0, le=65535)


class SecurityConfig(_Section):
    """Who may connect and what one peer may cost (docs/security.md)."""

    # CurveZMQ on every socket (control, chunks, relays): peers are their public keys. Off
    # only for experiments on loopback; a non-loopback learner.host without it is refused
    # unless ``insecure = true`` (then anyone can impersonate anyone).
    curve: bool = True
    insecure: bool = False  # allow plaintext on a non-loopback host (echo-rl learn --insecure)
    # Who may join: anyone with a key ("open"), a key that redeems a token from
    # `echo-rl token create` ("token"), or a key listed in ``allowlist_file`` ("allowlist").
    join: Literal["open", "token", "allowlist"] = "open"
    allowlist_file: str = ""  # one public key per line; "" = <run dir>/security/allowlist.txt
    max_workers: int = Field(1024, gt=0)  # joined sessions at once; more are refused
    handshakes_per_s: float = Field(200.0, gt=0)  # new encrypted connections, all peers
    handshakes_per_s_per_ip: float = Field(20.0, gt=0)  # ... from one IP address (burst 2x)
    joins_per_s: float = Field(50.0, gt=0)  # join requests, all peers (burst 2x)
    # Sybils (docs/security.md): a key without a session is a newcomer; each IP prefix (/24 of
    # IPv4, /48 of IPv6) may bring this many per second (and a burst), refused at the handshake
    # ("rate_limited", try later) past it: a thousand fresh keys from one host take minutes.
    newcomers_per_s_per_prefix: float = Field(2.0, gt=0)
    newcomer_burst: float = Field(32.0, ge=1)  # ... at once (a NAT whose workers all rejoin)
    prefix_v4: int = Field(24, ge=8, le=32)  # bits of an IPv4 address that make one source
    prefix_v6: int = Field(48, ge=16, le=128)  # ... of an IPv6 address
    # Snapshot notices sent per publication (members whose deliveries were admitted first, then
    # other members, then keys that have only joined); the others learn the version from their
    # next heartbeat reply. A notice costs a ticket and an encryption: at 7 publications/s (the
    # toy run) 128 notices took a third of the learner's step rate.
    notices_per_publication: int = Field(32, gt=0)
    peer_msgs_per_s: float = Field(200.0, gt=0)  # control messages one key may send (burst 2x)
    peer_mib_per_s: float = Field(64.0, gt=0)  # control-socket bytes one key may send (burst 2x)
    # Per peer and chunk server (burst 2x): 1000 x 1 MiB chunks is 1 GB/s, above what one
    # encrypted connection carries here; past it requests are dropped unanswered.
    peer_chunk_requests_per_s: float = Field(1000.0, gt=0)
    max_parked_per_peer: int = Field(64, gt=0)  # chunk requests one peer may have waiting
    max_parked_total: int = Field(4096, gt=0)  # ... all peers of one chunk server
    # Relay reports from one key that the learner's probes did not confirm, after which its
    # reports no longer count as evidence (nor start probes). Never a ban: an intact probe is
    # no proof, a relay may serve probes well and children badly (docs/security.md).
    false_reports: int = Field(10, gt=0)
    ticket_ttl_s: float = Field(3600.0, gt=0)  # how long a relay honours a pull ticket
    # What workers report is checked before it trains (docs/security.md, "Trust but verify").
    # Rewards are recomputed on the learner for adapters that can (``recomputes_rewards``);
    # a share of delivered groups is audited: behaviour log-probs recomputed under the claimed
    # snapshot version, and a test that the tokens were sampled from it.
    audit: bool = True
    audit_rate: float = Field(0.05, ge=0, le=1)  # share of groups audited after probation
    probation_groups: int = Field(4, ge=0)  # a worker's first groups: every one is audited
    audit_budget: float = Field(0.10, gt=0, le=1)  # audits may take this share of learner time
    # The model audits recompute log-probs in (docs/memory.md). policy: on a single-process
    # learner on the CPU, the trainer's own model between steps (its weights saved to a spill
    # file and restored bit for bit); elsewhere, and with copy, a float32 copy of the policy
    # (4 bytes a parameter more).
    audit_model: Literal["policy", "copy"] = "policy"
    audit_queue: int = Field(256, gt=0)  # groups waiting for audit; past it the oldest
                                          # non-probation job is dropped (counted)
    # Mean per-token |claimed - recomputed| log-prob of one sample above this fails the audit.
    # Honest backends differ by ~0.01 mean (bf16, vLLM): 0.5 nats is far outside that.
    audit_logprob_tol: float = Field(0.5, gt=0)
    # Sampling test (Azuma-Hoeffding on clipped log p + entropy): false-alarm bound per audit,
    # and the clip. Honest samples fail with probability <= audit_alpha whatever the model.
    audit_alpha: float = Field(1e-6, gt=0, lt=1)
    audit_clip: float = Field(4.0, gt=0)  # the clip of the sampling test
    strikes: int = Field(2, gt=0)  # failed checks before a worker is quarantined
    # Hand-backs are work products (docs/preemption.md, "Hand-backs are checked"). Before a
    # worker continues them, the prefix tokens a worker handed back are recomputed as an audit
    # would (a failure is a strike against their author): every group of a key's first
    # handback_probation, then handback_audit_rate of them (OS randomness). The group waits off
    # the queue for its check at most handback_hold_s, then goes out without the new prefixes.
    handback_audit_rate: float = Field(0.25, ge=0, le=1)
    handback_probation: int = Field(4, ge=0)  # groups of a key checked before sampling starts
    handback_hold_s: float = Field(60.0, gt=0)  # a held group waits at most this for its check
    # Per worker, groups handed back may exceed handback_share of the groups it was granted by
    # at most handback_allowance (about one preemption's grant), at handback_groups_per_min
    # (burst: the allowance). Past either bound the groups are taken back without their
    # prefixes (counted) and the worker gets one group per request while it stays past it.
    handback_share: float = Field(0.5, ge=0, le=1)
    handback_allowance: int = Field(16, ge=1)  # groups handed back beyond the share (and the burst)
    handback_groups_per_min: float = Field(16.0, gt=0)  # groups one worker may hand back a minute
    # Cherry-picking: the mean reward percentile of the groups a worker handed back (once
    # completed by others) is tested against 1/2 from handback_bias_min groups on, at checkpoints
    # 25 % apart (Hoeffding, union bound over its life: an honest worker is flagged with
    # probability at most handback_bias_alpha; learner/handbacks.py). A flagged worker's prefixes are no longer kept; no strike.
    handback_bias_alpha: float = Field(1e-3, gt=0, lt=1)
    handback_bias_min: int = Field(32, ge=2)  # returned groups completed before the test may flag


class QuickstartConfig(_Section):
    workers: int = Field(4, gt=0)  # worker processes echo-rl quickstart starts
    # Their prices, $/h, cycled over the workers.
    worker_prices: list[float] = Field(default_factory=lambda: [0.35])


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
    def _preset_generation(self) -> "EchoConfig":
        """The chosen task's generation settings, unless [worker] (or --set) gives its own."""
        for key, value in self.adapter.generation.items():
            if key not in self.worker.model_fields_set:
                setattr(self.worker, key, value)  # validated as [worker] would be
        return self

    @model_validator(mode="after")
    def _buffer_holds_a_step(self) -> "EchoConfig":
        if self.buffer.capacity_groups < self.learner.prompts_per_step:
            raise ValueError(
                f"buffer.capacity_groups={self.buffer.capacity_groups} is smaller than "
                f"learner.prompts_per_step={self.learner.prompts_per_step}: the learner could "
                f"never assemble a batch; raise buffer.capacity_groups"
            )
        return self

    @model_validator(mode="after")
    def _lora_has_a_backend(self) -> "EchoConfig":
        if self.learner.lora.enabled and self.worker.backend != "transformers":
            raise ValueError(
                f"learner.lora.enabled with worker.backend={self.worker.backend!r}: only the "
                f"transformers backend applies LoRA adapters so far; set worker.backend = "
                f"\"transformers\", or learner.lora.enabled = false")
        return self

    @model_validator(mode="after")
    def _public_needs_security(self) -> "EchoConfig":
        host = self.learner.host
        if not is_loopback(host) and not self.security.curve and not self.security.insecure:
            raise ValueError(
                f"learner.host={host!r} is not loopback and security.curve is off: strangers "
                f"could impersonate any worker; turn security.curve on, or pass --insecure "
                f"(security.insecure=true) if this network is private")
        return self

    def listen_ports(self) -> ListenPorts:
        """The learner's ports (docs/ports.md): learner.port and the layout after it, each
        key that is set taking precedence over the layout."""
        lc, base = self.learner, self.learner.base_port

        def after(offset: int) -> int:
            return base + offset if base else 0

        refl = lc.reflector_ports or [after(2), after(3)]
        metrics = self.metrics.port if self.metrics.port is not None else after(LAYOUT_SPAN)
        return ListenPorts(base, after(1) if lc.chunk_port is None else lc.chunk_port,
                           (refl[0], refl[1]), metrics)

    @model_validator(mode="after")
    def _ports_distinct(self) -> "EchoConfig":
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
                    f"a port of its own; change one (docs/ports.md gives the layout)")
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
            "security": {"max_parked_per_peer": self.security.max_parked_per_peer,
                         "peer_chunk_requests_per_s": self.security.peer_chunk_requests_per_s,
                         "max_parked_total": self.security.max_parked_total},
            "group_size": self.learner.group_size,
            # how versions are applied: a LoRA run's versions are adapters on the base model
            "lora": self.learner.lora.model_dump(),
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
        if not isinstance(v, dict) and v is not None:
            out.append(f"{k} = {fmt(v)}")
    for k, v in data.items():
        if isinstance(v, dict):
            out.append(f"\n[{k}]")  # TOML has no null: an unset key is left out
            out.extend(f"{kk} = {fmt(vv)}" for kk, vv in v.items() if vv is not None)
    return "\n".join(out) + "\n"
