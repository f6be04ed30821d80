"""learner.compile (echo_rl/core/models.py compile_layers): each decoder layer through
torch.compile, the model's parameters and names untouched, the same update as eager. Its speed
is a GPU figure (make gpu-check's learner stage, docs/gpu.md); here inductor compiles for the
CPU."""

from __future__ import annotations

import copy

import pytest
import torch

from echo_rl.core.config import LearnerConfig, ModelConfig
from echo_rl.core.models import compile_layers, load_model
from tests.test_micro_batch import batch

pytestmark = pytest.mark.timeout(300)


@pytest.mark.slow
def test_compiled_layers_make_the_same_step_with_the_same_parameter_names(tokenizer):
    from echo_rl.learner.trainer import Trainer

    torch.manual_seed(0)
    eager = load_model(ModelConfig(), tokenizer, "float32")
    compiled = copy.deepcopy(eager)
    names = list(compiled.state_dict())
    assert compile_layers(compiled) == ModelConfig().num_layers
    assert list(compiled.state_dict()) == names  # checkpoints and snapshots see the same model
    cfg = LearnerConfig(lr=1e-2, updates_per_step=2)
    a, b = Trainer(eager, cfg, seed=3), Trainer(compiled, cfg, seed=3)
    for _ in range(2):
        sa, sb = a.step(batch()), b.step(batch())
        assert sb["loss"] == pytest.approx(sa["loss"], rel=1e-4, abs=1e-6)
    pe, pc = dict(eager.named_parameters()), dict(compiled.named_parameters())
    assert max(float((pe[n] - pc[n]).abs().max()) for n in pe) < 1e-4


def test_a_model_without_decoder_layers_is_refused_naming_the_key():
    with pytest.raises(
        ValueError, match=r"learner.compile = true: Linear .*learner.compile = false"
    ):
        compile_layers(torch.nn.Linear(2, 2))
