"""Snapshot = signed manifest + payload cut into fixed-size chunks (docs/design.md §5).

manifest = {
  "schema": 2, "run_id": str, "version": int,
  "encoding": "full" | "delta",     # delta: rebuilt from the full payload of base_version
  "base_version": int,              # -1 for a full snapshot (a keyframe)
  "dtype": str,
  "tensors": [{"name", "dtype", "shape",
               "offset", "nbytes",  # the tensor's place in the rebuilt (full) payload
               "enc", "doff", "dlen"}, ...],  # its encoding and its slice of this payload
  "payload_size": int, "chunk_size": int,
  "chunk_hashes": [bytes32, ...],   # BLAKE3 of every chunk of the payload sent, in order
  "result_size": int,               # the full payload the worker installs
  "result_hashes": [bytes32, ...],  # BLAKE3 of every chunk of it (== chunk_hashes when full)
  "base_model": str,                # LoRA runs only: hex BLAKE3 of the base model the tensors
                                    # (an adapter's) apply to (echo/lora.py)
  "signature": bytes64,             # Ed25519 over the canonical msgpack of everything else
}

The signature covers the hashes of the result, so a worker that rebuilt a version from a delta
proves, chunk by chunk, that it holds exactly the learner's bytes before it installs them; and a
peer holding that result can serve it as a keyframe (``result_view``) to a worker without the
base, whose chunks are checked against the same signed hashes (docs/broadcast.md).

Workers get the run's public key when they join and refuse a manifest whose signature does not
verify, and any chunk whose hash differs from the manifest's, before using or forwarding it.
A manifest arrives as a map from the wire: ``verify_manifest`` checks its shape (every key's
type and range, the tensor index inside the payload) before the signature, so a manifest of
any shape is refused with a ``SnapshotError`` naming the key, never a KeyError or TypeError
later (docs/fuzzing.md).
"""

from __future__ import annotations

import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import blake3
import msgpack
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

SCHEMA = 2
ENCODINGS = ("full", "delta")  # the payloads a worker can install
TENSOR_ENCODINGS = ("full", "xor_lz4", "sparse")  # per tensor (broadcast.delta)
# Bytes per element of the dtypes a tensor may declare (a snapshot's tensors are installed with
# ``getattr(torch, dtype)``: only these names may reach it).
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8, "float8_e4m3fn": 1,
               "float8_e5m2": 1, "int8": 1, "uint8": 1, "int16": 2, "int32": 4, "int64": 8,
               "bool": 1}
MAX_PAYLOAD = 1 << 40  # 1 TiB: far above any policy, far below what would overflow a size
MAX_CHUNK = 1 << 31
MAX_RANK = 16
BASE_HASH = re.compile(r"[0-9a-f]{64}")


class SnapshotError(ValueError):
    pass


class RunKey:
    """The learner's Ed25519 signing key for one run."""

    def __init__(self, private: Ed25519PrivateKey):
        self._private = private

    @classmethod
    def generate(cls) -> "RunKey":
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_bytes(cls, raw: bytes) -> "RunKey":
        return cls(Ed25519PrivateKey.from_private_bytes(raw))

    def private_bytes(self) -> bytes:
        return self._private.private_bytes(serialization.Encoding.Raw,
                                           serialization.PrivateFormat.Raw,
                                           serialization.NoEncryption())

    @property
    def public_bytes(self) -> bytes:
        return self._private.public_key().public_bytes(serialization.Encoding.Raw,
                                                       serialization.PublicFormat.Raw)

    def sign(self, data: bytes) -> bytes:
        return self._private.sign(data)


def _signed_part(manifest: dict[str, Any]) -> bytes:
    body = {k: v for k, v in manifest.items() if k != "signature"}
    return msgpack.packb(body, use_bin_type=True)


def chunk_hash(data: bytes | memoryview) -> bytes:
    return blake3.blake3(data).digest()


def chunk_hashes(data: bytes | bytearray | memoryview, chunk_size: int) -> list[bytes]:
    """BLAKE3 of every chunk, on up to 4 threads (BLAKE3 releases the GIL)."""
    view = memoryview(data)
    starts = range(0, len(view), chunk_size)
    if len(starts) < 8:
        return [chunk_hash(view[i : i + chunk_size]) for i in starts]
    with ThreadPoolExecutor(min(4, os.cpu_count() or 1)) as pool:
        return list(pool.map(lambda i: chunk_hash(view[i : i + chunk_size]), starts))


