"""A version's checkpoint and publication off the training thread, overlapped with the next step.

After a step that publishes, the learner must (1) checkpoint the policy (model, optimizer and
the small state a resume needs), (2) only then publish it (no worker may hold a version newer
than the last checkpoint: echo_rl/learner/checkpoint.py), which means building the payload (the
parameters cast to the broadcast dtype) and handing it to the publisher thread (encode, hash,
sign: echo_rl/learner/publisher.py). On the training thread these cost more than a step where the step
is fast: a 1.6 GB checkpoint of SmolLM2 with its Adam moments is seconds of disk, and a GPU
step is 0.6 s (docs/gpu.md). Here the training thread only *freezes* the version (``HostMirror``:
copies of its tensors in host buffers allocated once and reused by every version, pinned when
the tensors are on a GPU) and hands it over (``ReleaseThread.submit``); the thread writes the
checkpoint, then builds and hands on the payload, while the next step trains.

Overflow policy: one version in flight. A step that ends while the previous version is still
being released waits for it (back-pressure, measured as the row's ``t_publish``), since the
mirror's buffers are the ones being read; versions are never skipped or reordered. So the
training thread waits only for what it must: the copy, and a release longer than a step.

A failure on the thread (a full disk, a snapshot that cannot be built) is raised on the
training thread at the next ``submit`` or ``flush``, never swallowed. ``checkpointed`` says how
many steps the newest durable checkpoint holds: the buffer log may be compacted only when that
is every step taken (echo_rl/learner/main.py), since compaction drops what checkpoints hold.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeAlias, TypeVar, cast

import torch

if TYPE_CHECKING:
    from torch.optim.optimizer import StateDict

    from echo_rl.learner.checkpoint import CheckpointExtra
    from echo_rl.learner.parallel.base import FullState, ModelState

log = logging.getLogger("echo.learner")

_T = TypeVar("_T")
# Where a tensor sits in the nested state: the dict keys and list indices down to it.
_Path: TypeAlias = tuple[Hashable, ...]
# One tensor's storage as met: (data pointer, shape, dtype, device, strides).
_Seen: TypeAlias = tuple[int, torch.Size, torch.dtype, torch.device, tuple[int, ...]]


class HostMirror:
    """Host copies of a nested state (dicts, lists and tuples of tensors and plain values),
    written into buffers allocated at the first copy and reused by every later one. Tensors on a
    GPU are copied into pinned buffers without blocking, then waited for once; tensors on the
    CPU are copied too (the next step changes them in place). A buffer whose tensor changed
    shape or dtype is allocated again."""

    def __init__(self) -> None:
        self._buffers: dict[_Path, torch.Tensor] = {}

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def copy(self, state: _T) -> _T:
        """``state`` with every tensor replaced by its host copy. A tensor met twice (tied
        embeddings: two names, one weight) is copied once and stays one tensor."""
        seen: dict[_Seen, torch.Tensor] = {}
        out = self._walk(state, (), seen)
        if any(key[3].type == "cuda" for key in seen):
            torch.cuda.synchronize()
        return cast(_T, out)  # the same nesting of dicts, lists and tuples as ``state``

    def _walk(self, obj: object, path: _Path, seen: dict[_Seen, torch.Tensor]) -> object:
        if isinstance(obj, torch.Tensor):
            key = (obj.data_ptr(), obj.shape, obj.dtype, obj.device, obj.stride())
            if key not in seen:
                seen[key] = self._tensor(obj, path)
            return seen[key]
        if isinstance(obj, dict):
            return {k: self._walk(v, (*path, k), seen) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(self._walk(v, (*path, i), seen) for i, v in enumerate(obj))
        return obj  # ints, floats, strings: immutable

    def _tensor(self, t: torch.Tensor, path: _Path) -> torch.Tensor:
        t = t.detach()
        buf = self._buffers.get(path)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            pin = t.is_cuda and torch.cuda.is_available()
            buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
            self._buffers[path] = buf
        buf.copy_(t, non_blocking=t.is_cuda)
        return buf


@dataclass
class Version:
    """One version to release: the steps it holds, its frozen model and optimizer state, and
    whether to checkpoint it (``learner.checkpoint``), with what else the checkpoint holds."""

    steps: int
    model: ModelState
    optimizer: StateDict
    checkpoint: bool
    extra: CheckpointExtra | None = None  # None: a version that is never checkpointed here


class ReleaseThread:
    """For each submitted version, in order, on a thread of its own: ``finite(version)`` (a
    version with a NaN is neither checkpointed nor published), ``checkpoint(version)``, then
    ``publish(version)``."""

    def __init__(
        self,
        finite: Callable[[Version], bool],
        checkpoint: Callable[[Version], None],
        publish: Callable[[Version], None],
    ):
        self._finite, self._checkpoint, self._publish = finite, checkpoint, publish
        self.mirror = HostMirror()
        self.checkpointed = -1  # steps the newest durable checkpoint holds (-1: none of ours)
        self.released = 0  # versions through the thread
        self.last_s: float | None = None  # the newest version's time on the thread
        self._cond = threading.Condition()
        self._pending: Version | None = None
        self._busy = False
        self._closed = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="echo-release", daemon=True)
        self._thread.start()

    def freeze(self, model: ModelState, optimizer: StateDict) -> FullState:
        """Host copies of a version's state in the mirror's buffers: waits first until the
        previous version is released (its buffers are the ones being read)."""
        self.flush()
        return self.mirror.copy((model, optimizer))

    def submit(self, version: Version) -> None:
        """Hand a frozen version over (``freeze`` has waited for the previous one)."""
        with self._cond:
            self._raise()
            self._pending = version
            self._busy = True
            self._cond.notify_all()

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every version handed over is checkpointed and published."""
        with self._cond:
            if not self._cond.wait_for(lambda: not self._busy or self._error is not None, timeout):
                raise TimeoutError(f"a version's release took longer than {timeout} s")
            self._raise()

    def close(self, timeout: float = 120.0) -> None:
        """Finish the version in flight (its checkpoint must be whole), then stop the thread."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.error("the release thread did not finish within %.0f s", timeout)

    def _raise(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"releasing a version failed: {self._error!r}") from self._error

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending is not None or self._closed)
                if self._pending is None:
                    return  # closed with nothing in flight
                version = self._pending
            t0 = time.monotonic()
            try:
                if self._publish_ok(version):
                    self.released += 1
            except BaseException as exc:  # handed to the training thread by _raise
                log.exception("releasing version %d failed", version.steps)
                with self._cond:
                    self._error = exc
            finally:
                self.last_s = time.monotonic() - t0
                with self._cond:
                    self._pending = None
                    self._busy = False
                    self._cond.notify_all()

    def _publish_ok(self, version: Version) -> bool:
        """Checkpoint, then publish: a version no checkpoint holds never reaches a worker."""
        if not self._finite(version):
            return False
        if version.checkpoint:
            self._checkpoint(version)
            with self._cond:
                self.checkpointed = version.steps
        self._publish(version)
        return True
