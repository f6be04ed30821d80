"""Echo on a CUDA GPU (marker ``gpu``): the learner's bf16 autocast, the worker's device
placement and a NCCL process group on one GPU. They skip, saying why, on every machine without
CUDA (this one and CI); ``make gpu-check`` (benchmarks/gpu_suite.py) runs them on a GPU machine.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

if not torch.cuda.is_available():
    pytest.skip(
        "no CUDA GPU on this machine (make gpu-check runs these on one)", allow_module_level=True
    )

from echo_rl.core import wire  # noqa: E402
from echo_rl.core.config import LearnerConfig, ModelConfig  # noqa: E402
from echo_rl.core.models import load_model, load_tokenizer, params_to_payload  # noqa: E402
from echo_rl.data.adapter import LearnerBatch  # noqa: E402
from echo_rl.learner.parallel.single import Single  # noqa: E402
from echo_rl.learner.trainer import Trainer, token_logprobs  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CFG = ModelConfig(
    hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32
)


def batch(seed: int, n: int = 16, prompt: int = 6, completion: int = 10) -> LearnerBatch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 24, (n, prompt + completion), generator=g)
    mask = torch.zeros(n, prompt + completion - 1)
    mask[:, prompt - 1 :] = 1
    return LearnerBatch(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        loss_mask=mask,
        behaviour_logprobs=-torch.rand(n, prompt + completion - 1, generator=g) * 3,
        advantages=torch.randn(n, generator=g),
        rewards=torch.zeros(n),
        versions=torch.zeros(n, dtype=torch.long),
    )


def trained(device: str, seed: int = 0) -> tuple[Trainer, Single, list[dict[str, float]]]:
    tok = load_tokenizer(CFG)
    par = Single(device)
    model = par.wrap(load_model(CFG, tok))
    trainer = Trainer(model, LearnerConfig(lr=1e-3, updates_per_step=2), seed=seed, parallel=par)
    stats = [trainer.step(par.to_device(batch(s))) for s in range(3)]
    return trainer, par, stats


def test_learner_step_runs_bf16_autocast_with_float32_weights():
    seen: list[torch.dtype] = []
    trainer, par, stats = trained("cuda")
    head = trainer.model.get_output_embeddings()
    hook = head.register_forward_hook(lambda m, a, out: seen.append(out.dtype))
    trainer.step(par.to_device(batch(7)))
    hook.remove()
    assert seen and all(d == torch.bfloat16 for d in seen), seen  # forward computes in bf16
    params = list(trainer.model.parameters())
    assert all(p.dtype == torch.float32 and p.device.type == "cuda" for p in params)
    moments = [s["exp_avg"] for s in trainer.optimizer.state.values()]
    assert moments and all(m.dtype == torch.float32 and m.device.type == "cuda" for m in moments)
    # Same seeds on the CPU (float32 throughout): bf16 compute gives the same losses to bf16 precision.
    _, _, cpu = trained("cpu")
    for g, c in zip(stats, cpu):
        assert g["loss"] == pytest.approx(c["loss"], rel=0.05, abs=2e-3)


def _backend(name: str) -> Any:
    """The worker's backend ``name`` on CUDA: today's ``generate`` or Echo's engine."""
    from echo_rl.worker.backends import make_backend

    return make_backend(name, model_cfg=CFG, device="cuda")


