"""The tensor index: how a payload's tensors are laid out, as every plane reads it. A module of
its own, importing nothing heavy, so a relay or a manifest reader need not load the config."""

from __future__ import annotations

from typing import NotRequired, TypedDict


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
