"""The sampling lag (issue 56): the step row's ``sampling_lag_kl`` is the KL from the policies
the workers sampled with to the learner's at the step's start, estimated (k3) on the trained
tokens: zero for the learner's own log-probs, the token-weighted mean of each row's gap."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from echo_rl.core.config import LearnerConfig
from echo_rl.data.adapter import LearnerBatch

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def model(tokenizer):
    from echo_rl.core.config import ModelConfig
    from echo_rl.core.models import load_model

    torch.manual_seed(0)
    return load_model(ModelConfig(), tokenizer, "float32")


def own_logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)


def lag(model, behaviour_shift: torch.Tensor) -> float:
    from echo_rl.learner.trainer import Trainer

    g = torch.Generator().manual_seed(0)
    n, length = behaviour_shift.shape[0], 12
    ids = torch.randint(4, 24, (n, length), generator=g)
    mask = torch.zeros(n, length - 1)
    mask[:, 5:] = 1
    batch = LearnerBatch(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        loss_mask=mask,
        behaviour_logprobs=own_logprobs(model, ids) + behaviour_shift.unsqueeze(1),
        advantages=torch.randn(n, generator=g),
        rewards=torch.zeros(n),
        versions=torch.zeros(n, dtype=torch.long),
    )
    trainer = Trainer(copy.deepcopy(model), LearnerConfig(lr=1e-3, updates_per_step=2), seed=1)
    return trainer.step(batch)["sampling_lag_kl"]


def test_the_learners_own_samples_lag_nothing(model):
    assert abs(lag(model, torch.zeros(8))) < 1e-6


def test_each_token_counts_once(model):
    # rows sampled 0.3 and 2 nats/token below the learner, the same number of tokens each
    shift = torch.tensor([-0.3, -0.3, -0.3, -0.3, -2.0, -2.0, -2.0, -2.0])
    want = (math.expm1(0.3) - 0.3 + math.expm1(2.0) - 2.0) / 2
    assert lag(model, shift) == pytest.approx(want, rel=1e-4)
    # a policy above the learner's lags too (the estimate is never negative)
    assert lag(model, torch.full((8,), 0.3)) == pytest.approx(math.expm1(-0.3) + 0.3, rel=1e-4)