@pytest.mark.parametrize("name", ["transformers", "engine"])
def test_worker_on_cuda_installs_the_learner_snapshot_and_its_logprobs_match(name):
    trainer, par, _ = trained("cuda")
    backend = _backend(name)
    assert backend.device.type == "cuda"
    assert all(
        p.dtype == torch.bfloat16 and p.device.type == "cuda" for p in backend.model.parameters()
    )
    index, payload = params_to_payload(trainer.model.named_parameters(), "bfloat16")
    backend.install(index, payload, version=1)
    groups = [
        wire.Group(group_id=f"g{i}", prompt_ids=[5 + i, 6, 7, 8], n=4, seed=i) for i in range(4)
    ]
    out = backend.generate(groups, 12, 1.0)
    samples = [s for g in out for s in g]
    assert len(samples) == 16 and all(len(s.completion_ids) > 0 for s in samples)
    gaps = []
    for g, group in zip(groups, out):
        for s in group:
            ids = torch.tensor([g.prompt_ids + s.completion_ids], device="cuda")
            lp = token_logprobs(trainer.model, ids, torch.ones_like(ids))[
                0, len(g.prompt_ids) - 1 :
            ]
            gaps += (lp.float().cpu() - torch.tensor(s.logprobs)).abs().tolist()
    # bf16 weights on the worker, float32 weights under bf16 autocast on the learner
    assert sum(gaps) / len(gaps) < 0.05, max(gaps)
    if name == "engine":  # the step ran as a captured CUDA graph, not eagerly
        assert backend.own_loop and backend.graphs and backend._graph is not None


@pytest.mark.parametrize("name", ["transformers", "engine"])
def test_a_parked_worker_model_comes_back_to_the_gpu_and_samples_the_same(name):
    """--resident: a park moves the worker's model into pinned host copies and frees its GPU
    memory; the unpark brings it back, and it samples what it sampled before
    (echo_rl/worker/backends/parking.py). The engine drops its captured step and fused weights on
    park and builds them again on unpark."""
    backend = _backend(name)
    groups = [wire.Group(group_id="g", prompt_ids=[5, 6, 7, 8], n=4, seed=3)]

    def sample() -> list[list[int]]:
        return [s.completion_ids for s in backend.generate(groups, 12, 1.0)[0]]

    before = sample()
    on_gpu = torch.cuda.memory_allocated()
    weights = sum(p.numel() * p.element_size() for p in backend.model.parameters())
    for _ in range(2):  # the second cycle reuses the first's host copies
        backend.park()
        assert all(p.device.type == "cpu" and p.is_pinned() for p in backend.model.parameters())
        assert torch.cuda.memory_allocated() <= on_gpu - weights // 2
        backend.unpark()
        assert all(p.device.type == "cuda" for p in backend.model.parameters())
        assert sample() == before


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


NCCL_SCRIPT = r"""
import sys, torch
sys.path.insert(0, sys.argv[1])
from tests.test_gpu import CFG, batch
from echo_rl.core.config import LearnerConfig
from echo_rl.core.models import load_model, load_tokenizer
from echo_rl.learner.parallel.fsdp2 import FSDP2
from echo_rl.learner.trainer import Trainer
import torch.distributed as dist
par = FSDP2(torch.device("cuda", 0))
assert dist.get_backend() == "nccl", dist.get_backend()
model = par.wrap(load_model(CFG, load_tokenizer(CFG)))
trainer = Trainer(model, LearnerConfig(lr=1e-3, updates_per_step=2), seed=0, parallel=par)
losses = [trainer.step(par.to_device(batch(s)))["loss"] for s in range(3)]
total = par.all_sum(torch.tensor([1.0, 2.0], dtype=torch.float64))
sd, _ = par.full_state(trainer.model, trainer.optimizer)
torch.save({"losses": losses, "sum": total.tolist(), "params": sd}, sys.argv[2])
dist.destroy_process_group()
"""


def test_fsdp2_on_a_nccl_process_group_of_one_gpu_matches_one_process(tmp_path):
    env = {
        **os.environ,
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    out = tmp_path / "nccl.pt"
    run = subprocess.run(
        [sys.executable, "-c", NCCL_SCRIPT, str(ROOT), str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    got = torch.load(out)
    assert got["sum"] == [1.0, 2.0]
    trainer, _, stats = trained("cuda")
    for a, b in zip(got["losses"], [s["loss"] for s in stats]):
        assert a == pytest.approx(b, rel=0.05, abs=2e-3)
    ref = {k: v.float().cpu() for k, v in trainer.model.state_dict().items()}
    worst = max(float((got["params"][k].float() - ref[k]).abs().max()) for k in ref)
    assert worst < 5e-2, worst  # bf16 all-gathers vs autocast: both bf16 compute, same updates
