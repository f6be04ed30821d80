"""Batched sampling with Hugging Face ``generate`` on the installed snapshot.

All samples of all requested groups go through one ``generate`` call (left-padded prompts).
Behaviour log-probs come from the *processed* scores, i.e. the distribution the sampler really
drew from (temperature applied; top-k and top-p off), so the learner's importance weights are
exact.

The model runs on ``worker.device``: bf16 on a GPU that supports it, float32 on the CPU (the
snapshot's dtype is converted at install). Prompts go to the device, samples come back as lists.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any, Protocol

import torch
from transformers import LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

from echo_rl.core import wire
from echo_rl.core.config import LoraConfig, ModelConfig
from echo_rl.core.layout import TensorLayout
from echo_rl.core.lora import adapter_parameters, load_policy_model
from echo_rl.core.models import (
    bf16_compute,
    install_payload,
    load_tokenizer,
    resolve_device,
    vocab_size,
)
from echo_rl.data.answers import answer_processor
from echo_rl.worker.backends.base import Backend, Row, Sample, finish, sample_groups
from echo_rl.worker.backends.parking import HostParking
from echo_rl.worker.backends.shared_base import SHARED
from echo_rl.worker.backends.turn_cache import TurnCache

if TYPE_CHECKING:
    from transformers import Cache


class Generated(Protocol):
    """What ``generate`` returns as it is called here (``return_dict_in_generate``,
    ``output_scores``): the sequences, one score tensor per new token, the cache."""

    sequences: torch.Tensor
    scores: tuple[torch.Tensor, ...]
    past_key_values: object


class _Watch(StoppingCriteria):
    """Called by ``generate`` after every token: counts the rows still sampling (the drill's
    live token count) and ends the call at once when ``stop`` is set (preemption), or when
    ``tail`` of the fresh rows have ended (the long-tail cut, docs/scheduling.md). Rows of a
    continued group (``fresh`` False) are never cut: the call runs on until they end."""

    def __init__(
        self,
        backend: Backend,
        stop: threading.Event | None,
        eos: int | None,
        fresh: list[bool],
        tail: float = 0.0,
        budgets: list[int] | None = None,
    ):
        self.backend, self.stop, self.eos, self.tail = backend, stop, eos, tail
        self.fresh = torch.tensor(fresh, dtype=torch.bool)
        # Rows whose task has a smaller budget than the call's longest (wire.Group
        # .max_new_tokens) end at it instead of sampling tokens that would be cut.
        self.budgets = torch.tensor(budgets) if budgets and min(budgets) < max(budgets) else None
        self.steps = 0
        self.done: torch.Tensor | None = None
        self.stopped = False

    # Returns what StoppingCriteria declares (a BoolTensor), built by torch as a Tensor.
    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: object) -> Any:
        last = input_ids[:, -1] == self.eos if self.eos is not None else input_ids[:, -1] < 0
        before = torch.zeros_like(last) if self.done is None else self.done
        self.backend.tokens_sampled += int((~before).sum())  # rows that sampled this token
        self.steps += 1
        if self.budgets is not None:
            self.budgets = self.budgets.to(last.device)
            last = last | (self.budgets <= self.steps)
        self.done = done = before | last
        if (self.stop is not None and self.stop.is_set()) or self._tail_ended():
            self.stopped = True
            return torch.ones_like(last)
        return done.clone() if self.budgets is not None else torch.zeros_like(last)

    def _tail_ended(self) -> bool:
        if not self.tail or self.done is None:
            return False
        done = self.done
        fresh = self.fresh = self.fresh.to(done.device)  # once: then it stays there
        running = ~done
        if not running.any() or (running & ~fresh).any():
            return False
        return int((done & fresh).sum()) >= self.tail * int(fresh.sum())


class TransformersBackend(Backend):
    """``lora`` (a LoRA run, echo_rl/core/lora.py): the base model is loaded once and hashed, and each
    version's adapter is copied into a peft adapter on it (unmerged)."""

    def __init__(
        self,
        model_cfg: ModelConfig,
        threads: int = 1,
        device: str = "cpu",
        lora: LoraConfig | None = None,
        dtype: str = "auto",
    ):
        torch.set_num_threads(threads)
        self.device = resolve_device(device, "worker.device")
        if dtype == "auto":  # worker.dtype: bf16 where the device computes in it
            dtype = "bfloat16" if bf16_compute(self.device) else "float32"
        self.tokenizer = load_tokenizer(model_cfg)
        model, self.base_hash = load_policy_model(model_cfg, lora, self.tokenizer, dtype)
        self.model = model.to(self.device).eval()
        self._held: tuple[bool, HostParking] | None = None  # (adapter only, its parking)
        self.vocab_size = vocab_size(self.model)
        # LoRA runs of one process on the same base hold it once (echo_rl/worker/backends/shared_base.py)
        self.shared_bytes = SHARED.attach(self.model, self.base_hash) if self.base_hash else 0
        if self.shared_bytes:
            logging.getLogger("echo.worker").info(
                "LoRA base model shared with another run of this process: %.1f MiB held once",
                self.shared_bytes / 2**20,
            )

    def park(self) -> None:
        if self.device.type != "cpu":  # on the CPU the device is host memory: nothing moves
            self._parking().park()

    def unpark(self) -> None:
        if self.device.type != "cpu":
            self._parking().unpark()

    def _parking(self) -> HostParking:
        """The whole model, or only the adapter when its base is shared with another run of
        this process (the shared base stays where the runs generate). Chosen again while on
        the device, since a run joined later may come to share this run's base."""
        shared = SHARED.shared(self.base_hash)
        held = self._held
        if held is None or (held[0] != shared and not held[1].parked):
            if shared:
                held = (True, HostParking(self.device, adapter_parameters(self.model).values()))
            else:
                held = (False, HostParking.whole(self.model, self.device))
            self._held = held
        return held[1]

    def install(
        self, tensors: list[TensorLayout], payload: bytes | bytearray, version: int = -1
    ) -> None:
        install_payload(self.model, tensors, payload)

    @torch.no_grad()
    def generate(
        self,
        groups: list[wire.Group],
        max_new_tokens: int,
        temperature: float,
        stop: threading.Event | None = None,
        tail: float = 0.0,
    ) -> list[list[Sample]]:
        eos = self.tokenizer.eos_token_id

        def sample(
            todo: list[Row], fresh: list[bool]
        ) -> tuple[dict[int, tuple[list[int], list[float]]], bool]:
            watch = _Watch(self, stop, eos, fresh, tail, [r.budget for r in todo])
            ids, lps, stopped = self._sample(
                [r.prompt for r in todo],
                max(r.budget for r in todo),
                temperature,
                groups[0].seed,
                watch,
            )
            return {id(r): (ids[k], lps[k]) for k, r in enumerate(todo)}, stopped

        return sample_groups(groups, max_new_tokens, eos, sample)

    def _sample(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        temperature: float,
        seed: int,
        watch: _Watch,
    ) -> tuple[list[list[int]], list[list[float]], bool]:
        """One left-padded ``generate`` call: (new tokens, their log-probs) per prompt, and
        whether ``watch`` cut it short."""
        width = max(len(p) for p in prompts)
        pad = self.tokenizer.pad_token_id
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=self.device)
        attn = torch.tensor(
            [[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device
        )
        out = self._run(ids, attn, None, max_new_tokens, temperature, seed, watch)
        new = out.sequences[:, width:]
        scores = torch.stack(out.scores, dim=1).float()  # [B, T, V] after temperature
        logp = torch.log_softmax(scores, dim=-1).gather(-1, new.unsqueeze(-1)).squeeze(-1)
        return new.tolist(), logp.tolist(), watch.stopped  # one device->host copy each

    def new_turn_cache(self) -> TurnCache:
        """A multi-turn rollout's context cache (worker.turn_cache), empty."""
        return TurnCache(self.tokenizer.pad_token_id)

    def generate_turn(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        temperature: float,
        seed: int,
        turns: TurnCache,
        stop: threading.Event | None = None,
    ) -> tuple[list[tuple[list[int], list[float]]], bool]:
        """One decision of each of a multi-turn rollout's episodes, reading only what is new
        to each since the previous call (echo_rl/worker/backends/turn_cache.py): (ids and log-probs
        per prompt, cut short by ``stop``)."""
        eos = self.tokenizer.eos_token_id
        plan = turns.plan(prompts, self.device)
        watch = _Watch(self, stop, eos, [True] * len(prompts))
        out = self._run(plan.ids, plan.mask, plan.cache, max_new_tokens, temperature, seed, watch)
        width = plan.ids.shape[1]
        new = out.sequences[:, width:]
        scores = torch.stack(out.scores, dim=1).float()
        logp = torch.log_softmax(scores, dim=-1).gather(-1, new.unsqueeze(-1)).squeeze(-1)
        ids, lps = new.tolist(), logp.tolist()
        row = Row(0, 0, [], None, max_new_tokens)
        samples = [finish(row, i, lp, eos, watch.stopped) for i, lp in zip(ids, lps, strict=True)]
        turns.keep(
            prompts,
            plan,
            out.sequences,
            [len(s.completion_ids) for s in samples],
            out.past_key_values,
        )
        return [(s.completion_ids, s.logprobs) for s in samples], watch.stopped

    def _run(
        self,
        ids: torch.Tensor,
        attn: torch.Tensor,
        cache: Cache | None,
        max_new_tokens: int,
        temperature: float,
        seed: int,
        watch: _Watch,
    ) -> Generated:
        """One ``generate`` call over a laid-out batch (and the cache of its kept positions)."""
        torch.manual_seed(seed)
        out: Generated = self.model.generate(
            input_ids=ids,
            attention_mask=attn,
            **({"cache": cache} if cache is not None else {}),
            do_sample=True,
            temperature=temperature,
            top_k=0,
            top_p=1.0,
            max_new_tokens=max_new_tokens,
            return_dict_in_generate=True,
            output_scores=True,
            pad_token_id=self.tokenizer.pad_token_id,
            eos_token_id=self.tokenizer.eos_token_id,
            stopping_criteria=StoppingCriteriaList([watch]),
            logits_processor=LogitsProcessorList(answer_processor(self.answer_tokens)),
        )
        return out
