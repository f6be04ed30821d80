"""The vLLM backend's CPU-testable parts: name mapping, the shared-memory layout, the engine-side
refit (run here on a transformers model standing in for vLLM's), and version bookkeeping.

The GPU half (a real engine) is tests/test_vllm_gpu.py, marked ``gpu``.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from echo_rl.core import wire
from echo_rl.core.config import ModelConfig, load_config
from echo_rl.core.models import (
    build_tiny_tokenizer,
    engine_model_dir,
    load_model,
    params_to_payload,
    vocab_size_of_folder,
)
from echo_rl.worker.backends import make_backend
from echo_rl.worker.backends.refit import (
    ALIGN,
    RefitError,
    VersionBook,
    build_layout,
    checkpoint_names,
    map_names,
    tied_embeddings,
    write_shared,
)
from echo_rl.worker.backends.vllm import VLLMBackend, cut_at_eos, sampled_logprobs
from echo_rl.worker.backends.vllm_ext import EchoRefitExtension, iter_tensors

SMOLLM2 = Path("models/smollm2-135m-instruct")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return engine_model_dir(ModelConfig(), tmp_path_factory.mktemp("echo-home"))


def snapshot(model: Any, dtype: str = "bfloat16") -> tuple[list[dict[str, Any]], bytes]:
    return params_to_payload(model.named_parameters(), dtype)


def perturbed(seed: int) -> Any:
    model = load_model(ModelConfig(), build_tiny_tokenizer())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return model


# ----------------------------------------------------------------------------- names


def test_names_lose_wrapper_prefixes_and_a_tied_head():
    index = [
        {"name": "_orig_mod.model.embed_tokens.weight"},
        {"name": "module.model.norm.weight"},
        {"name": "lm_head.weight"},
    ]
    names = [n for _, n in map_names(index, tied=True)]
    assert names == ["model.embed_tokens.weight", "model.norm.weight"]
    assert [n for _, n in map_names(index, tied=False)][-1] == "lm_head.weight"


def test_a_snapshot_of_another_model_is_refused_naming_the_difference():
    index = [{"name": "model.embed_tokens.weight"}, {"name": "model.extra.weight"}]
    with pytest.raises(
        RefitError, match=r"missing \['model.norm.weight'\].*unexpected \['model.extra.weight'\]"
    ):
        map_names(index, tied=True, expected={"model.embed_tokens.weight", "model.norm.weight"})
    with pytest.raises(RefitError, match="twice"):
        map_names([{"name": "module.a"}, {"name": "a"}], tied=False)


def test_the_tiny_snapshot_matches_its_engine_folder_names(tiny_dir):
    index, _ = snapshot(load_model(ModelConfig(), build_tiny_tokenizer()))
    expected = checkpoint_names(tiny_dir)
    assert tied_embeddings(tiny_dir)
    mapped = {n for _, n in map_names(index, tied=True, expected=expected)}
    assert mapped == expected - {"lm_head.weight"}
    assert vocab_size_of_folder(tiny_dir) == len(build_tiny_tokenizer())


@pytest.mark.skipif(
    not (SMOLLM2 / "config.json").is_file(),
    reason="SmolLM2 folder absent: echo-rl model import-gguf writes it (README)",
)
def test_the_real_smollm2_snapshot_matches_its_checkpoint_names():
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(SMOLLM2, dtype=torch.bfloat16)
    index = [
        {
            "name": n,
            "dtype": "bfloat16",
            "shape": list(p.shape),
            "offset": 0,
            "nbytes": p.numel() * 2,
        }
        for n, p in model.named_parameters()
    ]
    names = {n for _, n in map_names(index, tied_embeddings(SMOLLM2), checkpoint_names(SMOLLM2))}
    assert len(names) == len(checkpoint_names(SMOLLM2)) == 272


# ----------------------------------------------------------------------------- layout


def test_the_shared_file_holds_every_tensor_aligned_and_bit_exact(tmp_path):
    model = perturbed(1)
    for dtype in ("bfloat16", "float32"):
        index, payload = snapshot(model, dtype)
        entries, size = build_layout(index, tied=True)
        assert all(e.offset % ALIGN == 0 for e in entries) and size % ALIGN == 0
        path = write_shared(entries, size, payload, folder=tmp_path)
        assert path.stat().st_size == size
        params = dict(model.named_parameters())
        got = dict(iter_tensors(str(path), [e.wire() for e in entries], size, "cpu"))
        assert set(got) == set(params)
        for name, t in got.items():
            assert torch.equal(t, params[name].detach().to(getattr(torch, dtype)))
        path.unlink()


def test_a_malformed_index_is_refused_before_anything_is_written(tmp_path):
    index, payload = snapshot(perturbed(1))
    bad = [dict(index[0], nbytes=index[0]["nbytes"] + 2)] + index[1:]
    with pytest.raises(RefitError, match="bytes, the index says"):
        build_layout(bad, tied=True)
    with pytest.raises(RefitError, match="dtype 'int8'"):
        build_layout([dict(index[0], dtype="int8")], tied=True)
    entries, size = build_layout(index, tied=True)
    with pytest.raises(RefitError, match="payload ends"):
        write_shared(entries, size, payload[:-10], folder=tmp_path)
    assert list(tmp_path.iterdir()) == []  # the half-written file is gone


# ----------------------------------------------------------------------------- engine side


class EngineModel(torch.nn.Module):
    """A transformers model with vLLM's ``load_weights`` contract: (name, tensor) pairs in,
    the set of loaded parameter names out."""

    def __init__(self, model: Any):
        super().__init__()
        self.inner = model

    def load_weights(self, weights):
        params = dict(self.inner.named_parameters())
        loaded = set()
        for name, t in weights:
            params[name].data.copy_(t.to(params[name].dtype))
            loaded.add(name)
        return loaded

    def named_parameters(self, *a, **kw):
        return self.inner.named_parameters(*a, **kw)


def fake_engine_worker() -> Any:
    base = load_model(ModelConfig(), build_tiny_tokenizer())
    worker = EchoRefitExtension()
    worker.model_runner = SimpleNamespace(model=SimpleNamespace(runnable=EngineModel(base)))
    worker.device = "cpu"
    return worker, base


def test_the_extension_loads_the_shared_file_into_the_engine_model(tmp_path):
    worker, base = fake_engine_worker()
    index, payload = snapshot(perturbed(2), "float32")
    entries, size = build_layout(index, tied=True)
    path = write_shared(entries, size, payload, folder=tmp_path)
    report = worker.echo_refit(str(path), [e.wire() for e in entries], size)
    assert report == {"loaded": len(entries), "untouched": [], "n_untouched": 0}
    target = dict(perturbed(2).named_parameters())
    assert all(torch.equal(p, target[n]) for n, p in base.named_parameters())

    partial = [e.wire() for e in entries if e.name != "model.norm.weight"]
    report = worker.echo_refit(str(path), partial, size)
    assert report["n_untouched"] == 1 and report["untouched"] == ["model.norm.weight"]


# ----------------------------------------------------------------------------- backend


@dataclass
class FakeLLM:
    """``vllm.LLM``'s surface, with the refit running through the real extension on CPU."""

    worker: Any
    calls: list[str] = field(default_factory=list)
    seen_files: list[bool] = field(default_factory=list)
    paths: list[Path] = field(default_factory=list)
    gate: threading.Event | None = None
    started: threading.Event = field(default_factory=threading.Event)
    tokens: list[int] = field(default_factory=lambda: [7, 8, 1, 9])

    def collective_rpc(self, method, args=(), kwargs=None, timeout=None):
        self.calls.append(method)
        self.paths.append(Path(args[0]))
        self.seen_files.append(Path(args[0]).is_file())
        return [getattr(self.worker, method)(*args)]

    def reset_prefix_cache(self):
        self.calls.append("reset_prefix_cache")
        return True

    def sleep(self, level=1):  # vLLM's sleep mode (docs/multirun.md, "Residency")
        self.calls.append(f"sleep{level}")

    def wake_up(self, tags=None):
        self.calls.append("wake_up")

    def generate(self, prompts, params, use_tqdm=False):
        self.calls.append("generate")
        self.started.set()
        if self.gate is not None:
            assert self.gate.wait(30)
        outs = []
        for prompt, sp in zip(prompts, params):
            self.calls.append(prompt.cache_salt)
            comps = [
                SimpleNamespace(
                    token_ids=list(self.tokens),
                    logprobs=[
                        {t: SimpleNamespace(logprob=-0.5 - i)} for i, t in enumerate(self.tokens)
                    ],
                )
                for _ in range(sp.n)
            ]
            outs.append(SimpleNamespace(outputs=comps))
        return outs