def build_manifest(*, run_id: str, version: int, tensors: list[dict[str, Any]], payload: bytes,
                   chunk_size: int, dtype: str, key: RunKey, base_version: int = -1,
                   result: bytes | bytearray | None = None,
                   base_model: str | None = None) -> dict[str, Any]:
    """A full snapshot (``tensors``: the layout of ``payload``), or with ``base_version`` and
    ``result`` a delta (``tensors``: the entries ``broadcast.delta.encode`` returned,
    ``payload``: the delta, ``result``: the full payload it rebuilds). ``base_model``: the
    base model's content hash when the tensors are a LoRA adapter's (signed with the rest)."""
    hashes = chunk_hashes(payload, chunk_size)
    if result is None:
        tensors = [{**t, "enc": "full", "doff": t["offset"], "dlen": t["nbytes"]} for t in tensors]
    manifest = {
        "schema": SCHEMA, "run_id": run_id, "version": version, "base_version": base_version,
        "encoding": "full" if result is None else "delta", "dtype": dtype, "tensors": tensors,
        "payload_size": len(payload), "chunk_size": chunk_size, "chunk_hashes": hashes,
        "result_size": len(payload if result is None else result),
        "result_hashes": hashes if result is None else chunk_hashes(result, chunk_size),
    }
    if base_model is not None:
        manifest["base_model"] = base_model
    manifest["signature"] = key.sign(_signed_part(manifest))
    return manifest


def result_view(manifest: dict[str, Any]) -> dict[str, Any]:
    """The rebuilt (full) payload of a verified manifest, described as a payload: what a
    keyframe fetch receives into and checks chunk by chunk (``form`` "full")."""
    return {"version": manifest["version"], "payload_size": manifest["result_size"],
            "chunk_size": manifest["chunk_size"], "chunk_hashes": manifest["result_hashes"],
            "form": "full"}


def _int(obj: dict[str, Any], key: str, lo: int, hi: int, where: str = "manifest") -> int:
    value = obj.get(key)
    if type(value) is not int or not lo <= value <= hi:  # type(): True is no version
        raise SnapshotError(f"{where} {key!r} is {_show(value)}, expected an int in "
                            f"[{lo}, {hi}]: not a manifest from an echo-rl learner; refusing it")
    return value


def _show(value: Any) -> str:
    text = repr(value) if isinstance(value, (int, float, str, bytes, type(None))) else \
        f"a {type(value).__name__}"
    return text if len(text) <= 40 else text[:37] + "..."


def _check_tensor(i: int, t: Any, result_size: int, payload_size: int) -> None:
    where = f"manifest tensor {i}"
    if not isinstance(t, dict):
        raise SnapshotError(f"{where} is {_show(t)}, expected a map")
    name, dtype, shape = t.get("name"), t.get("dtype"), t.get("shape")
    if not isinstance(name, str) or not name:
        raise SnapshotError(f"{where}: name is {_show(name)}, expected a non-empty str")
    if not isinstance(dtype, str) or dtype not in DTYPE_BYTES:
        raise SnapshotError(f"{where} ({name}): dtype {_show(dtype)} is not one of "
                            f"{sorted(DTYPE_BYTES)}")
    if not isinstance(shape, list) or len(shape) > MAX_RANK or \
            any(type(d) is not int or d < 0 for d in shape):
        raise SnapshotError(f"{where} ({name}): shape {_show(shape)} is not a list of at most "
                            f"{MAX_RANK} ints >= 0")
    offset = _int(t, "offset", 0, result_size, where)
    nbytes = _int(t, "nbytes", 0, result_size - offset, where)  # the tensor lies in the result
    enc = t.get("enc")
    if enc not in TENSOR_ENCODINGS:
        raise SnapshotError(f"{where} ({name}): encoding {_show(enc)} is not one of "
                            f"{TENSOR_ENCODINGS}: upgrade echo-rl on this worker")
    doff = _int(t, "doff", 0, payload_size, where)
    dlen = _int(t, "dlen", 0, payload_size - doff, where)  # its encoding lies in the payload
    if enc == "full" and dlen != nbytes:
        raise SnapshotError(f"{where} ({name}): full encoding of {dlen} bytes for {nbytes}")
    numel = 1
    for d in shape:
        numel *= d
    if nbytes != numel * DTYPE_BYTES[dtype]:
        raise SnapshotError(f"{where} ({name}): {nbytes} bytes do not hold a {dtype} tensor of "
                            f"shape {shape}")


