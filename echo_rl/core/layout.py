"""The tensor index: how a payload's tensors are laid out, as every plane reads it. A module of
its own, importing nothing heavy, so a relay or a manifest reader need not load the config."""

from __future__ import annotations

import mmap
from typing import NotRequired, TypeAlias, TypedDict

# A payload's bytes held whole: received into a bytearray, published as bytes, a slice of
# either, or spilled to a file and mapped (echo_rl.core.spill).
Payload: TypeAlias = bytes | bytearray | memoryview | mmap.mmap


class TensorLayout(TypedDict):
    """One tensor of a payload, as the tensor index lists it: its name, dtype and shape, where
    its bytes sit in the full payload (``offset``, ``nbytes``) and, once a manifest carries it
    (``echo_rl.broadcast.manifest.TensorEntry``), its encoding's slice of the payload sent
    (``enc``, ``doff``, ``dlen``; echo_rl/broadcast/delta.py)."""

    name: str
    dtype: str
    shape: list[int]
    offset: int
    nbytes: int
    enc: NotRequired[str]
    doff: NotRequired[int]
    dlen: NotRequired[int]
