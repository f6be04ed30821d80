"""What the learner needs from a parallelism strategy."""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, TypeAlias, TypeVar

import torch
from torch.optim.optimizer import StateDict

if TYPE_CHECKING:
    from _typeshed import DataclassInstance
    from torch.optim import Optimizer

# A model's state dict (name -> tensor); an optimizer's is torch's ``StateDict``.
ModelState: TypeAlias = dict[str, torch.Tensor]
# (model state, optimizer state): what a checkpoint and a snapshot are made of
FullState: TypeAlias = tuple[ModelState, StateDict]

_T = TypeVar("_T")
_Batch = TypeVar("_Batch", bound="DataclassInstance")


class Parallel(ABC):
    rank: int = 0
    world: int = 1
    device: torch.device = torch.device("cpu")  # where this rank's shard trains

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @abstractmethod
    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """Prepare the model for training (shard it); returns the model to train."""

    def to_device(self, batch: _Batch) -> _Batch:
        """A copy of a dataclass of tensors (a ``LearnerBatch``) on this rank's device; on the
        CPU the tensors are the same objects."""
        moved = {
            f.name: getattr(batch, f.name).to(self.device)
            for f in dataclasses.fields(batch)
            if isinstance(getattr(batch, f.name), torch.Tensor)
        }
        return dataclasses.replace(batch, **moved)

    def shard(self, idx: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a mini-batch (every rank sees the same ``idx``)."""
        return idx[self.rank :: self.world]

    @abstractmethod
    def full_state(self, model: torch.nn.Module, optimizer: Optimizer) -> FullState:
        """Unsharded model and optimizer state on rank 0 (a collective: all ranks call it)."""

    def live_state(self, model: torch.nn.Module, optimizer: Optimizer) -> FullState:
        """``full_state`` for a caller that copies it to host memory itself (the release
        thread's ``HostMirror``, into pinned buffers it reuses): where no gather is needed, the
        live tensors, on their device, with no copy. Default: ``full_state``."""
        return self.full_state(model, optimizer)

    @abstractmethod
    def load_state(
        self,
        model: torch.nn.Module,
        optimizer: Optimizer,
        model_sd: ModelState,
        optim_sd: StateDict,
        strict: bool = True,
    ) -> None:
        """Load rank 0's unsharded state into every rank (a collective). ``strict`` False:
        ``model_sd`` may hold only some of the model's tensors (a LoRA adapter's)."""

    @abstractmethod
    def broadcast(self, obj: _T) -> _T:
        """Rank 0's ``obj`` on every rank."""

    @abstractmethod
    def all_sum(self, values: torch.Tensor) -> torch.Tensor:
        """Element-wise sum of ``values`` over the ranks, on every rank (a collective)."""

    def close(self) -> None:  # noqa: B027 (optional: most backends hold nothing to close)
        pass
