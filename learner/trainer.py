"""One learner step: log-probs at step start, then ``updates_per_step`` mini-batch updates."""

from __future__ import annotations

import copy
from typing import Any

import torch

from dataplane.adapter import LearnerBatch
from echo.config import LearnerConfig
from learner.loss import LossConfig, grpo_loss
from learner.parallel import Parallel, Single


def token_logprobs(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """log p(token_{j+1} | tokens_{<=j}) for every position j: shape [B, L-1]."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]
    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)


class Trainer:
    def __init__(self, model: Any, cfg: LearnerConfig, seed: int = 0,
                 parallel: Parallel | None = None):
        self.model = model
        self.par = parallel or Single()
        self.cfg = cfg
        self.loss_cfg = LossConfig(epsilon=cfg.epsilon, is_cap=cfg.is_cap, beta=cfg.beta,
                                   agg=cfg.loss_agg)
        self.optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr)
        # The reference model costs a full copy; it exists only when the KL term is on.
        self.ref_model = copy.deepcopy(model).eval().requires_grad_(False) if cfg.beta > 0 else None
        self.generator = torch.Generator().manual_seed(seed)

    def step(self, batch: LearnerBatch) -> dict[str, float]:
        """Every rank calls this with the whole batch and trains on its shard of each
        mini-batch; losses are scaled so the rank-averaged gradient is the global one."""
        self.model.train()
        order = torch.randperm(batch.input_ids.shape[0], generator=self.generator)
        minibatches = order.chunk(self.cfg.updates_per_step)
        shards = [self.par.shard(mb) for mb in minibatches]
        with torch.no_grad():  # logp_old: parameters at step start, before any update
            olds = [token_logprobs(self.model, batch.input_ids[i], batch.attention_mask[i]) for i in shards]
            refs = ([token_logprobs(self.ref_model, batch.input_ids[i], batch.attention_mask[i]) for i in shards]
                    if self.ref_model is not None else [None] * len(shards))
        sums: dict[str, float] = {}
        for mb, idx, old, ref in zip(minibatches, shards, olds, refs):
            global_count = (float(batch.loss_mask[mb].sum().clamp(min=1))
                            if self.loss_cfg.agg == "token-mean" else float(len(mb)))
            logp = token_logprobs(self.model, batch.input_ids[idx], batch.attention_mask[idx])
            loss, stats = grpo_loss(logp, old, batch.behaviour_logprobs[idx],
                                    batch.advantages[idx], batch.loss_mask[idx], self.loss_cfg,
                                    ref, denom=global_count / self.par.world)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            stats["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0))
            self.optimizer.step()
            stats["loss"] = loss.item()
            for k, v in stats.items():
                sums[k] = sums.get(k, 0.0) + v / self.cfg.updates_per_step
        return sums
