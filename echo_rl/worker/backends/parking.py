"""A model parked in host memory between its run's turns (docs/multirun.md, "Residency").

``model.to("cpu")`` allocates fresh pageable host memory at every park, and a copy between
pageable memory and a GPU is staged through a driver buffer a chunk at a time. A worker
joined to several runs with fewer device slots than runs (``--resident``) switches models
many times a minute, so the switch is on the critical path of every turn that needs one.

``HostParking`` keeps one host copy of each tensor it moves, allocated at the first park and
page-locked (pinned) when the device is a GPU, so every later park or unpark is one direct
copy per tensor and allocates nothing on the host. The host copies are the memory that
``--host-memory-gb`` already books for a joined run (every joined run's model counts in host
memory whatever K is, ``echo_rl.core.memplan.HostBudget``), so keeping them while the model is on the
device adds nothing to the budget. ``benchmarks/gpu_stages.py residency`` times both ways.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Iterator
from functools import partial

import torch


class HostParking:
    """Moves a fixed set of a model's tensors between ``device`` and host copies of its own.
    ``params`` are moved by swapping ``.data`` (the Parameter objects, which an optimizer or
    a shared base may hold, stay the same); ``buffers`` as (module, name) slots."""

    def __init__(
        self,
        device: torch.device,
        params: Iterable[torch.nn.Parameter],
        buffers: Iterable[tuple[torch.nn.Module, str]] = (),
    ) -> None:
        self.device = torch.device(device)
        self.pinned = self.device.type == "cuda" and torch.cuda.is_available()
        seen: set[int] = set()
        self.params: list[torch.nn.Parameter] = []
        for p in params:  # a tied parameter once
            if id(p) not in seen:
                seen.add(id(p))
                self.params.append(p)
        self.buffers = list(buffers)
        self._host: dict[Hashable, torch.Tensor] = {}
        self.parked = False

    @classmethod
    def whole(cls, model: torch.nn.Module, device: torch.device) -> HostParking:
        """Every parameter and buffer of ``model``: what ``model.to`` moves."""
        buffers = [
            (m, name) for m in model.modules() for name, b in m._buffers.items() if b is not None
        ]
        return cls(device, model.parameters(), buffers)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t, _ in self._slots())

    def park(self) -> None:
        """Device -> the host copies; the device memory goes back to torch's allocator."""
        if self.parked:
            return
        for key, t, put in self._slots():
            host = self._host.get(key)
            if host is None or host.shape != t.shape or host.dtype != t.dtype:
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=self.pinned)
                self._host[key] = host
            host.copy_(t, non_blocking=self.pinned)
            put(host)
        self._sync()
        self.parked = True

    def unpark(self) -> None:
        """The host copies -> the device (kept for the next park)."""
        if not self.parked:
            return
        for _, t, put in self._slots():
            put(t.to(self.device, non_blocking=self.pinned))
        self._sync()
        self.parked = False

    def _sync(self) -> None:
        # non_blocking copies from or into pinned memory must end before the tensors are used
        # (or, after a park, before the device copies are freed and reused)
        if self.pinned:
            torch.cuda.synchronize(self.device)

    def _slots(self) -> Iterator[tuple[Hashable, torch.Tensor, Callable[[torch.Tensor], None]]]:
        """(the host copy's key, the tensor where it is now, what puts a tensor in its place)."""
        for p in self.params:
            yield id(p), p.data, partial(setattr, p, "data")
        for m, name in self.buffers:
            t = m._buffers[name]
            assert t is not None  # only buffers that hold a tensor are moved (see ``whole``)
            yield (id(m), name), t, partial(m._buffers.__setitem__, name)
