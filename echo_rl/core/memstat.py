"""Where a process's memory goes (docs/memory.md): its resident set from /proc, and the bytes
of the payloads it holds, in RAM or spilled to files (echo_rl.core.spill), counted once each however
many holders share one."""

from __future__ import annotations

import mmap
from collections.abc import Iterable, Sized
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

_STATUS = {"VmRSS": "rss", "VmHWM": "rss_peak", "RssAnon": "rss_anon", "RssFile": "rss_file"}


def resident() -> dict[str, int]:
    """This process's resident set in bytes: now, its peak, and the anonymous and file-backed
    parts of it (file-backed pages are the page cache's: the kernel can take them back)."""
    out = dict.fromkeys(_STATUS.values(), 0)
    path = Path("/proc/self/status")
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in _STATUS:
            out[_STATUS[key]] = int(rest.split()[0]) * 1024  # kB
    return out


def payload_bytes(payloads: Iterable[object]) -> dict[str, int]:
    """Bytes of the distinct payload objects given: ``ram`` (bytes, bytearray) and ``spilled``
    (read-only maps of files). None is skipped; anything without a length is a TypeError."""
    seen: dict[int, Sized] = {}
    for p in payloads:
        if p is None:
            continue
        if not isinstance(p, Sized):
            raise TypeError(f"payload_bytes: a {type(p).__name__} has no length")
        seen.setdefault(id(p), p)
    out = {"ram": 0, "spilled": 0}
    for p in seen.values():
        out["spilled" if isinstance(p, mmap.mmap) else "ram"] += len(p)
    return out


def tensor_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct tensors given (shared storages counted once). A sharded
    tensor (FSDP's DTensor) counts its local shard: what this process holds."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None or not hasattr(t, "untyped_storage"):
            continue
        local = t.to_local() if hasattr(t, "to_local") else t
        try:
            s = local.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
        except RuntimeError:  # a storage Python cannot see into: its elements, once
            seen[id(local)] = local.numel() * local.element_size()
    return sum(seen.values())
