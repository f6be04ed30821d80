"""GRPO with importance-corrected off-policy data (docs/design.md §7), with TRL's GRPO options.

Per completion token j of sample e, with loss mask m (all log-probs at the sampling temperature):

    r    = exp(logp_theta - logp_old)                 logp_old: learner params at step start
    w    = min(exp(logp_old - logp_behaviour), C)     truncated IS weight, no gradient
    surr = min(r*A, clip(r, 1-eps, 1+eps_high)*A)
    kl   = exp(logp_ref - logp_theta) - (logp_ref - logp_theta) - 1   (times r: bias-corrected)
    loss = -agg(m * (w*surr - beta*kl))

``importance_sampling_level="sequence"`` (GSPO) replaces r by one ratio per sequence,
exp(mean_j m*(logp_theta - logp_old)). ``is_mode`` picks w: ``token_truncate`` as above;
``token_mask`` w = exp(.) where it is <= C, else 0; ``sequence_*`` the same on one weight per
sequence, exp(sum_j m*(logp_old - logp_behaviour)). Each mirrors TRL 1.16's option of the same
name (tests/test_oracle.py). ``none`` sets w = 1: no correction at all, stale samples trained as
if on-policy (what the staleness sweep compares against, benchmarks/staleness_sweep.py).

``agg``: ``token-mean`` averages over every masked token of the batch (TRL bnpo/dapo);
``seq-mean`` within each sequence, then over sequences (TRL grpo); ``seq-mean-token-sum-norm``
sums each sequence's tokens and divides by sequences * ``max_len`` (TRL dr_grpo, whose constant
is the maximum completion length).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from echo_rl.core.steprow import COL  # the statistics carry the step row's names

AGGREGATIONS = ("token-mean", "seq-mean", "seq-mean-token-sum-norm")
IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask", "none")


@dataclass(frozen=True)
class LossConfig:
    epsilon: float = 0.2
    is_cap: float = 2.0
    beta: float = 0.0
    agg: str = "token-mean"
    epsilon_high: float | None = None  # None: = epsilon
    is_mode: str = "token_truncate"
    level: str = "token"  # importance-sampling level of the ratio r: "token" or "sequence"
    kl_bias_correction: bool = False
    max_len: int = 0  # constant normaliser of seq-mean-token-sum-norm (max completion length)

    def __post_init__(self) -> None:
        if self.agg not in AGGREGATIONS:
            raise ValueError(f"unknown loss aggregation {self.agg!r}: use one of {AGGREGATIONS}")
        if self.is_mode not in IS_MODES:
            raise ValueError(
                f"unknown importance-sampling mode {self.is_mode!r}: use one of {IS_MODES}"
            )
        if self.level not in ("token", "sequence"):
            raise ValueError(
                f"unknown importance-sampling level {self.level!r}: use token or sequence"
            )
        if self.agg == "seq-mean-token-sum-norm" and self.max_len <= 0:
            raise ValueError(
                "seq-mean-token-sum-norm needs max_len > 0 (the maximum completion length)"
            )

    @property
    def eps_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    def count(self, mask: torch.Tensor) -> float:
        """The normaliser of ``agg`` for a batch with loss mask ``mask``: what ``denom`` replaces
        when the batch is one rank's shard of a larger one."""
        if self.agg == "token-mean":
            return float(mask.sum().clamp(min=1))
        rows = float(mask.shape[0])
        return rows * self.max_len if self.agg == "seq-mean-token-sum-norm" else rows


def behaviour_weight(
    old_logp: torch.Tensor, behaviour_logp: torch.Tensor, mask: torch.Tensor, cfg: LossConfig
) -> torch.Tensor:
    """w per token [B, T] (token_* modes) or per sequence [B, 1]; no gradient."""
    if cfg.is_mode == "none":  # no behaviour correction: stale samples count as on-policy
        return torch.ones_like(old_logp)
    diff = (old_logp - behaviour_logp).detach() * mask  # masked positions: exp(0), never inf
    if cfg.is_mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True)
    w = torch.exp(diff)
    if cfg.is_mode.endswith("truncate"):
        return torch.clamp(w, max=cfg.is_cap)
    return w.masked_fill(w > cfg.is_cap, 0.0)


def grpo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: LossConfig,
    ref_logp: torch.Tensor | None = None,
    denom: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Shapes: logp, old_logp, behaviour_logp, mask, ref_logp [B, T]; advantages [B].

    ``denom`` replaces the local count (``cfg.count(mask)``) when this batch is one rank's
    shard of a larger one.
    """
    mask = mask.to(logp.dtype)
    log_ratio = logp - old_logp
    if cfg.level == "sequence":  # GSPO: one length-normalised ratio per sequence, [B, 1]
        log_ratio = (log_ratio * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(
            min=1
        )
    ratio = torch.exp(log_ratio)
    w = behaviour_weight(old_logp, behaviour_logp, mask, cfg)
    adv = advantages.unsqueeze(-1)
    clipped = torch.clamp(ratio, 1 - cfg.epsilon, 1 + cfg.eps_high)
    surr = torch.minimum(ratio * adv, clipped * adv)
    per_token = w * surr
    kl = torch.zeros_like(logp)
    if cfg.beta > 0:
        if ref_logp is None:
            raise ValueError("beta > 0 needs reference log-probs")
        delta = ref_logp - logp
        kl = torch.exp(delta) - delta - 1
        if cfg.kl_bias_correction:  # DeepSeek-V3.2: the k3 estimate weighted by the ratio
            kl = kl * ratio
        per_token = per_token - cfg.beta * kl
    per_token = per_token.expand_as(mask) * mask
    if cfg.agg == "seq-mean":
        per_token = per_token / mask.sum(-1, keepdim=True).clamp(min=1)
    loss = -per_token.sum() / (denom or cfg.count(mask))
    return loss, _stats(ratio, w, kl, adv, mask, cfg)


@torch.no_grad()
def _stats(
    ratio: torch.Tensor,
    w: torch.Tensor,
    kl: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    cfg: LossConfig,
) -> dict[str, float]:
    """Token means over the masked tokens (sequence-level values count once per token)."""
    n = mask.sum().clamp(min=1)
    is_clipped = ((ratio < 1 - cfg.epsilon) & (adv < 0)) | ((ratio > 1 + cfg.eps_high) & (adv > 0))

    def mean(x: torch.Tensor) -> float:
        return float((x.to(mask.dtype) * mask).sum() / n)

    return {
        COL.clip_frac: mean(is_clipped),
        COL.is_weight_mean: mean(w),
        COL.is_zeroed_frac: mean(w == 0),
        COL.kl_mean: mean(kl),
    }
