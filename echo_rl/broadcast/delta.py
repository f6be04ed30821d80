"""Delta snapshots: a version sent as what changed since its base, rebuilt bit-exact.

Consecutive RL versions differ in few bits: at small learning rates most bf16 weights round to
the same value after a step. Each tensor of a publication is therefore encoded three ways and
the smallest is sent (docs/broadcast.md, "Delta snapshots"):

  * ``full``: the tensor's bytes (always possible; what a keyframe is made of);
  * ``xor_lz4``: LZ4 block of ``new XOR base`` over the tensor's bytes (bit-exact for any dtype,
    small when most bytes are unchanged);
  * ``sparse``: ``k`` little-endian uint32 element indices, then the ``k`` new element values
    (bytes of the element width), for the elements whose bits differ; ``k = dlen / (4 + width)``.
    Not used for a tensor of 2**32 elements or more.

Elements are compared by their bits (an unsigned view of the element width), never as floats:
a NaN or a -0.0 round-trips exactly. Everything here is numpy and lz4, no torch: relays and the
benchmark's relay processes may import it.

The payload of a delta is the tensors' encodings, one after the other, in the manifest's tensor
order; each manifest tensor entry says ``enc``, ``doff`` and ``dlen`` (its slice of the payload),
and ``offset``/``nbytes`` (its place in the rebuilt result, the same layout as a full snapshot).
``decode`` checks every slice against the tensor it claims to rebuild, so a delta of any shape
ends in a ``DeltaError``, never an IndexError or a write outside the result.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import lz4.block
import numpy as np
import numpy.typing as npt

from echo_rl.broadcast.manifest import DTYPE_BYTES, TENSOR_ENCODINGS, TensorEntry
from echo_rl.core.errors import EchoError
from echo_rl.core.layout import Payload, TensorLayout
from echo_rl.core.spill import drop_pages

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_INDEX = np.dtype("<u4")


class DeltaError(EchoError, ValueError):
    default_reason = "delta"


@dataclass
class DeltaStats:
    """What one encode measured: how much changed and what each encoding would have cost."""

    elements: int = 0
    changed: int = 0
    full_bytes: int = 0
    sizes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TENSOR_ENCODINGS, 0))
    chosen: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TENSOR_ENCODINGS, 0))
    payload_bytes: int = 0
    encode_s: float = 0.0

    def add(self, other: DeltaStats) -> None:
        """``other``'s counts added in (the stats of another part of the same encode)."""
        self.elements += other.elements
        self.changed += other.changed
        self.full_bytes += other.full_bytes
        for k in TENSOR_ENCODINGS:
            self.sizes[k] += other.sizes[k]
            self.chosen[k] += other.chosen[k]

    @property
    def changed_fraction(self) -> float:
        return self.changed / self.elements if self.elements else 0.0

    @property
    def ratio(self) -> float:
        """Delta bytes / full bytes (1.0 for a keyframe)."""
        return self.payload_bytes / self.full_bytes if self.full_bytes else 1.0


def _elements(buf: Payload, dtype: str, offset: int, nbytes: int) -> npt.NDArray[np.generic]:
    raw = np.frombuffer(buf, dtype=np.uint8, count=nbytes, offset=offset)
    return raw.view(_UINT[DTYPE_BYTES[dtype]])


def _encode_tensor(
    t: TensorLayout,
    new: Payload,
    base: Payload,
    stats: DeltaStats,
    scratch: npt.NDArray[np.uint8],
) -> tuple[str, bytes | memoryview]:
    a = _elements(new, t["dtype"], t["offset"], t["nbytes"])
    b = _elements(base, t["dtype"], t["offset"], t["nbytes"])
    # Into a buffer reused across tensors: a fresh array per tensor costs its page faults.
    xor = np.bitwise_xor(a, b, out=scratch[: t["nbytes"]].view(a.dtype))
    changed = int(np.count_nonzero(xor))  # cheap; the indices are found only if sparse wins
    width = a.itemsize
    stats.elements += a.size
    stats.changed += changed
    stats.full_bytes += t["nbytes"]
    sizes = {"full": t["nbytes"]}
    if a.size < 2**32:  # uint32 indices
        sizes["sparse"] = changed * (_INDEX.itemsize + width)
    packed = lz4.block.compress(xor.view(np.uint8), store_size=False) if changed else b""
    if changed:
        sizes["xor_lz4"] = len(packed)
    for k in TENSOR_ENCODINGS:  # an encoding not possible for this tensor costs the full bytes
        stats.sizes[k] += sizes.get(k, t["nbytes"])
    enc = min(sizes, key=lambda k: (sizes[k], TENSOR_ENCODINGS.index(k)))
    stats.chosen[enc] += 1
    if enc == "full":
        return enc, memoryview(new)[t["offset"] : t["offset"] + t["nbytes"]]
    if enc == "xor_lz4":
        return enc, packed
    idx = np.flatnonzero(xor)
    return enc, idx.astype(_INDEX).tobytes() + a[idx].tobytes()


