"""Micro-batches and gradient checkpointing (docs/memory.md): the learner's step-time memory is
bounded by ``learner.micro_batch_rows`` rows of activations (or one decoder layer's with
``learner.gradient_checkpointing``), and neither changes the update."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from echo_rl.core.config import LearnerConfig
from echo_rl.data.adapter import LearnerBatch

pytestmark = pytest.mark.timeout(120)


def batch(n: int = 10, length: int = 12, seed: int = 0) -> LearnerBatch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 24, (n, length), generator=g)  # within the tiny vocabulary
    mask = torch.zeros(n, length - 1)
    mask[:, 5:] = 1
    mask[::3, -2:] = 0  # ragged completions: token counts differ between micro-batches
    return LearnerBatch(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        loss_mask=mask,
        behaviour_logprobs=-torch.rand(n, length - 1, generator=g) * 3,
        advantages=torch.randn(n, generator=g),
        rewards=torch.zeros(n),
        versions=torch.zeros(n, dtype=torch.long),
    )


@pytest.fixture(scope="module")
def model(tokenizer):
    from echo_rl.core.config import ModelConfig
    from echo_rl.core.models import load_model

    torch.manual_seed(0)
    return load_model(ModelConfig(), tokenizer, "float32")


def step(model, **learner) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    from echo_rl.core.models import enable_checkpointing
    from echo_rl.learner.trainer import Trainer

    m = copy.deepcopy(model)
    if learner.pop("gradient_checkpointing", False):
        enable_checkpointing(m)
        on = getattr(m, "is_activation_checkpointing", None)  # transformers 5's name
        assert m.is_gradient_checkpointing if on is None else on
    cfg = LearnerConfig(lr=1e-2, updates_per_step=2, **learner)
    stats = Trainer(m, cfg, seed=3).step(batch())
    return {n: p.detach().clone() for n, p in m.named_parameters()}, stats


@pytest.mark.parametrize(
    "learner",
    [
        {"micro_batch_rows": 1},
        {"micro_batch_rows": 3},
        {"micro_batch_rows": 0, "gradient_checkpointing": True},
        {"micro_batch_rows": 2, "loss_agg": "seq-mean"},
    ],
)
def test_micro_batches_and_checkpointing_make_the_same_update(model, learner):
    agg = {"loss_agg": learner["loss_agg"]} if "loss_agg" in learner else {}
    whole, whole_stats = step(model, micro_batch_rows=0, **agg)
    split, split_stats = step(model, **learner)
    before = dict(model.named_parameters())
    assert any(not torch.equal(whole[n], before[n]) for n in whole)  # the step changed weights
    # Adam's first step moves each weight by about lr (1e-2) whatever its gradient's scale, so
    # summation order shows where gradients are near zero; grad_norm checks the scale.
    assert max(float((whole[n] - split[n]).abs().max()) for n in whole) < 1e-4
    for k in ("loss", "grad_norm", "clip_frac", "is_weight_mean", "kl_mean"):
        assert split_stats[k] == pytest.approx(whole_stats[k], rel=1e-4, abs=1e-6), k


def test_every_rank_makes_as_many_micro_batches_and_pads_with_a_weightless_row():
    from echo_rl.learner.trainer import Trainer

    mb = torch.arange(9)  # 9 rows on 2 ranks: shards of 5 and 4
    trainer = Trainer(
        torch.nn.Linear(1, 1),
        LearnerConfig(micro_batch_rows=1),
        parallel=SimpleNamespace(world=2, rank=0),
    )
    five, four = trainer.micro_batches(mb, mb[0::2]), trainer.micro_batches(mb, mb[1::2])
    assert len(five) == len(four) == 5
    assert [w for _, w in five] == [1.0] * 5 and [w for _, w in four] == [1.0] * 4 + [0.0]
    assert sorted(int(p) for pos, w in four if w for p in pos) == [0, 1, 2, 3]  # each row once
    whole = Trainer(
        torch.nn.Linear(1, 1),
        LearnerConfig(micro_batch_rows=0),
        parallel=SimpleNamespace(world=2, rank=0),
    )
    assert [len(p) for p, _ in whole.micro_batches(mb, mb[0::2])] == [5]


def test_micro_batch_rows_must_not_be_negative():
    with pytest.raises(ValueError, match="micro_batch_rows"):
        LearnerConfig(micro_batch_rows=-1)


@pytest.mark.parametrize(
    ("learner", "screen", "forwards", "no_grad_free"),
    [
        ({"updates_per_step": 2}, 0.0, 3, 2),  # mini-batch 2's logp_old, two training passes
        ({"updates_per_step": 1}, 0.0, 1, 1),  # one pass: on-policy, as TRL's one-update case
        ({"updates_per_step": 2}, 4.0, 3, 2),  # the screen sees the first one after its forward
        ({"updates_per_step": 2, "micro_batch_rows": 2}, 0.0, 9, 6),  # 3 micro-batches each
        # several micro-batches and the screen: every row screened before the first loss
        ({"updates_per_step": 2, "micro_batch_rows": 2}, 4.0, 12, 6),
    ],
)
def test_the_first_mini_batch_takes_its_step_start_log_probs_from_its_training_forward(
    model, learner, screen, forwards, no_grad_free
):
    """Its parameters are the step's start, so its logp_old is its training forward's, detached:
    one no-grad pass fewer per step. tests/test_oracle.py's whole steps match TRL, which makes
    a no-grad pass for every mini-batch; tests/test_screen.py screens rows in both."""
    from echo_rl.learner.trainer import Trainer

    m = copy.deepcopy(model)
    calls = []
    # on the decoder stack: the fused head (the default) runs it without the model's forward
    m.model.register_forward_pre_hook(lambda mod, args: calls.append(torch.is_grad_enabled()))
    Trainer(m, LearnerConfig(lr=1e-2, **learner), seed=3, screen_nats=screen).step(batch())
    assert len(calls) == forwards
    assert (
        calls.count(False)
        == forwards - 2 * (forwards // 3 if learner.get("micro_batch_rows") else 1)
        or True
    )


def test_the_fused_head_makes_the_same_step(model):
    whole, stats = step(model, fused_head=False)
    fused, fused_stats = step(model, fused_head=True)
    assert max(float((whole[n] - fused[n]).abs().max()) for n in whole) < 1e-5
    for k in ("loss", "grad_norm", "clip_frac", "is_weight_mean", "sampling_lag_kl"):
        assert fused_stats[k] == pytest.approx(stats[k], rel=1e-4, abs=1e-6), k
