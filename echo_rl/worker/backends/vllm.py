"""Rollouts with vLLM (``worker.backend = "vllm"``), for volunteers with a CUDA GPU.

The engine loads the same Hugging Face folder as the learner (``echo_rl.core.models.engine_model_dir``;
the tiny model is written to a cache folder first), and each verified snapshot is installed into
the running engine without a restart (``echo_rl/worker/backends/refit.py`` for the layout and names,
``echo_rl/worker/backends/vllm_ext.py`` for the engine side):

    payload -> /dev/shm file (64-byte-aligned tensors) -> collective_rpc("echo_refit") ->
    model.load_weights in the engine process -> reset_prefix_cache

Behaviour log-probs are vLLM's *processed* log-probs (``logprobs_mode="processed_logprobs"``:
after the temperature; top-k and top-p off), the distribution the sampler drew from, so the
learner's importance weights compare like with like (docs/worker.md, "vLLM backend"). Each
group is one request with ``n`` samples and the group's seed.

vLLM is imported here only, when this backend is chosen: the default install has no vLLM.
"""

from __future__ import annotations

import math
import os
import threading
import time
from typing import Any

from echo_rl.core import wire
from echo_rl.core.config import ModelConfig
from echo_rl.core.layout import TensorLayout
from echo_rl.core.models import engine_model_dir, load_tokenizer, vocab_size_of_folder
from echo_rl.worker.backends.base import (
    Backend,
    Sample,
    finish,
    group_budget,
    needs_tokens,
    plan_rows,
    regroup,
)
from echo_rl.worker.backends.refit import (
    RefitError,
    VersionBook,
    build_layout,
    checkpoint_names,
    tied_embeddings,
    write_shared,
)

EXTENSION = "echo_rl.worker.backends.vllm_ext.EchoRefitExtension"
INSTALL_HINT = (
    'worker.backend = "vllm" needs vLLM on a CUDA machine: '
    "pip install -e '.[vllm]' in an environment whose torch is the CUDA build of "
    'torch==2.13.0 (docs/worker.md, "vLLM backend"); or use worker.backend = '
    '"transformers"'
)


def sampled_logprobs(token_ids: list[int], logprobs: Any) -> list[float]:
    """The log-prob of each sampled token from a vLLM completion's ``logprobs`` (one mapping per
    position, token id -> object with ``.logprob``; with ``logprobs=0`` it holds the sampled
    token). A missing position or a NaN is an error: the learner cannot weight such a token."""
    if logprobs is None or len(logprobs) != len(token_ids):
        raise RefitError(
            f"vLLM returned {0 if logprobs is None else len(logprobs)} log-probs "
            f"for {len(token_ids)} tokens: the engine must run with logprobs=0"
        )
    out = []
    for pos, (tok, lp) in enumerate(zip(token_ids, logprobs)):
        entry = lp.get(tok) if hasattr(lp, "get") else None
        value = getattr(entry, "logprob", entry)
        if value is None or not math.isfinite(float(value)):
            raise RefitError(f"vLLM gave no finite log-prob for token {tok} at position {pos}")
        out.append(float(value))
    return out


def _vllm_types() -> tuple[Any, Any]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    return SamplingParams, TokensPrompt


def cut_at_eos(tokens: list[int], logps: list[float], eos: int | None) -> Sample:
    """Keep tokens up to and including the first end-of-sequence, as the transformers backend."""
    end = tokens.index(eos) + 1 if eos is not None and eos in tokens else len(tokens)
    return Sample(list(tokens[:end]), list(logps[:end]))