def encode(
    tensors: list[TensorLayout], new: Payload, base: Payload, threads: int = 1
) -> tuple[list[TensorEntry], bytes, DeltaStats]:
    """Encode ``new`` against ``base`` (both full payloads with the layout ``tensors``, as
    ``echo_rl.core.models.params_to_payload`` gives it).

    ``threads``: the tensors are split into that many runs of about equal bytes, encoded at
    once (numpy's XOR and LZ4 release the GIL); the result does not depend on it.

    Returns the manifest's tensor entries (with ``enc``, ``doff``, ``dlen``), the delta payload
    and what the encode measured."""
    if len(new) != len(base):
        raise DeltaError(
            f"base has {len(base)} bytes, new version {len(new)}: a different "
            f"model layout needs a keyframe"
        )
    t0 = time.perf_counter()
    runs = _split(tensors, threads)
    if len(runs) == 1:
        done = [_encode_run(runs[0], new, base)]
    else:
        with ThreadPoolExecutor(len(runs), thread_name_prefix="echo-encode") as pool:
            done = list(pool.map(lambda run: _encode_run(run, new, base), runs))
    stats = DeltaStats()
    entries: list[TensorEntry] = []
    parts: list[bytes | memoryview] = []
    off = 0
    for encoded, part_stats in done:
        stats.add(part_stats)
        for t, enc, data in encoded:
            entries.append(
                TensorEntry(
                    str(t["name"]),
                    str(t["dtype"]),
                    tuple(t["shape"]),
                    int(t["offset"]),
                    int(t["nbytes"]),
                    enc,
                    off,
                    len(data),
                )
            )
            parts.append(data)
            off += len(data)
    payload = b"".join(parts)
    stats.payload_bytes = len(payload)
    stats.encode_s = time.perf_counter() - t0
    return entries, payload, stats


def _split(tensors: list[TensorLayout], n: int) -> list[list[TensorLayout]]:
    """``tensors`` in at most ``n`` consecutive runs of about equal bytes (none empty)."""
    total = sum(t["nbytes"] for t in tensors)
    runs: list[list[TensorLayout]] = [[]]
    done = 0
    for t in tensors:
        if runs[-1] and len(runs) < n and done >= total * len(runs) / n:
            runs.append([])
        runs[-1].append(t)
        done += t["nbytes"]
    return runs


def _encode_run(
    tensors: list[TensorLayout], new: Payload, base: Payload
) -> tuple[list[tuple[TensorLayout, str, bytes | memoryview]], DeltaStats]:
    stats = DeltaStats()
    out: list[tuple[TensorLayout, str, bytes | memoryview]] = []
    scratch = np.empty(max((t["nbytes"] for t in tensors), default=0), dtype=np.uint8)
    for t in tensors:
        enc, data = _encode_tensor(t, new, base, stats, scratch)
        for whole in (new, base):  # spilled maps: this tensor's pages leave the resident set
            drop_pages(whole, t["offset"], t["offset"] + t["nbytes"])
        out.append((t, enc, data))
    return out, stats


def decode(
    entries: Sequence[TensorEntry],
    payload: Payload,
    base: Payload,
    result_size: int,
    out: bytearray | None = None,
) -> bytearray:
    """Rebuild the full payload of a version from its delta ``payload`` and ``base`` (the full
    payload of the manifest's base version). ``out``: a buffer of ``result_size`` to reuse."""
    if len(base) != result_size:
        raise DeltaError(
            f"base has {len(base)} bytes, the delta rebuilds {result_size}: not "
            f"the base this delta was made from; fetch a keyframe"
        )
    result = out if out is not None and len(out) == result_size else bytearray(result_size)
    view, src = memoryview(result), memoryview(payload)
    for t in entries:
        _decode_tensor(t, src, base, view)
        drop_pages(base, t.offset, t.offset + t.nbytes)  # a spilled base: read once
    return result


def _decode_tensor(t: TensorEntry, src: memoryview, base: Payload, view: memoryview) -> None:
    enc, off, n = t.enc, t.offset, t.nbytes
    data = src[t.doff : t.doff + t.dlen]
    if len(data) != t.dlen or off + n > len(view):
        raise DeltaError(f"tensor {t.name}: its slice lies outside the payload or result")
    if enc == "full":
        if len(data) != n:
            raise DeltaError(f"tensor {t.name}: full encoding of {len(data)} bytes, needs {n}")
        view[off : off + n] = data
        return
    view[off : off + n] = memoryview(base)[off : off + n]
    if enc == "xor_lz4":
        try:
            xor = lz4.block.decompress(data, uncompressed_size=n)
        except lz4.block.LZ4BlockError as exc:
            raise DeltaError(f"tensor {t.name}: LZ4 block does not decode ({exc})") from None
        if len(xor) != n:
            raise DeltaError(f"tensor {t.name}: LZ4 block gives {len(xor)} bytes, needs {n}")
        out = np.frombuffer(view, dtype=np.uint8, count=n, offset=off)
        np.bitwise_xor(out, np.frombuffer(xor, dtype=np.uint8), out=out)
    elif enc == "sparse":
        _apply_sparse(t, data, view)
    else:
        raise DeltaError(f"tensor {t.name}: encoding {enc!r} is not one of {TENSOR_ENCODINGS}")


def _apply_sparse(t: TensorEntry, data: memoryview, view: memoryview) -> None:
    width = DTYPE_BYTES[t.dtype]
    k, rest = divmod(len(data), _INDEX.itemsize + width)
    if rest:
        raise DeltaError(
            f"tensor {t.name}: sparse slice of {len(data)} bytes is not a whole "
            f"number of (index, value) pairs of {_INDEX.itemsize}+{width} bytes"
        )
    if not k:
        return
    out = _elements(view, t.dtype, t.offset, t.nbytes)
    idx = np.frombuffer(data, dtype=_INDEX, count=k)
    if int(idx.max()) >= out.size:
        raise DeltaError(
            f"tensor {t.name}: sparse index {int(idx.max())} beyond its {out.size} elements"
        )
    out[idx] = np.frombuffer(data, dtype=out.dtype, count=k, offset=k * _INDEX.itemsize)
