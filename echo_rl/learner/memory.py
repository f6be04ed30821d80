"""The learner's host memory: what the run needs, said at start-up (echo_rl/core/memplan.py), and where
it goes, measured after every step into the metrics row (docs/memory.md)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from echo_rl.learner.policy import Policy
from echo_rl.learner.publisher import Publisher

if TYPE_CHECKING:
    import torch

    from echo_rl.core.config import LearnerConfig

log = logging.getLogger("echo.learner")


def say_memory_plan(policy: Policy, lc: LearnerConfig) -> None:
    """What the run needs in host memory (echo_rl/core/memplan.py), and what a budget changed."""
    plan = policy.memory_plan
    budget = f" (learner.host_memory_gb = {lc.host_memory_gb:g})" if lc.host_memory_gb else ""
    log.info("memory: this run needs %s%s", plan.describe(), budget)
    if policy.memory_refit:
        log.warning(
            "memory: to fit learner.host_memory_gb = %g, gradient checkpointing is on and "
            "%d rows go through the model at a time (learner.micro_batch_rows = %d)",
            lc.host_memory_gb,
            plan.rows,
            lc.micro_batch_rows,
        )


def memory(
    policy: Policy,
    publisher: Publisher,
    held_elsewhere: Sequence[object],
    audit_model: Sequence[torch.Tensor],
) -> dict[str, int]:
    """Where the learner's memory goes (docs/memory.md): its resident set, the training
    state, the audit model, and the published versions it holds (in RAM or spilled):
    ``held_elsewhere``, the server's and the auditor's payloads."""
    from echo_rl.core.memstat import payload_bytes, resident, tensor_bytes

    model, opt = policy.model, policy.trainer.optimizer
    base = publisher.encoder._base
    held = payload_bytes([*held_elsewhere, *([base[2]] if base else [])])
    return {
        **resident(),
        "model": tensor_bytes(model.parameters()),
        "grads": tensor_bytes(p.grad for p in model.parameters()),
        "optimizer": tensor_bytes(
            t for st in opt.state.values() for t in st.values() if hasattr(t, "untyped_storage")
        ),
        "audit_model": tensor_bytes(audit_model),
        "payloads_ram": held["ram"],
        "payloads_spilled": held["spilled"],
    }