@dataclass
class Params:
    n: int
    temperature: float
    top_p: float
    top_k: int
    max_tokens: int
    logprobs: int
    seed: int
    stop_token_ids: list[int] | None


@dataclass
class Prompt:
    prompt_token_ids: list[int]
    cache_salt: str


def fake_backend(
    tmp_path, monkeypatch, sleep_mode: bool = False, **llm_kw
) -> tuple[VLLMBackend, FakeLLM]:
    monkeypatch.setenv("ECHO_HOME", str(tmp_path / "home"))
    worker, _ = fake_engine_worker()
    llm = FakeLLM(worker, **llm_kw)
    backend = VLLMBackend(ModelConfig(), llm=llm, types=(Params, Prompt), sleep_mode=sleep_mode)
    return backend, llm


def group(gid: str = "g0", n: int = 2) -> wire.Group:
    return wire.Group(group_id=gid, prompt_ids=[2, 5, 6], n=n, seed=11, task={})


def test_install_then_generate_stamps_the_version_and_resets_the_prefix_cache(
    tmp_path, monkeypatch
):
    backend, llm = fake_backend(tmp_path, monkeypatch)
    with pytest.raises(RefitError, match="no snapshot installed"):
        backend.generate([group()], 4, 1.0)
    index, payload = snapshot(perturbed(3))
    backend.install(index, payload, version=5)
    assert llm.calls == ["echo_refit", "reset_prefix_cache"] and llm.seen_files == [True]
    assert not llm.paths[0].exists()  # the shared file is unlinked once loaded
    assert backend.book.version == 5 and backend.last_install["version"] == 5
    out = backend.generate([group("a"), group("b", n=3)], 4, 1.0)
    assert [len(s) for s in out] == [2, 3]
    assert llm.calls[-2:] == ["v5", "v5"]  # prefix cache salted by version
    eos = backend.tokenizer.eos_token_id
    assert (
        eos == 1
        and out[0][0].completion_ids == [7, 8, 1]
        and out[0][0].logprobs == [-0.5, -1.5, -2.5]
    )


