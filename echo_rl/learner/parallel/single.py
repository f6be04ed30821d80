"""One process, one device: nothing to shard or gather.

On a GPU with bf16 the weights and Adam's moments stay float32 (small updates survive) and the
forward runs under bf16 autocast: hooks on the model enter autocast for each forward call and
leave it when the call returns, so the backward and the optimizer run outside it, as autocast
asks. The hooks are plain closures, so the reference model's ``deepcopy`` carries its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from echo_rl.learner.parallel.base import Parallel

if TYPE_CHECKING:
    from torch.optim import Optimizer


class Single(Parallel):
    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)

    def wrap(self, model: torch.nn.Module) -> Any:
        from echo_rl.core.models import bf16_compute

        model = model.to(self.device)
        if bf16_compute(self.device):
            autocast_forward(model, self.device.type, torch.bfloat16)
        return model

    def live_state(self, model: torch.nn.Module, optimizer: Optimizer) -> tuple[dict, dict]:
        return model.state_dict(), optimizer.state_dict()

    def full_state(self, model: torch.nn.Module, optimizer: Optimizer) -> tuple[dict, dict]:
        # host copies: checkpoints and snapshots are built in host memory (a no-op on the CPU)
        return to_cpu(model.state_dict()), to_cpu(optimizer.state_dict())

    def load_state(
        self,
        model: torch.nn.Module,
        optimizer: Optimizer,
        model_sd: dict,
        optim_sd: dict,
        strict: bool = True,
    ) -> None:
        model.load_state_dict(
            model_sd, strict=strict
        )  # copies into the parameters, on their device
        optimizer.load_state_dict(optim_sd)  # casts the moments to their parameter's device

    def broadcast(self, obj: Any) -> Any:
        return obj

    def all_sum(self, values: torch.Tensor) -> torch.Tensor:
        return values


def autocast_forward(model: torch.nn.Module, device_type: str, dtype: torch.dtype) -> None:
    """Run every ``model(...)`` call under ``torch.autocast(device_type, dtype)``."""
    active: list[torch.autocast] = []

    def enter(module: Any, args: Any, kwargs: Any) -> None:
        ctx = torch.autocast(device_type, dtype=dtype)
        ctx.__enter__()
        active.append(ctx)

    def leave(module: Any, args: Any, kwargs: Any, output: Any) -> None:
        active.pop().__exit__(None, None, None)  # always_call: also when forward raised

    model.register_forward_pre_hook(enter, with_kwargs=True)
    model.register_forward_hook(leave, with_kwargs=True, always_call=True)


def to_cpu(obj: Any) -> Any:
    """``obj`` with every tensor in it copied to host memory (same tensors when already there)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj
