"""LoRA runs of one worker process on the same base model hold it once
(echo_rl/worker/backends/shared_base.py, docs/multirun.md): the second run's base weights are the
first's tensors, its adapter its own, and what it generates is what an unshared backend with
the same adapter generates."""

from __future__ import annotations

import pytest
import torch

from echo_rl.core import wire
from echo_rl.core.config import LoraConfig, ModelConfig
from echo_rl.core.lora import adapter_parameters
from echo_rl.core.models import params_to_payload

pytestmark = pytest.mark.timeout(120)


def _backend():
    from echo_rl.worker.backends.transformers import TransformersBackend

    return TransformersBackend(ModelConfig(max_positions=64), lora=LoraConfig(enabled=True))


def _adapter(seed: int, like) -> tuple[list, bytes]:
    g = torch.Generator().manual_seed(seed)
    named = [
        (n, torch.randn(p.shape, generator=g) * 0.5) for n, p in adapter_parameters(like).items()
    ]
    return params_to_payload(named, "float32")


def _sample(backend):
    g = wire.Group(group_id="g", prompt_ids=[3, 4], n=4, seed=9)
    return [(s.completion_ids, s.logprobs) for s in backend.generate([g], 6, 1.0)[0]]


def test_a_second_lora_run_on_the_same_base_shares_it_and_generates_as_if_alone(monkeypatch):
    import echo_rl.worker.backends.transformers as tb
    from echo_rl.worker.backends.shared_base import SharedBases

    monkeypatch.setattr(tb, "SHARED", SharedBases())  # this test's process-wide registry
    a, b = _backend(), _backend()
    assert a.base_hash == b.base_hash and a.shared_bytes == 0 < b.shared_bytes
    base = [(n, p) for n, p in b.model.named_parameters() if n not in adapter_parameters(b.model)]
    theirs = dict(a.model.named_parameters())
    assert all(p.data_ptr() == theirs[n].data_ptr() for n, p in base)  # one base in memory
    assert all(p.data_ptr() != theirs[n].data_ptr() for n, p in adapter_parameters(b.model).items())
    a.install(*_adapter(1, a.model))
    b.install(*_adapter(2, b.model))
    monkeypatch.setattr(tb, "SHARED", SharedBases())
    alone = _backend()  # first in a registry of its own: unshared
    assert alone.shared_bytes == 0
    alone.install(*_adapter(2, alone.model))
    assert _sample(b) == _sample(alone)  # b's adapter, not a's, over the shared base
    assert _sample(a) != _sample(b)


def test_a_hostile_run_cannot_write_the_base_another_run_shares(monkeypatch):
    """A learner is a stranger too: run a's version naming a base tensor is refused whole,
    and the base run b generates over is unchanged."""
    import echo_rl.worker.backends.transformers as tb
    from echo_rl.core.models import ModelError
    from echo_rl.worker.backends.shared_base import SharedBases

    monkeypatch.setattr(tb, "SHARED", SharedBases())
    a, b = _backend(), _backend()
    name, weight = next(
        (n, p) for n, p in b.model.named_parameters() if n not in adapter_parameters(b.model)
    )
    before = weight.detach().clone()
    evil = [(n, p.detach()) for n, p in adapter_parameters(a.model).items()]
    evil.append((name, torch.full_like(weight, 7.0)))
    with pytest.raises(ModelError, match="unexpected"):
        a.install(*params_to_payload(evil, "float32"))
    assert torch.equal(weight, before)


def test_the_memory_budget_books_a_shared_base_once(monkeypatch, tmp_path, tokenizer):
    """Two LoRA runs of one process loaded through the worker's own path (echo_rl.worker.model
    .load_model) with one --host-memory-gb: the second run's booking is its payloads, not a
    second base (echo_rl.core.memplan.HostBudget.loaded)."""
    import echo_rl.worker.backends.transformers as tb
    from echo_rl.core.config import EchoConfig
    from echo_rl.core.memplan import HostBudget
    from echo_rl.core.models import load_model as build
    from echo_rl.worker.backends.shared_base import SharedBases
    from echo_rl.worker.model import LoadChoice, load_model

    monkeypatch.setattr(tb, "SHARED", SharedBases())
    build(ModelConfig(), tokenizer).save_pretrained(tmp_path)  # a base on disk, as a volunteer's
    tokenizer.save_pretrained(tmp_path)
    cfg = EchoConfig()
    cfg.learner.lora.enabled = True
    cfg.model.name = str(tmp_path)
    view = cfg.worker_view()
    budget = HostBudget(0)
    booked = {}
    for run in ("a", "b"):
        choice = LoadChoice(shared=budget, run=run)
        backend, _ = load_model(
            view, choice, version_bytes=(4096, "float32"), base=None, base_manifest=None
        )
        booked[run] = (budget.runs[run], backend.shared_bytes)
    (a, a_saved), (b, b_saved) = booked["a"], booked["b"]
    assert a_saved == 0 < b_saved
    assert b_saved > 0 and a == b_saved + b  # the base counted once, by the first run
    assert b >= 4096  # the second run's adapter payloads