def test_an_install_that_leaves_engine_weights_untouched_is_refused(tmp_path, monkeypatch):
    backend, llm = fake_backend(tmp_path, monkeypatch)
    index, payload = snapshot(perturbed(3))
    backend.install(index, payload, version=1)
    model = llm.worker.model_runner.model.runnable
    model.load_weights = lambda weights: {n for n, _ in weights if n != "model.norm.weight"}
    with pytest.raises(RefitError, match="left 1 engine parameters unloaded"):
        backend.install(index, payload, version=2)
    assert backend.book.version == 1  # still the old version: generation stays honest


def test_an_install_waits_for_the_generation_in_flight_which_keeps_its_version(
    tmp_path, monkeypatch
):
    backend, llm = fake_backend(tmp_path, monkeypatch, gate=threading.Event())
    index, payload = snapshot(perturbed(3))
    backend.install(index, payload, version=1)
    results: dict[str, Any] = {}

    def gen():
        with backend.book.dispatch() as v:
            results["dispatched"] = v
        results["out"] = backend.generate([group()], 4, 1.0)

    def inst():
        backend.install(index, payload, version=2)
        results["installed_during_generation"] = not llm.gate.is_set()

    g = threading.Thread(target=gen)
    g.start()
    assert llm.started.wait(30)
    i = threading.Thread(target=inst)
    i.start()
    i.join(0.2)  # the install must be blocked behind the generation
    assert i.is_alive() and backend.book.version == 1
    llm.gate.set()
    g.join(30)
    i.join(30)
    assert llm.calls.index("v1") < llm.calls.index("echo_refit", 2)
    assert results["installed_during_generation"] is False and backend.book.version == 2
    assert backend.book.installs == 2 and backend.book.policy == "finish"


