"""Batched sampling with Hugging Face ``generate`` on the installed snapshot.

All samples of all requested groups go through one ``generate`` call (left-padded prompts).
Behaviour log-probs come from the *processed* scores, i.e. the distribution the sampler really
drew from (temperature applied; top-k and top-p off), so the learner's importance weights are
exact.

The model runs on ``worker.device``: bf16 on a GPU that supports it, float32 on the CPU (the
snapshot's dtype is converted at install). Prompts go to the device, samples come back as lists.
"""

from __future__ import annotations

from typing import Any

import torch

from echo import wire
from echo.config import ModelConfig
from echo.models import (bf16_compute, install_payload, load_model, load_tokenizer,
                         resolve_device, vocab_size)
from worker.backends.base import Backend, Sample


class TransformersBackend(Backend):
    def __init__(self, model_cfg: ModelConfig, threads: int = 1, device: str = "cpu"):
        torch.set_num_threads(threads)
        self.device = resolve_device(device, "worker.device")
        dtype = "bfloat16" if bf16_compute(self.device) else "float32"
        self.tokenizer = load_tokenizer(model_cfg)
        self.model = load_model(model_cfg, self.tokenizer, dtype).to(self.device).eval()
        self.vocab_size = vocab_size(self.model)

    def install(self, tensors: list[dict[str, Any]], payload: bytes | bytearray,
                version: int = -1) -> None:
        install_payload(self.model, tensors, payload)

    @torch.no_grad()
    def generate(self, groups: list[wire.Group], max_new_tokens: int,
                 temperature: float) -> list[list[Sample]]:
        prompts = [g.prompt_ids for g in groups for _ in range(g.n)]
        width = max(len(p) for p in prompts)
        pad = self.tokenizer.pad_token_id
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=self.device)
        attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts],
                            device=self.device)
        torch.manual_seed(groups[0].seed)
        out = self.model.generate(
            input_ids=ids, attention_mask=attn, do_sample=True, temperature=temperature,
            top_k=0, top_p=1.0, max_new_tokens=max_new_tokens, return_dict_in_generate=True,
            output_scores=True, pad_token_id=pad, eos_token_id=self.tokenizer.eos_token_id)
        new = out.sequences[:, width:]
        scores = torch.stack(out.scores, dim=1).float()  # [B, T, V] after temperature
        logp = torch.log_softmax(scores, dim=-1).gather(-1, new.unsqueeze(-1)).squeeze(-1)
        new, logp = new.tolist(), logp.tolist()  # one device->host copy each
        samples = [self._cut(new[i], logp[i]) for i in range(len(prompts))]
        out_groups, k = [], 0
        for g in groups:
            out_groups.append(samples[k : k + g.n])
            k += g.n
        return out_groups

    def _cut(self, tokens: list[int], logps: list[float]) -> Sample:
        """Keep tokens up to and including the first end-of-sequence (the rest is padding)."""
        eos = self.tokenizer.eos_token_id
        end = tokens.index(eos) + 1 if eos in tokens else len(tokens)
        return Sample(tokens[:end], logps[:end])
