"""What a learner or a worker will need in host memory, said at start-up and kept to a budget
(``learner.host_memory_gb``, ``echo-worker join --host-memory-gb``; docs/memory.md).

The figures are the ones docs/memory.md measures (benchmarks/memory.py): a fixed part for
Python, torch and transformers; the learner's training state (float32 weights, gradients and
Adam's two moments of what it trains); one payload; and the step's transients: activations kept
for backward, which grow with ``learner.micro_batch_rows`` rows of ``seq_tokens`` tokens, or,
with ``learner.gradient_checkpointing``, each layer's input plus one layer recomputed. The
activation constants were calibrated on the 0.42 B model of docs/memory.md; they are estimates,
and the measured peak in every metrics row (``memory.rss_peak``) is what to trust.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, replace
from pathlib import Path

from echo_rl.core.errors import EchoError

GIB = 1 << 30
FIXED_BYTES = GIB // 2  # Python, torch, transformers: 0.40 GiB measured with the tiny model
# Float32 activations kept for backward, bytes per (token x layer x hidden unit): 99 on
# SmolLM2-135M, 4 rows of 256 tokens (benchmarks/step_memory.py,
# results/step_memory_smollm2-135m-instruct.json).
ACT_BYTES = 99
# With gradient checkpointing, per (token x layer x hidden unit): 20 measured (same file), plus
# one layer's full activations while it is recomputed in backward.
CHECKPOINT_BYTES = 20
# The step's other transients, bytes per trained parameter (Adam's per-tensor temporaries, the
# gradients' accumulation, the allocator's slack): 3.3 at 0.42 B parameters, where one pass's
# activations fit in the room the freed gradients leave (step_memory_random-0.4b.json), 2.6 on
# SmolLM2; the larger is taken.
STEP_BYTES_PER_TRAINED = 3.3


class MemoryBudgetError(EchoError, ValueError):
    """The process cannot fit its budget with any setting it may change by itself."""

    default_reason = "memory_budget"


@dataclass(frozen=True)
class ModelShape:
    params: int  # all parameters (tied weights once)
    trained: int  # parameters with gradients (all, or a LoRA adapter's)
    layers: int
    hidden: int


@dataclass(frozen=True)
class LearnerPlan:
    shape: ModelShape
    payload: int  # bytes of one published version
    rows: int  # rows per forward and backward pass (micro-batch)
    minibatch_rows: int  # rows of a mini-batch on this rank
    seq_tokens: int  # tokens per row assumed
    checkpointing: bool
    extra_models: int = 0  # float32 copies beside the policy (reference model, audit copy)
    versions_in_ram: int = 0  # payloads held as bytes (learner.spill_payloads = false)

    def activations(self) -> int:
        """What one pass keeps for backward."""
        units = self.rows * self.seq_tokens * self.shape.hidden
        if self.checkpointing:
            return units * (self.shape.layers * CHECKPOINT_BYTES + ACT_BYTES)
        return units * self.shape.layers * ACT_BYTES

    def breakdown(self) -> dict[str, int]:
        n, t = self.shape.params, self.shape.trained
        acts = self.activations()
        if self.rows >= self.minibatch_rows and not self.checkpointing:
            # one pass: its forward runs after the step frees the previous gradients, in the
            # room they leave (with checkpointing the recomputation runs as gradients are made)
            acts = max(0, acts - 4 * t)
        return {
            "fixed": FIXED_BYTES,
            "training_state": 4 * n + 12 * t,
            "other_models": 4 * n * self.extra_models,
            "payloads": self.payload * (1 + self.versions_in_ram),
            "step": acts + int(STEP_BYTES_PER_TRAINED * t),
        }

    @property
    def total(self) -> int:
        return sum(self.breakdown().values())

    def describe(self) -> str:
        b = self.breakdown()
        return (
            f"about {gib(self.total)} of host memory: training state {gib(b['training_state'])}"
            f"{', reference/audit copies ' + gib(b['other_models']) if b['other_models'] else ''}, "
            f"payloads {gib(b['payloads'])}, step {gib(b['step'])} ({self.rows} rows of up to "
            f"{self.seq_tokens} tokens a pass, gradient checkpointing "
            f"{'on' if self.checkpointing else 'off'}), fixed {gib(b['fixed'])}"
        )


def fit_learner(plan: LearnerPlan, budget_gb: float) -> LearnerPlan:
    """The plan itself when it fits ``budget_gb`` (0: no budget); else the same run with
    gradient checkpointing on, then fewer rows a pass, whichever fits first. Raises
    MemoryBudgetError naming what the run needs when nothing does."""
    if budget_gb <= 0 or plan.total <= budget_gb * GIB:
        return plan
    tries = [replace(plan, checkpointing=True)]
    rows = plan.rows
    while rows > 1:
        rows = max(1, rows // 2)
        tries.append(replace(plan, checkpointing=True, rows=rows))
    for t in tries:
        if t.total <= budget_gb * GIB:
            return t
    least = tries[-1]
    raise MemoryBudgetError(
        f"learner.host_memory_gb = {budget_gb:g}, but this run needs {least.describe()} even with "
        f"gradient checkpointing and one row a pass. Fix: raise learner.host_memory_gb (0: no "
        f"budget), train a LoRA adapter (learner.lora.enabled = true), or use a smaller model"
    )


@dataclass(frozen=True)
class WorkerPlan:
    params: int
    dtype_bytes: int  # the worker's model: 4 (float32) or 2 (bfloat16)
    payload: int  # one version's payload in the broadcast dtype
    spill: bool
    model_on_host: bool = True  # False: the model is in GPU memory

    def breakdown(self) -> dict[str, int]:
        # the installed version's full payload is spilled (a file) unless --no-spill; a version
        # being received is in RAM
        return {
            "fixed": FIXED_BYTES,
            "model": self.params * self.dtype_bytes if self.model_on_host else 0,
            "payloads": self.payload * (1 if self.spill else 2),
        }

    @property
    def total(self) -> int:
        return sum(self.breakdown().values())

    def describe(self) -> str:
        b = self.breakdown()
        kind = {4: "float32", 2: "bfloat16"}.get(self.dtype_bytes, f"{self.dtype_bytes}-byte")
        where = (
            f"model {gib(b['model'])} in {kind}"
            if self.model_on_host
            else f"model in GPU memory ({gib(self.params * self.dtype_bytes)} in {kind})"
        )
        return (
            f"about {gib(self.total)} of host memory: {where}, "
            f"payloads {gib(b['payloads'])}, fixed {gib(b['fixed'])}"
        )


def fit_worker(plan: WorkerPlan, budget_gb: float, dtype_fixed: bool) -> WorkerPlan:
    """The plan when it fits ``budget_gb`` (0: no budget); else, when the dtype is the worker's
    to choose (``worker.dtype = auto``), the model in bfloat16. MemoryBudgetError otherwise."""
    if budget_gb <= 0 or plan.total <= budget_gb * GIB:
        return plan
    if not dtype_fixed and plan.dtype_bytes > 2 and plan.model_on_host:
        half = replace(plan, dtype_bytes=2)
        if half.total <= budget_gb * GIB:
            return half
        plan = half
    raise MemoryBudgetError(
        f"--host-memory-gb {budget_gb:g}, but serving this run needs {plan.describe()}. Fix: "
        f"join from a machine with more memory, raise --host-memory-gb, or leave it out "
        f"(no budget)"
    )


class HostBudget:
    """One process's ``--host-memory-gb`` shared by the runs it serves (docs/multirun.md):
    the fixed part counted once, each run's model and payloads on top. Every joined run's model
    is counted in host memory, even on a GPU: a run not resident on the device is parked
    there (``--resident``). LoRA runs on one base hold it once (echo_rl/worker/backends/shared_base.py),
    so a run whose base another run already holds books its adapter and payloads only."""

    def __init__(self, budget_gb: float):
        self.budget_gb = budget_gb
        self.runs: dict[str, int] = {}  # run -> bytes it needs beyond the fixed part
        self.bases: dict[str, str] = {}  # base hash -> the run whose loaded model holds it
        self._model: dict[str, tuple[int, int]] = {}  # run -> (model bytes booked, in full)
        self._lock = threading.Lock()  # runs load their models on their own threads

    def fit(
        self, run: str, plan: WorkerPlan, dtype_fixed: bool, base: str | None = None
    ) -> WorkerPlan:
        """``run``'s plan (maybe in bfloat16) within what the other runs leave; booked.
        ``base``: its LoRA base's hash when known before loading (a fetched base's manifest).
        MemoryBudgetError naming the others when it cannot fit."""
        with self._lock:
            plan = replace(plan, model_on_host=True)
            holder = self.bases.get(base) if base else None
            on_base = holder is not None and holder != run and holder in self.runs
            fitted = self._fit(run, replace(plan, params=0) if on_base else plan, dtype_fixed)
            full = plan.params * fitted.dtype_bytes
            self._model[run] = (0 if on_base else full, full)
            return replace(fitted, params=plan.params) if on_base else fitted

    def loaded(self, run: str, base: str | None, saved: int) -> None:
        """``run``'s model is loaded: ``base`` (its LoRA base hash, None for a whole model)
        now held for the runs after it, and the ``saved`` bytes its base shares with another
        run's taken off its booking. A run booked on a shared base that did not share it
        (another dtype) is booked in full: MemoryBudgetError when that no longer fits."""
        with self._lock:
            booked, full = self._model.get(run, (0, 0))
            if base:
                self.bases.setdefault(base, run)
            if saved and booked:
                self.runs[run] -= min(saved, booked)
                self._model[run] = (booked - min(saved, booked), full)
            elif not saved and not booked and full and run in self.runs:
                left = self.budget_gb * GIB - FIXED_BYTES - sum(self.runs.values())
                if self.budget_gb > 0 and full > left:
                    raise MemoryBudgetError(
                        f"{run}'s LoRA base could not be shared with the other runs' (another "
                        f"dtype) and its own {gib(full)} does not fit --host-memory-gb "
                        f"{self.budget_gb:g}. Fix: join it with the same --dtype as the "
                        f"others, raise --host-memory-gb, or join fewer runs"
                    )
                self.runs[run] += full
                self._model[run] = (full, full)

    def _fit(self, run: str, plan: WorkerPlan, dtype_fixed: bool) -> WorkerPlan:
        others = {r: b for r, b in self.runs.items() if r != run}
        left = self.budget_gb - sum(others.values()) / GIB
        if self.budget_gb > 0 and others and left * GIB < plan.total:
            try:
                fitted = fit_worker(plan, left, dtype_fixed)
            except MemoryBudgetError:
                taken = ", ".join(f"{r} {gib(b)}" for r, b in others.items())
                raise MemoryBudgetError(
                    f"--host-memory-gb {self.budget_gb:g} is shared by the runs this process "
                    f"serves: {taken} already, and serving {run} needs {plan.describe()}. "
                    f"Fix: join fewer runs, raise --host-memory-gb, or leave it out (no budget)"
                ) from None
        else:
            fitted = fit_worker(plan, self.budget_gb, dtype_fixed)
        self.runs[run] = fitted.total - FIXED_BYTES
        return fitted


def folder_params(folder: str | Path) -> int:
    """Parameters in a Hugging Face folder's safetensors files, from their headers only
    (8-byte length, then JSON): no torch, no weights read. 0 when there are none."""
    from echo_rl.core.models import safetensors_header

    total = 0
    for f in sorted(Path(folder).glob("*.safetensors")):
        for k, v in safetensors_header(f).items():  # name -> {dtype, shape, data_offsets}
            if k != "__metadata__" and isinstance(v, dict) and isinstance(v["shape"], list):
                total += math.prod(d for d in v["shape"] if isinstance(d, int))
    return total


def gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB // 10 else f"{n / (1 << 20):.1f} MiB"