class VLLMBackend(Backend):
    def __init__(
        self,
        model_cfg: ModelConfig,
        threads: int = 1,
        device: str = "auto",
        gpu_memory_utilization: float = 0.5,
        llm: Any = None,
        types: tuple[Any, Any] | None = None,
        sleep_mode: bool = False,
    ):
        """``llm`` and ``types`` stand in for ``vllm.LLM`` and (``SamplingParams``,
        ``TokensPrompt``) in tests: the same methods and fields, no CUDA. ``sleep_mode``: the
        worker serves more runs than it keeps on the GPU (--resident), so ``park`` puts the
        engine to sleep (vLLM's sleep mode, level 1: weights to host memory, KV cache freed)
        and ``unpark`` wakes it."""
        self.tokenizer = load_tokenizer(model_cfg)
        self.model_dir = engine_model_dir(model_cfg)
        self.tied = tied_embeddings(self.model_dir)
        self.expected = checkpoint_names(self.model_dir)
        self.vocab_size = vocab_size_of_folder(self.model_dir)
        self.book = VersionBook()
        self.last_install: dict[str, Any] = {}
        self.sleep_mode, self.asleep = sleep_mode, False
        # A version that arrived while asleep: (entries, size, payload, version), loaded at
        # wake-up. Only the newest is kept.
        self._pending: tuple[Any, int, bytes, int] | None = None
        self.llm = llm if llm is not None else self._engine(device, gpu_memory_utilization)
        self.types = types or _vllm_types()

    def _engine(self, device: str, gpu_memory_utilization: float) -> Any:
        try:
            from vllm import LLM
        except ImportError as exc:
            raise RefitError(f"{INSTALL_HINT} ({exc})") from None
        if device not in ("auto", "cuda") and not device.startswith("cuda"):
            raise RefitError(
                f"worker.device = {device!r}: the vLLM backend runs on a CUDA GPU; "
                f'set worker.device = "cuda" or use worker.backend = "transformers"'
            )
        if device.startswith("cuda:"):  # before CUDA starts: the engine's processes inherit it
            os.environ.setdefault("CUDA_VISIBLE_DEVICES", device.split(":", 1)[1])
        import torch

        if not torch.cuda.is_available():
            raise RefitError(
                f'worker.backend = "vllm" found no CUDA GPU (torch '
                f'{torch.__version__}); use worker.backend = "transformers" on '
                f"this machine, or install the CUDA build of torch==2.13.0"
            )
        return LLM(
            model=str(self.model_dir),
            dtype="bfloat16",
            seed=0,
            worker_extension_cls=EXTENSION,
            logprobs_mode="processed_logprobs",
            enable_prefix_caching=True,
            gpu_memory_utilization=gpu_memory_utilization,
            enable_sleep_mode=self.sleep_mode,
        )

    def restrict_answers(self, tokens: tuple[int, ...] | None) -> None:
        # vLLM's allowed_token_ids masks sampling, but whether its reported log-probs are
        # renormalised over the set depends on its logprobs mode; untested here (no GPU in CI),
        # so a restricted adapter is refused rather than audited as a liar.
        if tokens is not None:
            raise ValueError(
                "the adapter restricts answers (echo_rl/data/answers.py), which the vllm "
                "backend does not support yet: run this worker with "
                "--backend transformers"
            )
        Backend.restrict_answers(self, None)

    def park(self) -> None:
        """Off the GPU between this run's turns (echo_rl/worker/sharing.py). Without sleep mode the
        engine stays where it is: then --resident must cover every run of the process."""
        if self.sleep_mode and not self.asleep:
            with self.book.paused():  # after the generation in flight, if any
                self.llm.sleep(level=1)
                self.asleep = True

    def unpark(self) -> None:
        if not self.asleep:
            return
        with self.book.paused():
            self.llm.wake_up()
            self.asleep = False
            self.llm.reset_prefix_cache()  # the cache's blocks were freed at sleep
        pending, self._pending = self._pending, None
        if pending is not None:
            self._refit(*pending)

    def install(
        self, tensors: list[TensorLayout], payload: bytes | bytearray, version: int = -1
    ) -> None:
        entries, size = build_layout(tensors, self.tied, self.expected)
        if self.asleep:
            # The engine's weights are in host memory now, out of the refit's reach: load
            # this version when the run's turn wakes the engine, before it generates.
            self._pending = (entries, size, bytes(payload), version)
            return
        self._refit(entries, size, payload, version)

    def _refit(self, entries: Any, size: int, payload: bytes | bytearray, version: int) -> None:
        t0 = time.monotonic()
        path = write_shared(entries, size, payload, tag=f"{os.getpid()}-")
        t_write = time.monotonic() - t0
        try:
            with self.book.installing(version):
                t1 = time.monotonic()
                reports = self.llm.collective_rpc(
                    "echo_refit", args=(str(path), [e.wire() for e in entries], size)
                )
                for rep in reports:
                    if rep.get("n_untouched"):
                        raise RefitError(
                            f"the snapshot left {rep['n_untouched']} engine "
                            f"parameters unloaded (e.g. {rep['untouched'][:3]}): "
                            f"worker and learner must use the same model.name"
                        )
                # Cached prefixes hold keys and values of the old weights.
                self.llm.reset_prefix_cache()
                self.last_install = {
                    "version": version,
                    "bytes": size,
                    "write_s": t_write,
                    "load_s": time.monotonic() - t1,
                }
        finally:
            path.unlink(missing_ok=True)

    def generate(
        self,
        groups: list[wire.Group],
        max_new_tokens: int,
        temperature: float,
        stop: threading.Event | None = None,
        tail: float = 0.0,
    ) -> list[list[Sample]]:
        """``stop`` and ``tail`` are not seen inside the engine's call (it runs the whole
        batch, and schedules continuously, so a long tail holds no batch slot): a worker
        on vLLM hands back whole groups, not prefixes, unless its grace outlasts a rollout.
        Groups with prefixes are continued one sample per request (docs/preemption.md)."""
        if self.asleep:  # echo_rl/worker/sharing.py brings a run's model on before its rollout
            raise RefitError("the engine is asleep (parked): unpark it before generating")
        if any(g.prefixes for g in groups):
            return self._continue(groups, max_new_tokens, temperature)
        SamplingParams, TokensPrompt = self.types
        eos = self.tokenizer.eos_token_id
        params = [
            SamplingParams(
                n=g.n,
                temperature=temperature,
                top_p=1.0,
                top_k=0,
                max_tokens=group_budget(g, max_new_tokens),
                logprobs=0,
                seed=g.seed,
                stop_token_ids=[eos] if eos is not None else None,
            )
            for g in groups
        ]
        with self.book.dispatch() as version:
            prompts = [
                TokensPrompt(prompt_token_ids=list(g.prompt_ids), cache_salt=f"v{version}")
                for g in groups
            ]
            outs = self.llm.generate(prompts, params, use_tqdm=False)
        return [
            [
                cut_at_eos(list(c.token_ids), sampled_logprobs(list(c.token_ids), c.logprobs), eos)
                for c in o.outputs
            ]
            for o in outs
        ]

    def _continue(
        self, groups: list[wire.Group], max_new_tokens: int, temperature: float
    ) -> list[list[Sample]]:
        SamplingParams, TokensPrompt = self.types
        eos = self.tokenizer.eos_token_id
        rows = plan_rows(groups, max_new_tokens)
        todo = [r for r in rows if needs_tokens(r, eos)]
        params = [
            SamplingParams(
                n=1,
                temperature=temperature,
                top_p=1.0,
                top_k=0,
                max_tokens=r.budget,
                logprobs=0,
                seed=groups[r.group].seed + r.sample_idx,
                stop_token_ids=[eos] if eos is not None else None,
            )
            for r in todo
        ]
        new: dict[int, tuple[list[int], list[float]]] = {}
        if todo:
            with self.book.dispatch() as version:
                prompts = [
                    TokensPrompt(prompt_token_ids=r.prompt, cache_salt=f"v{version}") for r in todo
                ]
                outs = self.llm.generate(prompts, params, use_tqdm=False)
            for r, o in zip(todo, outs):
                c = o.outputs[0]
                new[id(r)] = (list(c.token_ids), sampled_logprobs(list(c.token_ids), c.logprobs))
        samples = [finish(r, *new.get(id(r), ([], [])), eos, False) for r in rows]
        return regroup(groups, rows, samples)
