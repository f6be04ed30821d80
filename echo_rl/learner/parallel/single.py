"""One process, one device: nothing to shard or gather.

On a GPU with bf16 the weights and Adam's moments stay float32 (small updates survive) and the
forward runs under bf16 autocast: hooks on the model enter autocast for each forward call and
leave it when the call returns, so the backward and the optimizer run outside it, as autocast
asks. The hooks are plain closures, so the reference model's ``deepcopy`` carries its own.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import TYPE_CHECKING, TypeVar, cast

import torch
from torch.optim.optimizer import StateDict

from echo_rl.learner.parallel.base import FullState, ModelState, Parallel

if TYPE_CHECKING:
    from torch.optim import Optimizer

_T = TypeVar("_T")


class Single(Parallel):
    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        from echo_rl.core.models import bf16_compute

        model = model.to(self.device)
        if bf16_compute(self.device):
            autocast_forward(model, self.device.type, torch.bfloat16)
        return model

    def live_state(self, model: torch.nn.Module, optimizer: Optimizer) -> FullState:
        return model.state_dict(), optimizer.state_dict()

    def full_state(self, model: torch.nn.Module, optimizer: Optimizer) -> FullState:
        # host copies: checkpoints and snapshots are built in host memory (a no-op on the CPU)
        return to_cpu(model.state_dict()), to_cpu(optimizer.state_dict())

    def load_state(
        self,
        model: torch.nn.Module,
        optimizer: Optimizer,
        model_sd: ModelState,
        optim_sd: StateDict,
        strict: bool = True,
    ) -> None:
        model.load_state_dict(
            model_sd, strict=strict
        )  # copies into the parameters, on their device
        optimizer.load_state_dict(optim_sd)  # casts the moments to their parameter's device

    def broadcast(self, obj: _T) -> _T:
        return obj

    def all_sum(self, values: torch.Tensor) -> torch.Tensor:
        return values


def autocast_forward(model: torch.nn.Module, device_type: str, dtype: torch.dtype) -> None:
    """Run every ``model(...)`` call under ``torch.autocast(device_type, dtype)``."""
    active: list[ExitStack] = []

    def enter(module: torch.nn.Module, args: tuple[object, ...], kwargs: dict[str, object]) -> None:
        ctx = ExitStack()
        ctx.enter_context(torch.autocast(device_type, dtype=dtype))
        active.append(ctx)

    def leave(
        module: torch.nn.Module,
        args: tuple[object, ...],
        kwargs: dict[str, object],
        output: object,
    ) -> None:
        active.pop().close()  # always_call: also when forward raised

    model.register_forward_pre_hook(enter, with_kwargs=True)
    model.register_forward_hook(leave, with_kwargs=True, always_call=True)


def to_cpu(obj: _T) -> _T:
    """``obj`` with every tensor in it copied to host memory (same tensors when already there)."""
    return cast(_T, _to_cpu(obj))  # the same nesting of dicts, lists and tuples as ``obj``


def _to_cpu(obj: object) -> object:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj
