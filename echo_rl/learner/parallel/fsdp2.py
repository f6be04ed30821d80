"""FSDP2 (``fully_shard``) under torchrun: gloo on CPU, NCCL on GPUs.

Each decoder layer is its own shard group, the root holds embeddings and the head (tied
weights stay together). On GPUs each rank binds ``cuda:LOCAL_RANK`` before the process group
exists (NCCL needs it); with bf16 the sharded weights and Adam stay float32, the all-gathered
copies used in forward and backward are bf16 and gradients are reduced in float32. Gradients are averaged across ranks by the reduce-scatter, so the
trainer scales each rank's loss to make the average equal the single-process loss.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeVar, cast

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from echo_rl.core.lora import base_of
from echo_rl.learner.parallel.base import FullState, ModelState, Parallel

if TYPE_CHECKING:
    from torch.distributed.checkpoint.state_dict import ValueType
    from torch.optim import Optimizer
    from torch.optim.optimizer import StateDict

_T = TypeVar("_T")


class FSDP2(Parallel):
    def __init__(self, device: torch.device = torch.device("cpu")) -> None:
        self.device = device
        if device.type == "cuda":
            torch.cuda.set_device(device)
        if not dist.is_initialized():
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        from echo_rl.core.models import bf16_compute

        # An explicit mesh: the default one is CUDA whenever a GPU is visible, even with
        # learner.device = "cpu". fully_shard moves the shards to the mesh's device.
        opts: dict[str, Any] = {"mesh": init_device_mesh(self.device.type, (self.world,))}
        if bf16_compute(self.device):
            opts["mp_policy"] = MixedPrecisionPolicy(
                param_dtype=torch.bfloat16, reduce_dtype=torch.float32
            )
        for layer in _decoder_layers(model):
            fully_shard(layer, **opts)
        fully_shard(model, **opts)
        return model

    def full_state(self, model: torch.nn.Module, optimizer: Optimizer) -> FullState:
        model_sd, optim_sd = get_state_dict(
            model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        # full (unsharded) and offloaded: plain tensors by name, as ``state_dict`` gives them
        return cast("ModelState", model_sd), optim_sd

    def load_state(
        self,
        model: torch.nn.Module,
        optimizer: Optimizer,
        model_sd: ModelState,
        optim_sd: StateDict,
        strict: bool = True,
    ) -> None:
        set_state_dict(
            model,
            optimizer,
            model_state_dict=cast("dict[str, ValueType]", model_sd),
            optim_state_dict=optim_sd,
            options=StateDictOptions(
                full_state_dict=True, broadcast_from_rank0=True, strict=strict
            ),
        )

    def broadcast(self, obj: _T) -> _T:
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def all_sum(self, values: torch.Tensor) -> torch.Tensor:
        out = values.to(self.device, copy=True)  # NCCL reduces GPU tensors, gloo CPU ones
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
        return out.cpu()

    def close(self) -> None:
        if dist.is_initialized():
            # Without the barrier rank 0 may tear gloo down while another rank is still
            # receiving the "stop" broadcast, which aborts that rank (seen: SIGABRT).
            dist.barrier()
            dist.destroy_process_group()


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    model = base_of(model)  # a peft model (LoRA): the layers are its base's
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(
            f"{type(model).__name__}: no .model.layers to shard; FSDP2 wrapping "
            f"expects a Hugging Face decoder-only causal LM"
        )
    return list(layers)
