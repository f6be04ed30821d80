"""Snapshot = signed manifest + payload cut into fixed-size chunks (DESIGN 5).

manifest = {
  "schema": 1, "run_id": str, "version": int, "base_version": int (-1: full snapshot),
  "encoding": "full", "dtype": str,
  "tensors": [{"name", "dtype", "shape", "offset", "nbytes"}, ...],
  "payload_size": int, "chunk_size": int,
  "chunk_hashes": [bytes32, ...],   # BLAKE3 of every chunk, in order
  "signature": bytes64,             # Ed25519 over the canonical msgpack of everything else
}

Workers get the run's public key when they join and refuse a manifest whose signature does not
verify, and any chunk whose hash differs from the manifest's, before using or forwarding it.
A manifest arrives as a map from the wire: ``verify_manifest`` checks its shape (every key's
type and range, the tensor index inside the payload) before the signature, so a manifest of
any shape is refused with a ``SnapshotError`` naming the key, never a KeyError or TypeError
later (docs/fuzzing.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import blake3
import msgpack
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

SCHEMA = 1
ENCODINGS = ("full",)  # the payloads a worker can install
# Bytes per element of the dtypes a tensor may declare (a snapshot's tensors are installed with
# ``getattr(torch, dtype)``: only these names may reach it).
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8, "float8_e4m3fn": 1,
               "float8_e5m2": 1, "int8": 1, "uint8": 1, "int16": 2, "int32": 4, "int64": 8,
               "bool": 1}
MAX_PAYLOAD = 1 << 40  # 1 TiB: far above any policy, far below what would overflow a size
MAX_CHUNK = 1 << 31
MAX_RANK = 16


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


def build_manifest(*, run_id: str, version: int, tensors: list[dict[str, Any]], payload: bytes,
                   chunk_size: int, dtype: str, key: RunKey) -> dict[str, Any]:
    view = memoryview(payload)
    hashes = [chunk_hash(view[i : i + chunk_size]) for i in range(0, len(payload), chunk_size)]
    manifest = {
        "schema": SCHEMA, "run_id": run_id, "version": version, "base_version": -1,
        "encoding": "full", "dtype": dtype, "tensors": tensors, "payload_size": len(payload),
        "chunk_size": chunk_size, "chunk_hashes": hashes,
    }
    manifest["signature"] = key.sign(_signed_part(manifest))
    return manifest


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


def _check_tensor(i: int, t: Any, payload_size: int) -> None:
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
    offset = _int(t, "offset", 0, payload_size, where)
    nbytes = _int(t, "nbytes", 0, payload_size - offset, where)  # the tensor lies in the payload
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
    _int(manifest, "base_version", -1, version)
    size = _int(manifest, "payload_size", 0, MAX_PAYLOAD)
    chunk = _int(manifest, "chunk_size", 1, MAX_CHUNK)
    hashes, sig = manifest.get("chunk_hashes"), manifest.get("signature")
    if not isinstance(hashes, list) or \
            any(not isinstance(h, bytes) or len(h) != 32 for h in hashes):
        raise SnapshotError("manifest chunk_hashes is not a list of 32-byte BLAKE3 hashes")
    if len(hashes) != -(-size // chunk):
        raise SnapshotError(f"manifest lists {len(hashes)} chunk hashes, payload needs "
                            f"{-(-size // chunk)}")
    if not isinstance(sig, bytes) or len(sig) != 64:
        raise SnapshotError(f"manifest signature is {_show(sig)}, expected 64 bytes (Ed25519)")
    tensors = manifest.get("tensors")
    if not isinstance(tensors, list):
        raise SnapshotError(f"manifest tensors is {_show(tensors)}, expected a list")
    for i, t in enumerate(tensors):
        _check_tensor(i, t, size)
    if len({t["name"] for t in tensors}) != len(tensors):
        raise SnapshotError("manifest names a tensor twice")


def verify_manifest(manifest: Any, public_key: bytes) -> None:
    """Refuse (SnapshotError) a manifest of the wrong shape, or not signed by this run's key."""
    check_manifest(manifest)
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(manifest["signature"],
                                                              _signed_part(manifest))
    except (InvalidSignature, ValueError, TypeError):  # ValueError: packb past its depth limit
        raise SnapshotError(f"manifest for version {manifest['version']} fails its Ed25519 "
                            f"signature: not from this run's learner; refusing it") from None


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

    @property
    def version(self) -> int:
        return int(self.manifest["version"])

    def chunk(self, index: int) -> memoryview:
        start, end = chunk_range(self.manifest, index)
        return memoryview(self.payload)[start:end]
