"""The snapshot manifest and the base-model manifest as declared types, and their one wire form.

A manifest crosses the wire as a msgpack map (``to_wire``) whose canonical msgpack, less the
signature, is what the run's key signs (``signed_bytes``): those two functions are the only
place the map is written, so the bytes a learner signs and sends are fixed by the field order
below (``tests/test_snapshot.py`` pins them). A map that arrives is read once, by
``parse_manifest`` (and ``echo_rl.broadcast.base_manifest.parse_base_manifest``): every key's type and range is checked (a map of
any shape ends in a ``SnapshotError`` naming the key, never a KeyError or TypeError later,
docs/fuzzing.md) and the result is a frozen object read by attribute everywhere else. The
signature is checked over the map as it arrived (``verify_signature``), so a manifest signed by
any learner that wrote these keys verifies, whatever order it wrote them in.

``ChunkLayout`` is what a fetch receives into and a chunk server serves: a manifest's payload
(form "payload"), the full payload it rebuilds (form "full", a keyframe) or a base model's
files (form "base").
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import ClassVar, Literal, TypeAlias

import blake3
import msgpack
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from echo_rl.core.errors import EchoError
from echo_rl.core.layout import TensorLayout

SCHEMA = 2
ENCODINGS = ("full", "delta")  # the payloads a worker can install
TENSOR_ENCODINGS = ("full", "xor_lz4", "sparse")  # per tensor (broadcast.delta)
# Bytes per element of the dtypes a tensor may declare (a snapshot's tensors are installed with
# ``getattr(torch, dtype)``: only these names may reach it).
DTYPE_BYTES = {
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "float64": 8,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "bool": 1,
}
MAX_PAYLOAD = 1 << 40  # 1 TiB: far above any policy, far below what would overflow a size
MAX_CHUNK = 1 << 31
MAX_RANK = 16
BASE_HASH = re.compile(r"[0-9a-f]{64}")
BASE_KIND = "base"  # a base manifest's ``kind`` and ``form``
BASE_VERSION = 0  # one base per run: its chunks are requested as version 0, form "base"
MAX_FILES = 256
MAX_BASE_BYTES = 1 << 40  # 1 TiB; a worker also needs this much free disk (``BaseCache.room``)
NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")  # a plain file name: no '/', no '..'

Form = Literal["payload", "full", "base"]
# A map as msgpack carries it (bytes for hashes and signatures): what ``to_wire`` gives, and
# what a parse (``parse_manifest``) reads into a declared record before anything trusts it.
Packed: TypeAlias = None | bool | int | float | str | bytes | list["Packed"] | dict[str, "Packed"]
PackedMap: TypeAlias = dict[str, Packed]


class SnapshotError(EchoError, ValueError):
    default_reason = "snapshot"


def chunk_hash(data: bytes | bytearray | memoryview) -> bytes:
    digest: bytes = blake3.blake3(data).digest()
    return digest


def signed_bytes(wire: Mapping[str, object]) -> bytes:
    """The canonical msgpack of a manifest's map less its signature: what the run's key signs."""
    packed: bytes = msgpack.packb(
        {k: v for k, v in wire.items() if k != "signature"}, use_bin_type=True
    )
    return packed


def verify_signature(wire: Mapping[str, object], public_key: bytes, what: str) -> None:
    """Refuse a manifest's map (of a checked shape) not signed by this run's key."""
    signature = wire["signature"]
    try:
        if not isinstance(signature, bytes):
            raise TypeError("signature")
        Ed25519PublicKey.from_public_bytes(public_key).verify(signature, signed_bytes(wire))
    except (InvalidSignature, ValueError, TypeError):  # ValueError: packb past its depth limit
        raise SnapshotError(
            f"manifest for {what} fails its Ed25519 signature: not from this "
            f"run's learner; refusing it"
        ) from None


@dataclass(frozen=True)
class ChunkLayout:
    """A payload cut into ``chunk_size`` chunks, each checked against its BLAKE3 hash."""

    version: int
    payload_size: int
    chunk_size: int
    chunk_hashes: tuple[bytes, ...]
    form: Form = "payload"

    @property
    def num_chunks(self) -> int:
        return len(self.chunk_hashes)

    def chunk_range(self, index: int) -> tuple[int, int]:
        start = index * self.chunk_size
        return start, min(start + self.chunk_size, self.payload_size)

    def verify_chunk(self, index: int, data: bytes | bytearray | memoryview) -> None:
        start, end = self.chunk_range(index)
        if len(data) != end - start:
            raise SnapshotError(
                f"chunk {index} of version {self.version} has {len(data)} "
                f"bytes, expected {end - start}"
            )
        self.check_digest(index, chunk_hash(data))

    def check_digest(self, index: int, digest: bytes) -> None:
        """The chunk's BLAKE3 ``digest`` (from a hashing thread) against the signed one."""
        if digest != self.chunk_hashes[index]:
            raise SnapshotError(
                f"chunk {index} of version {self.version} fails its BLAKE3 "
                f"hash: corrupted in transit or by a relay"
            )


