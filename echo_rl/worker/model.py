"""Loading the model a worker generates with: the backend, its dtype fitted to the volunteer's
memory budget (echo_rl/core/memplan.py), the base model of a LoRA run, and the adapter that scores.

Functions of their inputs (the learner's view of the config and the volunteer's choices), run
on a loader thread by the worker: no event loop, no session.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from echo_rl.broadcast.base_manifest import BaseManifest
from echo_rl.core.config import LoraConfig, ModelConfig
from echo_rl.data.adapter import Adapter, load_adapter
from echo_rl.data.answers import check_answer_tokens
from echo_rl.worker.backends import Backend, make_backend
from echo_rl.worker.base import BaseResult, mismatch
from echo_rl.worker.session import WorkerError

if TYPE_CHECKING:
    from echo_rl.core.memplan import HostBudget

log = logging.getLogger("echo.worker")


@dataclass(frozen=True)
class LoadChoice:
    """The volunteer's own choices over the learner's view: the hardware is theirs
    (echo-worker join --backend vllm --device cuda:1 --threads 4 --host-memory-gb 16)."""

    threads: int | None = None
    backend: str | None = None
    device: str | None = None
    host_memory_gb: float = 0.0  # 0: no budget
    spill: bool = False  # the relay spills payloads to disk (--spill-dir)
    # Several runs in one process: the budget they share, and this run's name in it.
    shared: HostBudget | None = None
    run: str = ""
    parks: bool = False  # more runs than --resident: the model moves to host memory and back


def fit_memory(
    model_name: str,
    dtype: str,
    device: str,
    lora: bool,
    *,
    choice: LoadChoice,
    version_bytes: tuple[int, str],
    view: dict[str, Any],
    base: str | None = None,
) -> str:
    """worker.dtype, resolved and fitted to --host-memory-gb (echo_rl/core/memplan.py: over budget
    an ``auto`` dtype becomes bfloat16); says what serving this run needs. ``version_bytes``:
    the run's full version, size and dtype, as the join said (size 0: none published yet)."""
    from echo_rl.core.memplan import MemoryBudgetError, WorkerPlan, fit_worker, folder_params
    from echo_rl.core.models import bf16_compute, resolve_device

    where = resolve_device(device, "worker.device")
    chosen = dtype if dtype != "auto" else ("bfloat16" if bf16_compute(where) else "float32")
    size, payload_dtype = version_bytes
    if not size:  # joined before the first version: the run's broadcast dtype
        payload_dtype = view.get("broadcast", {}).get("dtype", payload_dtype)
    elem = 4 if payload_dtype == "float32" else 2
    params = folder_params(model_name) if Path(model_name).is_dir() else 0
    params = params or (0 if lora else size // elem)  # a LoRA payload is the adapter only
    size = size or (0 if lora else params * elem)
    plan = WorkerPlan(
        params,
        4 if chosen == "float32" else 2,
        size,
        spill=choice.spill,
        model_on_host=where.type == "cpu",
    )
    budget_gb = choice.host_memory_gb
    try:
        fitted = (
            choice.shared.fit(choice.run, plan, dtype_fixed=dtype != "auto", base=base)
            if choice.shared is not None
            else fit_worker(plan, budget_gb, dtype_fixed=dtype != "auto")
        )
    except MemoryBudgetError as err:
        raise WorkerError(str(err)) from None
    budget = f" (--host-memory-gb {budget_gb:g})" if budget_gb else ""
    log.info("memory: serving this run needs %s%s", fitted.describe(), budget)
    if fitted.dtype_bytes < plan.dtype_bytes:
        log.warning(
            "memory: generating in bfloat16 instead of %s to fit --host-memory-gb %g",
            chosen,
            budget_gb,
        )
        return "bfloat16"
    return chosen


def load_model(
    view: dict[str, Any],
    choice: LoadChoice,
    *,
    version_bytes: tuple[int, str],
    base: BaseResult | None,
    base_manifest: BaseManifest | None,
) -> tuple[Backend, Adapter]:
    """The backend (with the base model ``base`` holds, for a LoRA run) and the run's adapter."""
    wv = view["worker"]
    threads = choice.threads or wv["torch_threads"]
    name = choice.backend or wv["backend"]
    extra: dict[str, Any] = (
        {"gpu_memory_utilization": wv.get("vllm_gpu_memory", 0.5), "sleep_mode": choice.parks}
        if name == "vllm"
        else {"dtype": wv.get("dtype", "auto")}
    )
    lora = LoraConfig(**view.get("lora", {}))
    if lora.enabled:  # versions are adapters: the backend holds the base and an adapter
        if name == "vllm":
            raise WorkerError(
                f"this run trains a LoRA adapter (learner.lora.enabled) and the "
                f"{name} backend does not apply adapters yet: join with "
                f"--backend engine"
            )
        extra["lora"] = lora
    model = dict(view["model"])
    if base is not None and base.folder is not None:
        model["name"] = str(base.folder)  # the base model from the cache or a fetch
    device = choice.device or wv.get("device", "auto")
    if "dtype" in extra:
        extra["dtype"] = fit_memory(
            model["name"],
            extra["dtype"],
            device,
            lora.enabled,
            choice=choice,
            version_bytes=version_bytes,
            view=view,
            base=base_manifest.base_model if base_manifest is not None else None,
        )
    backend = make_backend(
        name, model_cfg=ModelConfig(**model), threads=threads, device=device, **extra
    )
    if choice.shared is not None:  # a LoRA base shared with another run is booked once
        from echo_rl.core.memplan import MemoryBudgetError

        try:
            choice.shared.loaded(choice.run, backend.base_hash, getattr(backend, "shared_bytes", 0))
        except MemoryBudgetError as err:
            raise WorkerError(str(err)) from None
    if base is not None and base_manifest is not None:
        problem = mismatch(base_manifest, backend.base_hash, base)
        if problem:
            raise WorkerError(problem)
    adapter = load_adapter(
        view["adapter"]["name"], view["adapter"]["options"], backend.tokenizer, check_prompts=False
    )  # prompts are the learner's
    # the adapter's answer set, from the run's config as the learner builds it
    backend.restrict_answers(
        check_answer_tokens(
            adapter.answer_tokens,
            backend.vocab_size,
            wv["max_new_tokens"],
            backend.tokenizer.eos_token_id,
        )
    )
    return backend, adapter