def check_manifest(manifest: Any) -> None:
    """The manifest's shape: every key a worker reads, its type and its range."""
    if not isinstance(manifest, dict):
        raise SnapshotError(f"manifest is {_show(manifest)}, expected a map")
    if type(manifest.get("schema")) is not int or manifest["schema"] != SCHEMA:
        raise SnapshotError(f"manifest schema {_show(manifest.get('schema'))} is not {SCHEMA}: "
                            f"upgrade echo-rl")
    for key in ("run_id", "encoding", "dtype"):
        if not isinstance(manifest.get(key), str):
            raise SnapshotError(f"manifest {key!r} is {_show(manifest.get(key))}, expected a str")
    if manifest["encoding"] not in ENCODINGS:
        raise SnapshotError(f"manifest encoding {_show(manifest['encoding'])} is not one of "
                            f"{ENCODINGS}: upgrade echo-rl on this worker")
    version = _int(manifest, "version", 0, 2**63 - 1)
    size = _int(manifest, "payload_size", 0, MAX_PAYLOAD)
    chunk = _int(manifest, "chunk_size", 1, MAX_CHUNK)
    hashes, sig = manifest.get("chunk_hashes"), manifest.get("signature")
    _check_hashes("chunk_hashes", hashes, size, chunk)
    result = _int(manifest, "result_size", 0, MAX_PAYLOAD)
    _check_hashes("result_hashes", manifest.get("result_hashes"), result, chunk)
    _check_encoding(manifest, version, size, result)
    if not isinstance(sig, bytes) or len(sig) != 64:
        raise SnapshotError(f"manifest signature is {_show(sig)}, expected 64 bytes (Ed25519)")
    tensors = manifest.get("tensors")
    if not isinstance(tensors, list):
        raise SnapshotError(f"manifest tensors is {_show(tensors)}, expected a list")
    for i, t in enumerate(tensors):
        _check_tensor(i, t, result, size)
    if len({t["name"] for t in tensors}) != len(tensors):
        raise SnapshotError("manifest names a tensor twice")
    if manifest["encoding"] == "full" and any(t["enc"] != "full" for t in tensors):
        raise SnapshotError("a full manifest with a tensor not encoded in full")
    base = manifest.get("base_model", "0" * 64)
    if not isinstance(base, str) or not BASE_HASH.fullmatch(base):
        raise SnapshotError(f"manifest base_model is {_show(base)}, expected 64 hex digits "
                            f"(the BLAKE3 of a LoRA run's base model)")


def _check_hashes(key: str, hashes: Any, size: int, chunk: int) -> None:
    if not isinstance(hashes, list) or \
            any(not isinstance(h, bytes) or len(h) != 32 for h in hashes):
        raise SnapshotError(f"manifest {key} is not a list of 32-byte BLAKE3 hashes")
    if len(hashes) != -(-size // chunk):
        raise SnapshotError(f"manifest lists {len(hashes)} {key}, {size} bytes need "
                            f"{-(-size // chunk)}")


def _check_encoding(manifest: dict[str, Any], version: int, size: int, result: int) -> None:
    """A full snapshot is its own result; a delta names an earlier version as its base."""
    if manifest["encoding"] == "full":
        _int(manifest, "base_version", -1, -1)
        if size != result or manifest["result_hashes"] != manifest["chunk_hashes"]:
            raise SnapshotError("a full manifest whose result differs from its payload")
    else:
        _int(manifest, "base_version", 0, version - 1)


def verify_manifest(manifest: Any, public_key: bytes) -> None:
    """Refuse (SnapshotError) a manifest of the wrong shape, or not signed by this run's key."""
    check_manifest(manifest)
    verify_manifest_signature(manifest, public_key, f"version {manifest['version']}")


def verify_manifest_signature(manifest: dict[str, Any], public_key: bytes, what: str) -> None:
    """Refuse a manifest (of a checked shape) not signed by this run's key."""
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(manifest["signature"],
                                                              _signed_part(manifest))
    except (InvalidSignature, ValueError, TypeError):  # ValueError: packb past its depth limit
        raise SnapshotError(f"manifest for {what} fails its Ed25519 signature: not from this "
                            f"run's learner; refusing it") from None


def num_chunks(manifest: dict[str, Any]) -> int:
    return len(manifest["chunk_hashes"])


def chunk_range(manifest: dict[str, Any], index: int) -> tuple[int, int]:
    start = index * manifest["chunk_size"]
    return start, min(start + manifest["chunk_size"], manifest["payload_size"])


def verify_chunk(manifest: dict[str, Any], index: int, data: bytes | memoryview) -> None:
    start, end = chunk_range(manifest, index)
    if len(data) != end - start:
        raise SnapshotError(f"chunk {index} of version {manifest['version']} has {len(data)} "
                            f"bytes, expected {end - start}")
    if chunk_hash(data) != manifest["chunk_hashes"][index]:
        raise SnapshotError(f"chunk {index} of version {manifest['version']} fails its BLAKE3 "
                            f"hash: corrupted in transit or by a relay")


@dataclass
class Snapshot:
    manifest: dict[str, Any]
    payload: bytes
    result: bytes | bytearray | None = None  # the full payload, when ``payload`` is a delta

    @property
    def full(self) -> bytes | bytearray:
        return self.payload if self.result is None else self.result

    @property
    def version(self) -> int:
        return int(self.manifest["version"])

    def chunk(self, index: int) -> memoryview:
        start, end = chunk_range(self.manifest, index)
        return memoryview(self.payload)[start:end]
