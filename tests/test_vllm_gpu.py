"""The vLLM backend on a real engine (marker ``gpu``): refit in place, and behaviour log-probs
against the learner's own for the same tokens.

Skips, saying why, where CUDA or vLLM is absent (every CPU machine, and CI). On a GPU machine:

    pip install -e '.[vllm]'   # in an environment with the CUDA build of torch==2.13.0
    pytest -m gpu tests/test_vllm_gpu.py

The log-prob gap (mean and 99th percentile of |vLLM - learner| per token) is written to
``benchmarks/results/vllm/logprob_gap.json`` with the device: it calibrates the auditor's
tolerance for untrusted workers (docs/worker.md).
"""

from __future__ import annotations

import json
import platform
from pathlib import Path

import pytest
import torch

from echo_rl.core import wire
from echo_rl.core.config import ModelConfig
from echo_rl.core.models import load_model, load_tokenizer, params_to_payload

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900)]

if not torch.cuda.is_available():
    pytest.skip(
        "no CUDA GPU on this machine: the vLLM backend runs only on CUDA", allow_module_level=True
    )
pytest.importorskip(
    "vllm",
    reason="vLLM is not installed: pip install -e '.[vllm]' with the "
    "CUDA build of torch==2.13.0 (docs/worker.md)",
)

from echo_rl.learner.trainer import token_logprobs  # noqa: E402
from echo_rl.worker.backends.vllm import VLLMBackend  # noqa: E402

SMOLLM2 = Path("models/smollm2-135m-instruct")
RESULTS = Path("benchmarks/results/vllm")
TEMPERATURE = 0.8


@pytest.fixture(scope="module")
def cfg() -> ModelConfig:
    return ModelConfig(name=str(SMOLLM2)) if (SMOLLM2 / "config.json").is_file() else ModelConfig()


@pytest.fixture(scope="module")
def backend(cfg) -> VLLMBackend:
    return VLLMBackend(cfg, device="cuda", gpu_memory_utilization=0.3)


def learner_model(cfg: ModelConfig, seed: int):
    """The learner's model, moved off its start by a seeded step: a snapshot that differs from
    what the engine loaded at start-up, so a refit that did nothing cannot pass."""
    model = load_model(cfg, load_tokenizer(cfg), "bfloat16").cuda().eval()
    g = torch.Generator(device="cuda").manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g, device="cuda", dtype=p.dtype) * p.std() * 0.05)
    return model


def groups(tok, count: int = 8, n: int = 4) -> list[wire.Group]:
    texts = [f"Question {i}: what is {i} plus {i + 3}?" for i in range(count)]
    return [
        wire.Group(group_id=f"g{i}", prompt_ids=tok.encode(t), n=n, seed=100 + i)
        for i, t in enumerate(texts)
    ]


def gaps(model, gs, out) -> torch.Tensor:
    """|vLLM behaviour log-prob - learner log-prob| for every generated token."""
    diffs = []
    for g, samples in zip(gs, out):
        for s in samples:
            ids = torch.tensor([g.prompt_ids + s.completion_ids], device="cuda")
            lp = token_logprobs(model, ids, torch.ones_like(ids), temperature=TEMPERATURE)[0]
            mine = lp[len(g.prompt_ids) - 1 :].float().cpu()
            diffs.append((mine - torch.tensor(s.logprobs)).abs())
    return torch.cat(diffs)


def test_refit_in_place_and_logprobs_match_the_learner(cfg, backend):
    figures = []
    for version, seed in ((1, 1), (2, 2)):
        model = learner_model(cfg, seed)
        index, payload = params_to_payload(model.named_parameters(), "bfloat16")
        backend.install(index, payload, version=version)
        gs = groups(backend.tokenizer)
        out = backend.generate(gs, max_new_tokens=48, temperature=TEMPERATURE)
        d = gaps(model, gs, out)
        figures.append(
            {
                "version": version,
                "tokens": int(d.numel()),
                "mean_abs": float(d.mean()),
                "p99_abs": float(d.quantile(0.99)),
                "max_abs": float(d.max()),
                "install": backend.last_install,
            }
        )
        # Against the *other* version the gap must be larger: the refit really changed weights.
        if version == 2:
            stale = gaps(learner_model(cfg, 1), gs, out)
            assert float(stale.mean()) > 2 * float(d.mean())
        assert float(d.mean()) < 0.05, figures[-1]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "logprob_gap.json").write_text(
        json.dumps(
            {
                "device": torch.cuda.get_device_name(),
                "host": platform.node(),
                "model": cfg.name,
                "temperature": TEMPERATURE,
                "dtype": "bfloat16",
                "runs": figures,
            },
            indent=2,
        )
    )
