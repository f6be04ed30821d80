"""The config's plain sections and what every section shares (``ConfigError``, ``_Section``,
the device spec). ``echo_rl.core.config`` assembles them into ``EchoConfig``; import them from there.

Each field's comments are its documentation: ``echo_rl.core.config_doc`` reads them into docs/config.md.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from echo_rl.core.errors import EchoError


class ConfigError(EchoError, ValueError):
    """A configuration problem, phrased for the user: key, value, fix."""

    default_reason = "config"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


DEVICE_SPEC = re.compile(r"auto|cpu|cuda(:\d+)?")


def check_device(value: str) -> str:
    """``auto``, ``cpu``, ``cuda`` or ``cuda:N``; resolved to a torch device by
    ``echo_rl.core.models.resolve_device`` in the process that uses it."""
    if not DEVICE_SPEC.fullmatch(value):
        raise ValueError(
            f"unknown device {value!r}: use auto (a GPU if there is one, else the "
            f"CPU), cpu, cuda or cuda:N"
        )
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
    def effective_options(self) -> dict[str, object]:
        preset = {k: v for k, v in self.presets.get(self.name, {}).items() if k != "generation"}
        return {**preset, **self.options}

    @property
    def generation(self) -> dict[str, object]:
        """The chosen adapter's generation settings from its preset (may be empty)."""
        gen = self.presets.get(self.name, {}).get("generation", {})
        if not isinstance(gen, dict):
            raise ValueError(
                f"adapter.presets.{self.name}.generation must be a table "
                f"(max_new_tokens, temperature), got {gen!r}"
            )
        unknown = sorted(set(gen) - set(GENERATION_KEYS))
        if unknown:
            raise ValueError(
                f"adapter.presets.{self.name}.generation.{unknown[0]} is not a "
                f"generation setting: use {', '.join(GENERATION_KEYS)}"
            )
        return gen


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
    # Long-tail cut (docs/scheduling.md): 0 = off. At x in (0, 1), once x of a rollout's fresh
    # samples have ended, the rest are cut: the groups that ended are delivered, the others are
    # carried into the worker's next rollout (beside new groups) and finished there, uncut.
    tail_cut: float = Field(0.0, ge=0, lt=1)
    # Multi-turn rollouts (docs/scheduling.md, "Cache-affine turns"): keep each episode's
    # key/value cache from one decision to the next and read only what is new (the
    # environment's reply), instead of prefilling the whole transcript every decision. Same
    # samples and log-probs; transformers backend (vLLM has its own prefix cache).
    turn_cache: bool = False
    # Batches a worker holds unacknowledged before it stops generating.
    max_unacked_batches: int = Field(8, gt=0)
    # engine (default; CPU or GPU: Echo's own generation loop over a transformers model,
    # docs/worker.md "The generation engine"), transformers (Hugging Face generate, the engine's
    # fallback and reference), or vllm (CUDA only; pip install -e '.[vllm]' with the CUDA build
    # of torch, docs/worker.md). vllm_gpu_memory is the share of GPU memory vLLM takes.
    backend: Literal["engine", "transformers", "vllm"] = "engine"
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


class MetricsConfig(_Section):
    """The learner's /metrics (Prometheus), /health and live dashboard."""

    enabled: bool = True  # serve /metrics, /health, /api/state and the dashboard
    # Read-only pages, no authentication: keep it local or on a private network. At most 32
    # connections are served at once; idle ones close after 10 s (echo_rl/core/metrics.py).
    host: str = "127.0.0.1"
    # Unset: learner.port + 4 (docs/ports.md; 0 when learner.port is 0). 0: the OS picks.
    # The address is in learner.json.
    port: int | None = Field(None, ge=0, le=65535)


class QuickstartConfig(_Section):
    workers: int = Field(4, gt=0)  # worker processes echo-rl quickstart starts
    # Their prices, $/h, cycled over the workers.
    worker_prices: list[float] = Field(default_factory=lambda: [0.35])
