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


def verify_manifest(manifest: dict[str, Any], public_key: bytes) -> None:
    if not isinstance(manifest, dict) or manifest.get("schema") != SCHEMA:
        raise SnapshotError(f"manifest schema {manifest.get('schema') if isinstance(manifest, dict) else None!r} "
                            f"is not {SCHEMA}: upgrade echo-rl")
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(manifest.get("signature", b""),
                                                              _signed_part(manifest))
    except (InvalidSignature, ValueError, TypeError):
        raise SnapshotError(f"manifest for version {manifest.get('version')} fails its Ed25519 "
                            f"signature: not from this run's learner; refusing it") from None
    n = -(-manifest["payload_size"] // manifest["chunk_size"]) if manifest["payload_size"] else 0
    if len(manifest["chunk_hashes"]) != n:
        raise SnapshotError(f"manifest lists {len(manifest['chunk_hashes'])} chunk hashes, "
                            f"payload needs {n}")


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
