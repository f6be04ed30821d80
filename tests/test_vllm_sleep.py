"""A vLLM worker serving more runs than it keeps on the GPU (--resident): its engine sleeps
between the run's turns (vLLM's sleep mode, level 1: weights to host memory, KV cache freed)
and wakes for them (echo_rl/worker/backends/vllm.py park/unpark). Through the fake engine of
tests/test_vllm_backend.py: the calls and their order, not the GPU's memory (no GPU here; the
sleep itself has not run on one)."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest

from echo_rl.core.config import ModelConfig
from echo_rl.worker.backends.refit import RefitError
from echo_rl.worker.backends.vllm import VLLMBackend
from echo_rl.worker.sharing import Turns
from tests.test_vllm_backend import Params, Prompt, fake_backend, group, perturbed, snapshot

pytestmark = pytest.mark.timeout(120)


def test_a_parked_engine_sleeps_and_wakes_with_a_fresh_prefix_cache(tmp_path, monkeypatch):
    backend, llm = fake_backend(tmp_path, monkeypatch, sleep_mode=True)
    backend.install(*snapshot(perturbed(1)), version=1)
    llm.calls.clear()
    backend.park()
    backend.park()  # a parked engine is not put to sleep twice
    assert llm.calls == ["sleep1"]
    with pytest.raises(RefitError, match="asleep"):
        backend.generate([group()], 4, 1.0)
    backend.unpark()
    backend.unpark()
    assert llm.calls == ["sleep1", "wake_up", "reset_prefix_cache"]
    backend.generate([group()], 4, 1.0)
    assert llm.calls[-1] == "v1"
    assert backend.book.installs == 1  # a sleep is not counted as an install


def test_versions_that_arrive_asleep_load_at_wake_up_the_newest_only(tmp_path, monkeypatch):
    backend, llm = fake_backend(tmp_path, monkeypatch, sleep_mode=True)
    backend.install(*snapshot(perturbed(1)), version=1)
    backend.park()
    llm.calls.clear()
    backend.install(*snapshot(perturbed(2)), version=2)
    backend.install(*snapshot(perturbed(3)), version=3)
    assert llm.calls == [] and backend.book.version == 1  # nothing written to a sleeping engine
    backend.unpark()
    assert llm.calls == ["wake_up", "reset_prefix_cache", "echo_refit", "reset_prefix_cache"]
    assert backend.book.version == 3
    backend.generate([group()], 4, 1.0)
    assert llm.calls[-1] == "v3"
    # the engine holds version 3's weights: what a fresh install of it writes
    fresh, fresh_llm = fake_backend(tmp_path, monkeypatch)
    fresh.install(*snapshot(perturbed(3)), version=3)
    ours = dict(llm.worker.model_runner.model.runnable.named_parameters())
    theirs = dict(fresh_llm.worker.model_runner.model.runnable.named_parameters())
    assert all(ours[n].equal(theirs[n]) for n in theirs)


def test_a_malformed_version_is_refused_while_asleep_too(tmp_path, monkeypatch):
    backend, llm = fake_backend(tmp_path, monkeypatch, sleep_mode=True)
    backend.install(*snapshot(perturbed(1)), version=1)
    backend.park()
    index, payload = snapshot(perturbed(2))
    bad = [dict(index[0], nbytes=index[0]["nbytes"] + 2)] + index[1:]
    with pytest.raises(RefitError, match="bytes, the index says"):
        backend.install(bad, payload, version=2)
    backend.unpark()
    assert backend.book.version == 1 and "echo_refit" not in llm.calls[-2:]


def test_without_sleep_mode_a_park_moves_nothing(tmp_path, monkeypatch):
    backend, llm = fake_backend(tmp_path, monkeypatch)
    backend.install(*snapshot(perturbed(1)), version=1)
    llm.calls.clear()
    backend.park()
    backend.unpark()
    assert llm.calls == [] and not backend.asleep


@pytest.mark.parametrize("runs,resident,sleeps", [(2, 1, True), (2, 2, False), (1, 1, False)])
def test_the_engine_is_built_for_sleep_when_the_device_will_park(
    tmp_path, monkeypatch, runs, resident, sleeps
):
    """Turns.parks says whether models will move (more runs than --resident); the worker's
    load passes it on (echo_rl/worker/model.py LoadChoice.parks) and the engine is built with
    enable_sleep_mode only then."""
    import torch

    turns = Turns(resident)
    for i in range(runs):
        turns.add(f"run{i}")
    assert turns.parks() is sleeps
    seen: dict = {}
    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(LLM=lambda **kw: seen.update(kw)))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("ECHO_HOME", str(tmp_path))
    VLLMBackend(ModelConfig(), device="cuda", types=(Params, Prompt), sleep_mode=turns.parks())
    assert seen["enable_sleep_mode"] is sleeps
