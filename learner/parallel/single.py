"""One process, one device: nothing to shard or gather."""

from __future__ import annotations

from typing import Any

import torch

from learner.parallel.base import Parallel


class Single(Parallel):
    def wrap(self, model: Any) -> Any:
        return model

    def full_state(self, model: Any, optimizer: Any) -> tuple[dict, dict]:
        return model.state_dict(), optimizer.state_dict()

    def load_state(self, model: Any, optimizer: Any, model_sd: dict, optim_sd: dict) -> None:
        model.load_state_dict(model_sd)
        optimizer.load_state_dict(optim_sd)

    def broadcast(self, obj: Any) -> Any:
        return obj

    def all_sum(self, values: torch.Tensor) -> torch.Tensor:
        return values
