import math

import pytest
import torch

from dataplane.advantages import group_advantages
from learner.loss import LossConfig, grpo_loss

CFG = LossConfig(epsilon=0.2, is_cap=2.0)


def t(*xs):
    return torch.tensor([list(xs)], dtype=torch.float64)


def case(adv):
    logp = torch.log(t(0.5, 0.25)).requires_grad_(True)
    old = torch.log(t(0.4, 0.25))
    beh = torch.log(t(0.4, 0.05))
    return logp, old, beh, torch.tensor([adv], dtype=torch.float64), torch.ones(1, 2, dtype=torch.float64)


def test_hand_computed_positive_advantage():
    # token 1: r = 0.5/0.4 = 1.25 clipped to 1.2, w = 1; token 2: r = 1, w = min(0.25/0.05, 2) = 2
    logp, old, beh, adv, mask = case(1.0)
    loss, stats = grpo_loss(logp, old, beh, adv, mask, CFG)
    assert loss.item() == pytest.approx(-(1.2 + 2.0) / 2)
    loss.backward()
    # clipped token carries no gradient; the other: d(-w*r*A/2)/dlogp = -w*r*A/2 = -1
    assert logp.grad[0].tolist() == pytest.approx([0.0, -1.0])
    assert stats["clip_frac"] == pytest.approx(0.5)
    assert stats["is_weight_mean"] == pytest.approx(1.5)


def test_hand_computed_negative_advantage_is_not_clipped():
    logp, old, beh, adv, mask = case(-1.0)
    loss, _ = grpo_loss(logp, old, beh, adv, mask, CFG)
    # min(-1.25, -1.2) = -1.25 (pessimistic side), token 2: 2 * -1
    assert loss.item() == pytest.approx((1.25 + 2.0) / 2)
    loss.backward()
    assert logp.grad[0].tolist() == pytest.approx([1.25 / 2, 1.0])


def test_kl_term_and_mask():
    logp, old, beh, adv, _ = case(0.0)
    ref = logp.detach() + math.log(2.0)
    mask = torch.tensor([[1.0, 0.0]], dtype=torch.float64)
    cfg = LossConfig(epsilon=0.2, is_cap=2.0, beta=0.1)
    loss, stats = grpo_loss(logp, old, beh, adv, mask, cfg, ref_logp=ref)
    kl = 2.0 - math.log(2.0) - 1.0
    assert loss.item() == pytest.approx(0.1 * kl)
    assert stats["kl_mean"] == pytest.approx(kl)
    with pytest.raises(ValueError, match="reference"):
        grpo_loss(logp, old, beh, adv, mask, cfg)


def test_token_mean_vs_seq_mean():
    # two sequences, 1 and 3 valid tokens, on-policy (r = w = 1): per-token term = A
    logp = torch.zeros(2, 3, dtype=torch.float64)
    adv = torch.tensor([1.0, 3.0], dtype=torch.float64)
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]], dtype=torch.float64)
    tok, _ = grpo_loss(logp, logp, logp, adv, mask, CFG)
    seq, _ = grpo_loss(logp, logp, logp, adv, mask, LossConfig(agg="seq-mean"))
    assert tok.item() == pytest.approx(-(1 + 3 * 3) / 4)
    assert seq.item() == pytest.approx(-(1 + 3) / 2)


def test_group_advantages_sample_std():
    a = group_advantages([1.0, 0.0, 0.0, 1.0], eps=0.0)
    std = math.sqrt(((0.5**2) * 4) / 3)
    assert a == pytest.approx([0.5 / std, -0.5 / std, -0.5 / std, 0.5 / std])
    assert group_advantages([0.3, 0.3]) == [0.0, 0.0]  # identical samples: no signal
