"""FSDP2 (``fully_shard``) under torchrun: gloo on CPU, NCCL on GPUs.

Each decoder layer is its own shard group, the root holds embeddings and the head (tied
weights stay together). Gradients are averaged across ranks by the reduce-scatter, so the
trainer scales each rank's loss to make the average equal the single-process loss.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict,
                                                     set_state_dict)
from torch.distributed.fsdp import fully_shard

from learner.parallel.base import Parallel


class FSDP2(Parallel):
    def __init__(self) -> None:
        if not dist.is_initialized():
            dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()

    def wrap(self, model: Any) -> Any:
        for layer in _decoder_layers(model):
            fully_shard(layer)
        fully_shard(model)
        return model

    def full_state(self, model: Any, optimizer: Any) -> tuple[dict, dict]:
        return get_state_dict(model, optimizer, options=StateDictOptions(
            full_state_dict=True, cpu_offload=True))

    def load_state(self, model: Any, optimizer: Any, model_sd: dict, optim_sd: dict) -> None:
        set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd,
                       options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))

    def broadcast(self, obj: Any) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def all_sum(self, values: torch.Tensor) -> torch.Tensor:
        # NCCL reduces device tensors only; gloo reduces CPU ones
        device = f"cuda:{torch.cuda.current_device()}" if dist.get_backend() == "nccl" else "cpu"
        out = values.to(device, copy=True)
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
        return out.cpu()

    def close(self) -> None:
        if dist.is_initialized():
            # Without the barrier rank 0 may tear gloo down while another rank is still
            # receiving the "stop" broadcast, which aborts that rank (seen: SIGABRT).
            dist.barrier()
            dist.destroy_process_group()


def _decoder_layers(model: Any) -> list[Any]:
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: no .model.layers to shard; FSDP2 wrapping "
                         f"expects a Hugging Face decoder-only causal LM")
    return list(layers)
