"""The policy being trained, on every rank: model, trainer and the parallelism strategy.

Rank 0 drives: each ``command`` is broadcast to the other ranks (which sit in ``follow``)
and then executed everywhere, so collectives (sharded forward/backward, gathering the full
state for a checkpoint or a snapshot) line up. In a single process the broadcast is a no-op.

Commands (``Command``, one declared type each): ``Step(batch, sync)`` trains (with ``sync``
also gathers the full state: True in host memory, "live" as ``Parallel.live_state`` gives it),
``Sync()`` gathers it alone, ``Load(state)`` restores a checkpoint, ``Stop()`` releases the
other ranks.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

from echo_rl.core.config import EchoConfig
from echo_rl.core.lora import base_of
from echo_rl.core.memplan import LearnerPlan, ModelShape, fit_learner
from echo_rl.core.models import (
    compile_layers,
    enable_checkpointing,
    load_model,
    load_tokenizer,
    vocab_size,
)
from echo_rl.data.adapter import LearnerBatch, load_adapter
from echo_rl.data.answers import check_answer_tokens
from echo_rl.learner.parallel import make_parallel
from echo_rl.learner.parallel.base import FullState, ModelState
from echo_rl.learner.trainer import Sampling, Trainer

if TYPE_CHECKING:
    from echo_rl.learner.checkpoint import CheckpointState, RngState


@dataclass(frozen=True)
class Step:
    """One GRPO step on ``batch``; ``sync``: also gather the full state (True: in host memory,
    "live": as ``Parallel.live_state`` gives it, for a caller that copies it before the next
    step)."""

    batch: LearnerBatch
    sync: bool | Literal["live"] = False


@dataclass(frozen=True)
class Sync:
    """Gather the full state (a checkpoint's or a snapshot's) without training."""


@dataclass(frozen=True)
class Load:
    """Restore a checkpoint: ``state`` holds "model", "optimizer" and the three RNG states
    (``Policy.rng_state``)."""

    state: CheckpointState


@dataclass(frozen=True)
class Stop:
    """Release the other ranks from ``follow``."""


Command = Step | Sync | Load | Stop


class Policy:
    def __init__(self, cfg: EchoConfig):
        torch.set_num_threads(cfg.learner.torch_threads)
        random.seed(cfg.seed)
        self.par = make_parallel(cfg.learner.device)
        self.tokenizer = load_tokenizer(cfg.model)
        loaded = load_model(cfg.model, self.tokenizer, "float32")
        self.vocab_size = vocab_size(loaded)
        self.lora = cfg.learner.lora.enabled
        self.base_hash: str | None = (
            None  # LoRA: the base model's content hash (echo_rl/core/lora.py)
        )
        self.lora_note = ""  # LoRA: what is trained, in a line
        model = self._wrap_lora(loaded, cfg) if self.lora else loaded
        # What the run needs in host memory, fitted to learner.host_memory_gb (docs/memory.md);
        # run_learner says it once logging is set up.
        asked = plan_memory(cfg, model, self.par.world)
        self.memory_plan = fit_learner(asked, cfg.learner.host_memory_gb)
        self.memory_refit = self.memory_plan != asked  # the budget changed the settings
        learner_cfg = (
            cfg.learner
            if not self.memory_refit
            else cfg.learner.model_copy(
                update={
                    "micro_batch_rows": self.memory_plan.rows,
                    "gradient_checkpointing": self.memory_plan.checkpointing,
                }
            )
        )
        if learner_cfg.gradient_checkpointing:  # activations recomputed in backward;
            # non-reentrant, so frozen inputs (LoRA) still get their gradients
            # With LoRA, ``loaded`` is the base peft wrapped in place (``get_base_model()``).
            enable_checkpointing(loaded)
        if learner_cfg.compile:  # before sharding, as torchtitan orders them
            compile_layers(loaded)
        # Names of the parameters a snapshot carries (tied weights once), as before sharding:
        # every parameter, or with LoRA the adapter's only.
        self.param_names = [n for n, p in model.named_parameters() if p.requires_grad]
        # Every rank builds the adapter for its answer set: the log-probs of a restricted
        # adapter are renormalised over it (echo_rl/data/answers.py), on every rank alike.
        self.adapter = load_adapter(cfg.adapter.name, cfg.adapter.effective_options, self.tokenizer)
        self.answer_tokens = check_answer_tokens(
            self.adapter.answer_tokens,
            self.vocab_size,
            cfg.worker.max_new_tokens,
            self.tokenizer.eos_token_id,
        )
        self.model = self.par.wrap(model)  # on learner.device: the Trainer's optimizer and
        # reference copy are made from it, so they live there too.
        # Log-probs at the workers' sampling temperature: the distribution they sampled from.
        self.trainer = Trainer(
            self.model,
            learner_cfg,
            seed=cfg.seed,
            parallel=self.par,
            sampling=Sampling(
                temperature=cfg.worker.temperature,
                max_new_tokens=cfg.worker.max_new_tokens,
                eos_token_id=self.tokenizer.eos_token_id,
                answer_tokens=self.answer_tokens,
            ),
            screen_nats=cfg.security.screen_nats if cfg.security.audit else 0.0,
        )

    def _wrap_lora(self, model: torch.nn.Module, cfg: EchoConfig) -> torch.nn.Module:
        from echo_rl.core.lora import base_hash, wrap

        self.base_hash = base_hash(model)  # of the base as loaded, before peft renames it
        # The adapter's initialisation (A random, B zero): the same on every rank, before sharding.
        torch.manual_seed(cfg.seed)
        lc = cfg.learner.lora
        model = wrap(model, lc)
        trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
        total = sum(p.numel() for p in model.parameters())
        self.lora_note = (
            f"LoRA rank {lc.rank} on {lc.target_modules}: {trained} of {total} "
            f"parameters trained ({100 * trained / total:.2f}%); base model "
            f"{self.base_hash[:16]}"
        )  # for the learner's log (set up later)
        return model

    def command(self, cmd: Command) -> tuple[dict[str, float], FullState | None]:
        return self._execute(self.par.broadcast(cmd))

    def follow(self) -> None:
        """Non-main ranks: execute rank 0's commands until it says stop."""
        nothing: Command | None = None  # what a follower sends: rank 0's command replaces it
        while True:
            cmd = self.par.broadcast(nothing)
            if isinstance(cmd, Stop):
                return
            self._execute(cmd)

    def _execute(self, cmd: Command | None) -> tuple[dict[str, float], FullState | None]:
        match cmd:
            case Step(batch=batch, sync=sync):
                stats = self.trainer.step(self.par.to_device(batch))
                return stats, self._full_state(live=sync == "live") if sync else None
            case Sync():
                return {}, self._full_state()
            case Load(state=state):
                self._load(state)
                return {}, None
            case Stop():
                return {}, None
        raise TypeError(f"not a policy command: {cmd!r}")  # a rank sent something else

    def _full_state(self, live: bool = False) -> FullState:
        """Model and optimizer state for checkpoints and snapshots: with LoRA the adapter's
        tensors only (the frozen base is the model folder's, never copied). ``live``: as
        ``Parallel.live_state`` gives it, for a caller that copies it before the next step."""
        state = self.par.live_state if live else self.par.full_state
        model_sd, optim_sd = state(self.model, self.trainer.optimizer)
        if self.lora:  # (ranks > 0 get an empty state under FSDP2: only rank 0 gathers)
            model_sd = {n: model_sd[n] for n in self.param_names if n in model_sd}
        return model_sd, optim_sd

    def _load(self, state: CheckpointState) -> None:
        if self.lora:
            self._check_adapter(state["model"])
        # LoRA: the checkpoint holds the adapter; the frozen base stays as loaded
        self.par.load_state(
            self.model,
            self.trainer.optimizer,
            state["model"],
            state["optimizer"],
            strict=not self.lora,
        )
        self.trainer.generator.set_state(state["trainer_rng"])
        torch.set_rng_state(state["torch_rng"])
        random.setstate(state["python_rng"])

    def _check_adapter(self, adapter_sd: ModelState) -> None:
        """A checkpoint of this adapter: exactly its tensors (a non-strict load would skip
        the others silently)."""
        if set(adapter_sd) != set(self.param_names):
            raise ValueError(
                f"the checkpoint holds {len(adapter_sd)} tensors, this learner trains "
                f"{len(self.param_names)} (learner.lora.enabled = {self.lora}): resume "
                f"with the [learner.lora] settings the run was started with"
            )

    def rng_state(self) -> RngState:
        return {
            "trainer_rng": self.trainer.generator.get_state(),
            "torch_rng": torch.get_rng_state(),
            "python_rng": random.getstate(),
        }

    def named_tensors(self, model_sd: ModelState) -> list[tuple[str, torch.Tensor]]:
        return [(n, model_sd[n]) for n in self.param_names]

    def close(self) -> None:
        if self.par.world > 1 and self.par.is_main:
            self.par.broadcast(Stop())
        self.par.close()


