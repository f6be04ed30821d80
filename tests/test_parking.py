"""A model parked in host memory between turns (echo_rl/worker/backends/parking.py): what a park and an
unpark move, that a version installed while parked is the one that comes back, and that host
copies are made once. On the CPU the copies are plain host tensors; on a GPU they are pinned
(tests/test_gpu.py::test_a_parked_worker_model_comes_back_to_the_gpu_and_samples_the_same)."""

from __future__ import annotations

import pytest
import torch

from echo_rl.core import wire
from echo_rl.core.config import ModelConfig
from echo_rl.core.models import params_to_payload
from echo_rl.worker.backends.parking import HostParking

pytestmark = pytest.mark.timeout(120)


def _backend():
    from echo_rl.worker.backends.transformers import TransformersBackend

    return TransformersBackend(ModelConfig(max_positions=64))


def _sample(backend):
    g = wire.Group(group_id="g", prompt_ids=[3, 4], n=4, seed=9)
    return [(s.completion_ids, s.logprobs) for s in backend.generate([g], 6, 1.0)[0]]


def _state(model):
    return {n: t.detach().clone() for n, t in model.state_dict().items()}


def test_a_park_moves_every_tensor_once_and_a_cycle_changes_nothing():
    backend = _backend()
    model = backend.model
    before, sampled = _state(model), _sample(backend)
    parking = HostParking.whole(model, torch.device("cpu"))
    tied = model.get_input_embeddings().weight is model.get_output_embeddings().weight
    assert tied  # the tiny model ties its head: the shared Parameter must be moved once
    assert len(parking.params) == len({id(p) for p in model.parameters()})
    assert parking.buffers  # the rotary frequencies
    device_ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
    parking.park()
    assert parking.parked
    assert all(p.data_ptr() != device_ptrs[n] for n, p in model.named_parameters())
    assert model.get_input_embeddings().weight is model.get_output_embeddings().weight
    host_ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
    parking.unpark()
    assert not parking.parked
    after = _state(model)
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], before[k]) for k in before)
    assert _sample(backend) == sampled
    parking.park()  # the second park writes into the first park's copies: no new host memory
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == host_ptrs
    parking.park()  # parking a parked model is a no-op, not a second copy
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == host_ptrs


def test_a_version_installed_while_parked_is_the_one_that_comes_back():
    backend = _backend()
    parking = HostParking.whole(backend.model, torch.device("cpu"))
    g = torch.Generator().manual_seed(5)
    named = [
        (n, torch.randn(p.shape, generator=g) * 0.1) for n, p in backend.model.named_parameters()
    ]
    index, payload = params_to_payload(named, "float32")
    parking.park()
    backend.install(index, payload, version=2)
    parking.unpark()
    got = dict(backend.model.named_parameters())
    assert all(torch.equal(got[n], t) for n, t in named)
    fresh = _backend()
    fresh.install(index, payload, version=2)
    assert _sample(backend) == _sample(fresh)


def test_a_resized_tensor_gets_a_new_host_copy():
    layer = torch.nn.Linear(4, 3)
    parking = HostParking(torch.device("cpu"), layer.parameters())
    parking.park()
    parking.unpark()
    layer.weight.data = torch.ones(5, 4)  # a model rebuilt under the same Parameter
    parking.park()
    assert layer.weight.shape == (5, 4) and torch.equal(layer.weight, torch.ones(5, 4))
    parking.unpark()
    assert torch.equal(layer.weight, torch.ones(5, 4))


def test_a_cpu_worker_parks_nothing():
    """On the CPU the device is host memory: the backend's park and unpark leave its tensors
    where they are (a switch costs nothing there, docs/multirun.md)."""
    backend = _backend()
    ptrs = [p.data_ptr() for p in backend.model.parameters()]
    backend.park()
    assert [p.data_ptr() for p in backend.model.parameters()] == ptrs
    backend.unpark()
    assert [p.data_ptr() for p in backend.model.parameters()] == ptrs
