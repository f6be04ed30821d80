"""GRPO with truncated importance sampling (DESIGN 7).

Per completion token j of sample e, with loss mask m:

    r    = exp(logp_theta - logp_old)                 logp_old: learner params at step start
    w    = min(exp(logp_old - logp_behaviour), C)     truncated IS weight, no gradient
    surr = min(r*A, clip(r, 1-eps, 1+eps)*A)
    kl   = exp(logp_ref - logp_theta) - (logp_ref - logp_theta) - 1
    loss = -mean_tokens(m * (w*surr - beta*kl))

``agg="token-mean"`` averages over every masked token of the batch (DAPO style);
``agg="seq-mean"`` averages within each sequence, then over sequences.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LossConfig:
    epsilon: float = 0.2
    is_cap: float = 2.0
    beta: float = 0.0
    agg: str = "token-mean"


def grpo_loss(logp: torch.Tensor, old_logp: torch.Tensor, behaviour_logp: torch.Tensor,
              advantages: torch.Tensor, mask: torch.Tensor, cfg: LossConfig,
              ref_logp: torch.Tensor | None = None,
              denom: float | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Shapes: logp, old_logp, behaviour_logp, mask, ref_logp [B, T]; advantages [B].

    ``denom`` replaces the local count (tokens for token-mean, sequences for seq-mean) when
    this batch is one rank's shard of a larger one.
    """
    mask = mask.to(logp.dtype)
    ratio = torch.exp(logp - old_logp)
    w = torch.clamp(torch.exp(old_logp - behaviour_logp), max=cfg.is_cap).detach()
    adv = advantages.unsqueeze(-1)
    clipped = torch.clamp(ratio, 1 - cfg.epsilon, 1 + cfg.epsilon)
    surr = torch.minimum(ratio * adv, clipped * adv)
    per_token = w * surr
    kl = torch.zeros_like(logp)
    if cfg.beta > 0:
        if ref_logp is None:
            raise ValueError("beta > 0 needs reference log-probs")
        delta = ref_logp - logp
        kl = torch.exp(delta) - delta - 1
        per_token = per_token - cfg.beta * kl
    if cfg.agg == "token-mean":
        loss = -(per_token * mask).sum() / (denom or mask.sum().clamp(min=1))
    elif cfg.agg == "seq-mean":
        loss = -((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)).sum() / (denom or mask.shape[0])
    else:
        raise ValueError(f"unknown loss aggregation {cfg.agg!r}: use token-mean or seq-mean")
    with torch.no_grad():
        n = mask.sum().clamp(min=1)
        is_clipped = ((ratio < 1 - cfg.epsilon) & (adv < 0)) | ((ratio > 1 + cfg.epsilon) & (adv > 0))
        stats = {
            "clip_frac": float((is_clipped.to(mask.dtype) * mask).sum() / n),
            "is_weight_mean": float((w * mask).sum() / n),
            "kl_mean": float((kl * mask).sum() / n),
        }
    return loss, stats
