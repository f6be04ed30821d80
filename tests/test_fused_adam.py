"""The learner's Adam runs its fused kernels where they apply (echo_rl/learner/trainer.py ``fusable``),
and updates as the default path does."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from echo_rl.learner.trainer import fusable

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def test_fused_where_it_applies_and_the_default_elsewhere():
    one = SimpleNamespace(world=1)
    params = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2, 2))]
    assert fusable(params, one) is True
    assert fusable(params, SimpleNamespace(world=2)) is None  # FSDP2's shards: the default
    assert fusable([], one) is None
    assert fusable([torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))], one) is True


def test_a_fused_update_is_the_default_update():
    torch.manual_seed(0)
    a = [torch.nn.Parameter(torch.randn(64)) for _ in range(3)]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    fused = torch.optim.Adam(a, lr=1e-2, fused=fusable(a, SimpleNamespace(world=1)))
    default = torch.optim.Adam(b, lr=1e-2)
    for step in range(3):
        grads = [
            torch.randn(64, generator=torch.Generator().manual_seed(step * 10 + i))
            for i in range(3)
        ]
        for p, q, g in zip(a, b, grads):
            p.grad, q.grad = g.clone(), g.clone()
        fused.step()
        default.step()
    assert fused.defaults["fused"] is True
    for p, q in zip(a, b):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
