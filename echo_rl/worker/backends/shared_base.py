"""One base model per process for the LoRA runs that share it (docs/multirun.md, "Residency").

A worker joined to several runs that train LoRA adapters on the same base model (the same
content hash, ``echo_rl.core.lora.base_hash``) would hold that base once per run. Here the second and
later runs point their base weights at the first run's tensors: N runs then cost one base and
N adapters, in host memory and on the device. A version of a LoRA run carries only adapter
tensors, so no install ever writes a shared weight. A backend whose base is shared parks and
unparks its adapter only: the base stays where the runs generate.
"""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING, Any

from echo_rl.core.lora import is_adapter_name

if TYPE_CHECKING:
    import torch


class SharedBases:
    def __init__(self) -> None:
        self._first: dict[str, weakref.ReferenceType[Any]] = {}  # base hash -> first model
        self._users: dict[str, int] = {}  # base hash -> models attached (the first included)
        self._lock = threading.Lock()  # runs load their models on their own threads

    def attach(self, model: torch.nn.Module, held: str) -> int:
        """Point ``model``'s base weights at the first model's with base ``held`` (same name,
        shape, dtype and device); the bytes that saves (0 for the first)."""
        with self._lock:
            ref = self._first.get(held)
            first = ref() if ref is not None else None
            if first is None:
                self._first[held], self._users[held] = weakref.ref(model), 1
                return 0
            theirs = dict(first.named_parameters())
            saved = 0
            for name, p in model.named_parameters():
                q = theirs.get(name)
                if is_adapter_name(name) or q is None or q is p:
                    continue
                if (q.shape, q.dtype, q.device) == (p.shape, p.dtype, p.device):
                    saved += p.numel() * p.element_size()
                    p.data = q.data
            self._users[held] += 1
            return saved

    def shared(self, held: str | None) -> bool:
        with self._lock:
            return held is not None and self._users.get(held, 0) > 1


SHARED = SharedBases()  # the process's