@dataclass(frozen=True)
class TensorEntry:
    """One tensor: its place in the full payload (``offset``, ``nbytes``) and its encoding's
    slice of the payload sent (``enc``, ``doff``, ``dlen``; broadcast.delta)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    enc: str = "full"
    doff: int = 0
    dlen: int = 0

    @classmethod
    def full(cls, layout: TensorLayout) -> TensorEntry:
        """A tensor of a payload layout (``echo_rl.core.models.params_to_payload``) sent whole."""
        return cls(
            str(layout["name"]),
            str(layout["dtype"]),
            tuple(layout["shape"]),
            int(layout["offset"]),
            int(layout["nbytes"]),
            "full",
            int(layout["offset"]),
            int(layout["nbytes"]),
        )

    @classmethod
    def encoded(cls, entry: TensorLayout) -> TensorEntry:
        """A tensor entry of a delta, as a map (``enc``, ``doff``, ``dlen`` given)."""
        return cls(
            str(entry["name"]),
            str(entry["dtype"]),
            tuple(entry["shape"]),
            int(entry["offset"]),
            int(entry["nbytes"]),
            str(entry["enc"]),
            int(entry["doff"]),
            int(entry["dlen"]),
        )

    def layout(self) -> TensorLayout:
        return TensorLayout(
            name=self.name,
            dtype=self.dtype,
            shape=list(self.shape),
            offset=self.offset,
            nbytes=self.nbytes,
            enc=self.enc,
            doff=self.doff,
            dlen=self.dlen,
        )

    def to_wire(self) -> PackedMap:
        return {
            "name": self.name,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "offset": self.offset,
            "nbytes": self.nbytes,
            "enc": self.enc,
            "doff": self.doff,
            "dlen": self.dlen,
        }


@dataclass(frozen=True)
class Manifest:
    """A version's signed manifest (docs/design.md §5): a full snapshot (a keyframe) or a delta
    rebuilt from the full payload of ``base_version`` (-1 for a full one)."""

    run_id: str
    version: int
    base_version: int
    encoding: Literal["full", "delta"]
    dtype: str
    tensors: tuple[TensorEntry, ...]
    payload_size: int
    chunk_size: int
    chunk_hashes: tuple[bytes, ...]  # BLAKE3 of every chunk of the payload sent
    result_size: int  # the full payload the worker installs
    result_hashes: tuple[bytes, ...]  # of every chunk of it (== chunk_hashes when full)
    base_model: str | None = None  # LoRA runs: hex BLAKE3 of the base model (echo_rl/core/lora.py)
    signature: bytes = b""  # Ed25519 over signed_bytes(to_wire())
    schema: ClassVar[int] = SCHEMA

    def to_wire(self) -> PackedMap:
        """The map that travels and is signed (its key order fixes the signed bytes)."""
        wire: PackedMap = {
            "schema": self.schema,
            "run_id": self.run_id,
            "version": self.version,
            "base_version": self.base_version,
            "encoding": self.encoding,
            "dtype": self.dtype,
            "tensors": [t.to_wire() for t in self.tensors],
            "payload_size": self.payload_size,
            "chunk_size": self.chunk_size,
            "chunk_hashes": list(self.chunk_hashes),
            "result_size": self.result_size,
            "result_hashes": list(self.result_hashes),
        }
        if self.base_model is not None:
            wire["base_model"] = self.base_model
        wire["signature"] = self.signature
        return wire

    def signed_bytes(self) -> bytes:
        return signed_bytes(self.to_wire())

    def tensor_index(self) -> list[TensorLayout]:
        """The tensors as a backend installs them (``Backend.install``)."""
        return [t.layout() for t in self.tensors]

    @cached_property
    def layout(self) -> ChunkLayout:
        """The payload sent (form "payload")."""
        return ChunkLayout(self.version, self.payload_size, self.chunk_size, self.chunk_hashes)

    @cached_property
    def result_layout(self) -> ChunkLayout:
        """The rebuilt (full) payload as a payload: what a keyframe fetch receives into and
        checks chunk by chunk (form "full")."""
        return ChunkLayout(
            self.version, self.result_size, self.chunk_size, self.result_hashes, "full"
        )


# Reading a map that arrived: every key's type and range, before anything reads it.


def _show(value: object) -> str:
    text = (
        repr(value)
        if isinstance(value, (int, float, str, bytes, type(None)))
        else f"a {type(value).__name__}"
    )
    return text if len(text) <= 40 else text[:37] + "..."


def _int(obj: Mapping[str, object], key: str, lo: int, hi: int, where: str = "manifest") -> int:
    value = obj.get(key)
    if type(value) is not int or not lo <= value <= hi:  # type(): True is no version
        raise SnapshotError(
            f"{where} {key!r} is {_show(value)}, expected an int in "
            f"[{lo}, {hi}]: not a manifest from an echo-rl learner; refusing it"
        )
    return value


def _hashes(key: str, hashes: object, size: int, chunk: int) -> tuple[bytes, ...]:
    if not isinstance(hashes, list) or any(
        not isinstance(h, bytes) or len(h) != 32 for h in hashes
    ):
        raise SnapshotError(f"manifest {key} is not a list of 32-byte BLAKE3 hashes")
    if len(hashes) != -(-size // chunk):
        raise SnapshotError(
            f"manifest lists {len(hashes)} {key}, {size} bytes need {-(-size // chunk)}"
        )
    return tuple(hashes)


def _signature(raw: Mapping[str, object], where: str, what: str = "") -> bytes:
    sig = raw.get("signature")
    if not isinstance(sig, bytes) or len(sig) != 64:
        raise SnapshotError(f"{where} signature is {_show(sig)}, expected 64 bytes{what}")
    return sig


def _schema(raw: Mapping[str, object], where: str) -> None:
    if type(raw.get("schema")) is not int or raw["schema"] != SCHEMA:
        raise SnapshotError(
            f"{where} schema {_show(raw.get('schema'))} is not {SCHEMA}: upgrade echo-rl"
        )


def _tensor(i: int, t: object, result_size: int, payload_size: int) -> TensorEntry:
    where = f"manifest tensor {i}"
    if not isinstance(t, dict):
        raise SnapshotError(f"{where} is {_show(t)}, expected a map")
    name, dtype, shape = t.get("name"), t.get("dtype"), t.get("shape")
    if not isinstance(name, str) or not name:
        raise SnapshotError(f"{where}: name is {_show(name)}, expected a non-empty str")
    if not isinstance(dtype, str) or dtype not in DTYPE_BYTES:
        raise SnapshotError(
            f"{where} ({name}): dtype {_show(dtype)} is not one of {sorted(DTYPE_BYTES)}"
        )
    if (
        not isinstance(shape, list)
        or len(shape) > MAX_RANK
        or any(type(d) is not int or d < 0 for d in shape)
    ):
        raise SnapshotError(
            f"{where} ({name}): shape {_show(shape)} is not a list of at most {MAX_RANK} ints >= 0"
        )
    offset = _int(t, "offset", 0, result_size, where)
    nbytes = _int(t, "nbytes", 0, result_size - offset, where)  # the tensor lies in the result
    enc = t.get("enc")
    if enc not in TENSOR_ENCODINGS:
        raise SnapshotError(
            f"{where} ({name}): encoding {_show(enc)} is not one of "
            f"{TENSOR_ENCODINGS}: upgrade echo-rl on this worker"
        )
    doff = _int(t, "doff", 0, payload_size, where)
    dlen = _int(t, "dlen", 0, payload_size - doff, where)  # its encoding lies in the payload
    if enc == "full" and dlen != nbytes:
        raise SnapshotError(f"{where} ({name}): full encoding of {dlen} bytes for {nbytes}")
    numel = 1
    for d in shape:
        numel *= d
    if nbytes != numel * DTYPE_BYTES[dtype]:
        raise SnapshotError(
            f"{where} ({name}): {nbytes} bytes do not hold a {dtype} tensor of shape {shape}"
        )
    return TensorEntry(name, dtype, tuple(shape), offset, nbytes, str(enc), doff, dlen)


def _tensors(
    raw: Mapping[str, object], encoding: str, result: int, size: int
) -> tuple[TensorEntry, ...]:
    tensors = raw.get("tensors")
    if not isinstance(tensors, list):
        raise SnapshotError(f"manifest tensors is {_show(tensors)}, expected a list")
    entries = tuple(_tensor(i, t, result, size) for i, t in enumerate(tensors))
    if len({t.name for t in entries}) != len(entries):
        raise SnapshotError("manifest names a tensor twice")
    if encoding == "full" and any(t.enc != "full" for t in entries):
        raise SnapshotError("a full manifest with a tensor not encoded in full")
    return entries


def _base_version(
    raw: Mapping[str, object],
    encoding: str,
    version: int,
    size: int,
    result: int,
    same_hashes: bool,
) -> int:
    """A full snapshot is its own result; a delta names an earlier version as its base."""
    if encoding != "full":
        return _int(raw, "base_version", 0, version - 1)
    base = _int(raw, "base_version", -1, -1)
    if size != result or not same_hashes:
        raise SnapshotError("a full manifest whose result differs from its payload")
    return base


def parse_manifest(raw: object) -> Manifest:
    """A map from the wire as a ``Manifest``: every key a worker reads, its type and its range
    (the signature is checked apart, ``verify_signature``)."""
    if not isinstance(raw, dict):
        raise SnapshotError(f"manifest is {_show(raw)}, expected a map")
    _schema(raw, "manifest")
    for key in ("run_id", "encoding", "dtype"):
        if not isinstance(raw.get(key), str):
            raise SnapshotError(f"manifest {key!r} is {_show(raw.get(key))}, expected a str")
    encoding = raw["encoding"]
    if encoding not in ENCODINGS:
        raise SnapshotError(
            f"manifest encoding {_show(encoding)} is not one of "
            f"{ENCODINGS}: upgrade echo-rl on this worker"
        )
    version = _int(raw, "version", 0, 2**63 - 1)
    size = _int(raw, "payload_size", 0, MAX_PAYLOAD)
    chunk = _int(raw, "chunk_size", 1, MAX_CHUNK)
    hashes = _hashes("chunk_hashes", raw.get("chunk_hashes"), size, chunk)
    result = _int(raw, "result_size", 0, MAX_PAYLOAD)
    results = _hashes("result_hashes", raw.get("result_hashes"), result, chunk)
    base_version = _base_version(raw, encoding, version, size, result, results == hashes)
    signature = _signature(raw, "manifest", " (Ed25519)")
    tensors = _tensors(raw, encoding, result, size)
    base = raw.get("base_model")  # absent: a whole model's version
    if "base_model" in raw and (not isinstance(base, str) or not BASE_HASH.fullmatch(base)):
        raise SnapshotError(
            f"manifest base_model is {_show(base)}, expected 64 hex digits "
            f"(the BLAKE3 of a LoRA run's base model)"
        )
    return Manifest(
        raw["run_id"],
        version,
        base_version,
        encoding,
        raw["dtype"],
        tensors,
        size,
        chunk,
        hashes,
        result,
        results,
        base,
        signature,
    )