def test_logprob_extraction_refuses_missing_or_nan_values():
    lp = [{3: SimpleNamespace(logprob=-0.1)}, {4: SimpleNamespace(logprob=-0.2)}]
    assert sampled_logprobs([3, 4], lp) == [-0.1, -0.2]
    with pytest.raises(RefitError, match="2 log-probs for 3 tokens"):
        sampled_logprobs([3, 4, 5], lp)
    with pytest.raises(RefitError, match="position 1"):
        sampled_logprobs([3, 4], [lp[0], {4: SimpleNamespace(logprob=math.nan)}])
    with pytest.raises(RefitError, match="token 9"):
        sampled_logprobs([3, 9], lp)
    assert cut_at_eos([5, 1, 6], [0.1, 0.2, 0.3], 1).completion_ids == [5, 1]
    assert cut_at_eos([5, 6], [0.1, 0.2], 1).logprobs == [0.1, 0.2]


def test_version_book_refuses_generation_before_the_first_install():
    book = VersionBook()
    with pytest.raises(RefitError):
        with book.dispatch():
            pass
    with book.installing(3):
        pass
    with book.dispatch() as v:
        assert v == 3


# ----------------------------------------------------------------------------- set-up


def test_the_engine_folder_is_written_once_and_reloads_the_same_weights(tmp_path):
    cfg = ModelConfig()
    first = engine_model_dir(cfg, tmp_path)
    stamp = (first / "config.json").stat().st_mtime_ns
    assert engine_model_dir(cfg, tmp_path) == first
    assert (first / "config.json").stat().st_mtime_ns == stamp
    assert engine_model_dir(ModelConfig(seed=1), tmp_path) != first
    from transformers import AutoModelForCausalLM, AutoTokenizer

    again = AutoModelForCausalLM.from_pretrained(first)
    ref = load_model(cfg, build_tiny_tokenizer())
    assert all(
        torch.equal(a, b) for a, b in zip(again.state_dict().values(), ref.state_dict().values())
    )
    tok = AutoTokenizer.from_pretrained(first)
    assert tok.encode("12+3") == build_tiny_tokenizer().encode("12+3")


def test_choosing_vllm_without_it_says_how_to_install(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    try:
        import vllm  # noqa: F401

        pytest.skip("vLLM is installed here")
    except ImportError:
        pass
    monkeypatch.setenv("ECHO_HOME", str(tmp_path))
    with pytest.raises(RefitError, match=r"pip install -e '\.\[vllm\]'.*torch==2\.13\.0"):
        make_backend("vllm", model_cfg=ModelConfig(), device="auto")


def test_config_and_cli_accept_vllm_and_name_bad_values(tmp_path):
    cfg = load_config(None, ['worker.backend="vllm"'])
    assert cfg.worker.backend == "vllm"
    with pytest.raises(Exception, match="worker.backend"):
        load_config(None, ['worker.backend="onnx"'])
    from echo_rl.cli.worker import build_parser, main

    args = build_parser().parse_args(
        ["join", "tcp://127.0.0.1:1", "--backend", "vllm", "--device", "cuda:1"]
    )
    assert (args.backend, args.device) == ("vllm", "cuda:1")
    assert (
        main(
            [
                "join",
                "tcp://127.0.0.1:1",
                "--insecure",
                "--device",
                "gpu0",
                "--identity",
                str(tmp_path / "k"),
            ]
        )
        == 2
    )


def test_the_default_set_up_never_installs_the_vllm_extra():
    """vLLM's wheels need the CUDA torch; the default set-up pins the CPU build, so the extra
    must stay out of it, and it must pin a vLLM whose torch requirement is that same version."""
    import re
    import tomllib

    root = Path(__file__).resolve().parent.parent
    make = (root / "Makefile").read_text()
    pins = set(re.findall(r"torch==([0-9.]+)", make))
    assert pins == {"2.13.0"}
    assert "vllm" not in make
    extra = tomllib.loads((root / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]["vllm"]
    assert extra == ["vllm==0.33.0"]  # requires torch==2.13.0 (PyPI metadata of vllm 0.33.0)