PROMPT_TOKENS_ASSUMED = 256  # the plan's prompt length: the adapter's prompts vary


def plan_memory(cfg: EchoConfig, model: torch.nn.Module, world: int) -> LearnerPlan:
    """This run's host memory plan (echo_rl/core/memplan.py) with the settings as configured."""
    lc = cfg.learner
    inner = base_of(model)
    shape = ModelShape(
        params=sum(p.numel() for p in model.parameters()),
        trained=sum(p.numel() for p in model.parameters() if p.requires_grad),
        layers=int(getattr(inner.config, "num_hidden_layers", 1)),
        hidden=int(getattr(inner.config, "hidden_size", 1)),
    )
    per_rank = math.ceil(lc.prompts_per_step * lc.group_size / lc.updates_per_step / world)
    rows = min(lc.micro_batch_rows or per_rank, per_rank)
    elem = 4 if cfg.broadcast.dtype == "float32" else 2
    extra = int(lc.beta > 0 and not lc.lora.enabled)  # the KL term's reference copy
    return LearnerPlan(
        shape,
        payload=shape.trained * elem,
        rows=rows,
        minibatch_rows=per_rank,
        seq_tokens=PROMPT_TOKENS_ASSUMED + cfg.worker.max_new_tokens,
        checkpointing=lc.gradient_checkpointing,
        extra_models=extra,
        versions_in_ram=0 if lc.spill_payloads else lc.staleness + 2,
    )
