"""The ``[learner]`` section of the config (``LearnerConfig``, with ``[learner.lora]``) and the
ports the learner listens on, derived from it (``ListenPorts``).

``StalenessRules`` holds what the learner and the simulator (``echo_rl/provisioning/sim/scenario.py``)
derive from the same fields. ``echo_rl.core.config`` re-exports every name here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import Field, field_validator, model_validator

from echo_rl.core.addresses import is_loopback, public_host_problem
from echo_rl.core.config_sections import _Section, check_device


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


class HeldoutConfig(_Section):
    """The run watching its own policy (docs/learner.md, "Watching the policy"): every
    ``every`` steps a process beside the learner scores the newest checkpoint on the adapter's
    held-out split, as ``echo-rl eval --split heldout`` does, and the step rows, the console and
    the dashboard show the score with its 95 % interval; the best-scoring checkpoint is kept as
    checkpoints/best.pt (``echo-rl eval --checkpoint best``, ``echo-rl export --checkpoint
    best``). Needs an adapter with a held-out split and learner.checkpoint."""

    # Steps between evaluations: the first checkpoint at or after each multiple (kappa > 1
    # checkpoints every kappa steps), step 0's (the untrained policy) and the last one's. 0: off.
    every: int = Field(0, ge=0)
    prompts: int = Field(30, ge=2)  # held-out prompts scored (a finite split: at most this many)
    samples: int = Field(4, gt=0)  # completions per prompt; a prompt's score is their mean
    seed: int = 0  # prompts and sampling seeds: the same at every evaluation, so scores pair
    threads: int = Field(1, gt=0)  # torch threads of the evaluator process
    # Seconds the end of a run waits for the evaluation of its last checkpoint.
    final_wait_s: float = Field(900.0, ge=0)


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
    # The LM head and the sampled tokens' log-probs a chunk of positions at a time
    # (echo_rl/learner/head.py) for the model families it knows: the [tokens, vocabulary]
    # logits are never kept, at one more head matmul in the backward (docs/learner.md, "The LM
    # head": on this CPU a step as fast or faster, its memory lower). false: the model's own
    # forward makes the logits.
    fused_head: bool = True
    # Each decoder layer through torch.compile (echo_rl/core/models.py compile_layers): on a GPU
    # a narrow model's step is launch-bound and inductor fuses a layer's small kernels; the first
    # steps of each sequence length pay the compilation (seconds to a minute). make gpu-check's
    # learner stage measures it beside eager (docs/gpu.md).
    compile: bool = False
    # Host memory the learner may use, in GiB (2^30 bytes; 0: no budget). At start-up the learner says what the
    # run needs (echo_rl/core/memplan.py) and, over budget, turns gradient checkpointing on and then
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
    # Hardware-affinity routing (docs/scheduling.md, echo_rl/control/affinity.py): a grant takes, from
    # a window of the next affinity_window prompts, the one whose expected completion length
    # ranks where the asking worker's measured tokens/s ranks (long tasks to fast workers);
    # one passed over 2 x affinity_window grants goes next. Off: the adapter's order.
    affinity: bool = False
    affinity_window: int = Field(64, ge=2, le=4096)
    # A granted group not delivered this long is granted again.
    lease_timeout_s: float = Field(30.0, gt=0)
    wait_timeout_s: float = Field(120.0, gt=0)  # give up when no admissible data this long
    price_per_hour: float = Field(0.0, ge=0)  # the learner's own price, $/h, in the cost per step
    checkpoint: bool = True  # checkpoint before every publication (needed for --resume)
    # Checkpoint and publish each version on threads of their own, overlapped with the next
    # step (echo_rl/learner/releasing.py; the publication's encode, hashes and signature on the
    # publisher thread): the training thread waits only for the version's host copy, and for a
    # release longer than a step. Costs one host copy of the model and optimizer state. auto: on
    # when the policy trains on a GPU (the host's cores idle during a step), off on the CPU
    # (benchmarks/bench_publish.py, docs/learner.md: a thread beside a step that uses every core
    # slows it more than the work it takes off). off: all of it on the training thread, before
    # the next step.
    release_thread: Literal["auto", "on", "off"] = "auto"
    # Published versions (the delta encoder's base, the versions audits and workers may still
    # need) live in files under <run dir>/spill, read through memory maps, instead of in RAM
    # (docs/memory.md). Off: each is held as bytes.
    spill_payloads: bool = True
    fsync: bool = True  # fsync the buffer log before acknowledging (off only for benchmarks)
    # Admission bounds (echo_rl/data/records.py): a record whose |reward| exceeds this is rejected
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
    heldout: HeldoutConfig = Field(default_factory=HeldoutConfig)  # [learner.heldout]
    # A policy collapsing (docs/learner.md, "Watching the policy": the held-out score fallen
    # below its best, or the entropy fallen to a fifth of its start while most groups score
    # alike): warn names it and the settings that counter it, stop also ends the run there
    # (checkpoints/best.pt keeps the policy before the fall).
    collapse: Literal["warn", "stop", "off"] = "warn"
    # DAPO's dynamic sampling: a group whose samples all scored alike (no advantage, no
    # gradient but the KL's) is not trained; the step takes more groups in its place, at most
    # 3 x prompts_per_step in all. Off: such groups fill the batch as they come.
    dynamic_sampling: bool = False

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
    def _heldout_has_checkpoints(self) -> LearnerConfig:
        if self.heldout.every and not self.checkpoint:
            raise ValueError(
                f"learner.heldout.every={self.heldout.every} scores checkpoints, and "
                f"learner.checkpoint is false; set learner.checkpoint = true or "
                f"learner.heldout.every = 0"
            )
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
