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
                                    # (an adapter's) apply to (echo_rl/core/lora.py)
  "signature": bytes64,             # Ed25519 over the canonical msgpack of everything else
}

The signature covers the hashes of the result, so a worker that rebuilt a version from a delta
proves, chunk by chunk, that it holds exactly the learner's bytes before it installs them; and a
peer holding that result can serve it as a keyframe (``Manifest.result_layout``) to a worker without the
base, whose chunks are checked against the same signed hashes (docs/broadcast.md).

Workers get the run's public key when they join and refuse a manifest whose signature does not
verify, and any chunk whose hash differs from the manifest's, before using or forwarding it.
A manifest arrives as a map from the wire: ``verify_manifest`` checks its shape (every key's
type and range, the tensor index inside the payload) before the signature, so a manifest of
any shape is refused with a ``SnapshotError`` naming the key, never a KeyError or TypeError
later (docs/fuzzing.md), and returns it as a ``echo_rl.broadcast.manifest.Manifest``, the declared
type every other module reads by attribute.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from echo_rl.broadcast.manifest import (
    BASE_HASH,
    DTYPE_BYTES,
    ENCODINGS,
    MAX_CHUNK,
    MAX_PAYLOAD,
    MAX_RANK,
    SCHEMA,
    TENSOR_ENCODINGS,
    Manifest,
    SnapshotError,
    TensorEntry,
    chunk_hash,
    parse_manifest,
    verify_signature,
)
from echo_rl.core.layout import Payload, TensorLayout

__all__ = [
    "BASE_HASH",
    "DTYPE_BYTES",
    "ENCODINGS",
    "MAX_CHUNK",
    "MAX_PAYLOAD",
    "MAX_RANK",
    "SCHEMA",
    "TENSOR_ENCODINGS",
    "RunKey",
    "Snapshot",
    "SnapshotError",
    "build_manifest",
    "check_manifest",
    "chunk_hash",
    "chunk_hashes",
    "verify_manifest",
]


class RunKey:
    """The learner's Ed25519 signing key for one run."""

    def __init__(self, private: Ed25519PrivateKey):
        self._private = private

    @classmethod
    def generate(cls) -> RunKey:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_bytes(cls, raw: bytes) -> RunKey:
        return cls(Ed25519PrivateKey.from_private_bytes(raw))

    def private_bytes(self) -> bytes:
        return self._private.private_bytes(
            serialization.Encoding.Raw,
            serialization.PrivateFormat.Raw,
            serialization.NoEncryption(),
        )

    @property
    def public_bytes(self) -> bytes:
        return self._private.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )

    def sign(self, data: bytes) -> bytes:
        return self._private.sign(data)


def chunk_hashes(data: Payload, chunk_size: int) -> list[bytes]:
    """BLAKE3 of every chunk, on up to 4 threads (BLAKE3 releases the GIL)."""
    view = memoryview(data)
    starts = range(0, len(view), chunk_size)
    if len(starts) < 8:
        return [chunk_hash(view[i : i + chunk_size]) for i in starts]
    with ThreadPoolExecutor(min(4, os.cpu_count() or 1)) as pool:
        return list(pool.map(lambda i: chunk_hash(view[i : i + chunk_size]), starts))


def build_manifest(
    *,
    run_id: str,
    version: int,
    tensors: list[TensorLayout] | list[TensorEntry],
    payload: Payload,
    chunk_size: int,
    dtype: str,
    key: RunKey,
    base_version: int = -1,
    result: Payload | None = None,
    base_model: str | None = None,
) -> Manifest:
    """A full snapshot (``tensors``: the layout of ``payload``, as ``params_to_payload`` gives
    it), or with ``base_version`` and ``result`` a delta (``tensors``: the entries
    ``echo_rl.broadcast.delta.encode`` returned, ``payload``: the delta, ``result``: the full payload
    it rebuilds). ``base_model``: the base model's content hash when the tensors are a LoRA
    adapter's (signed with the rest)."""
    hashes = tuple(chunk_hashes(payload, chunk_size))
    if result is None:  # a full snapshot: every tensor sent whole
        entries = tuple(
            TensorEntry.full(t.layout() if isinstance(t, TensorEntry) else t) for t in tensors
        )
    else:
        entries = tuple(
            t if isinstance(t, TensorEntry) else TensorEntry.encoded(t) for t in tensors
        )
    manifest = Manifest(
        run_id=run_id,
        version=version,
        base_version=base_version,
        encoding="full" if result is None else "delta",
        dtype=dtype,
        tensors=entries,
        payload_size=len(payload),
        chunk_size=chunk_size,
        chunk_hashes=hashes,
        result_size=len(payload if result is None else result),
        result_hashes=hashes if result is None else tuple(chunk_hashes(result, chunk_size)),
        base_model=base_model,
    )
    return replace(manifest, signature=key.sign(manifest.signed_bytes()))


def check_manifest(raw: object) -> Manifest:
    """The manifest's shape: every key a worker reads, its type and its range."""
    return parse_manifest(raw)


def verify_manifest(raw: object, public_key: bytes) -> Manifest:
    """The manifest a map from the wire holds; refused (SnapshotError) when of the wrong shape,
    or not signed by this run's key."""
    manifest = parse_manifest(raw)
    assert isinstance(raw, dict)  # parse_manifest refuses anything else
    verify_signature(raw, public_key, f"version {manifest.version}")
    return manifest


@dataclass
class Snapshot:
    manifest: Manifest
    payload: Payload
    result: Payload | None = None  # the full payload, when ``payload`` is a delta

    @property
    def full(self) -> Payload:
        return self.payload if self.result is None else self.result

    @property
    def version(self) -> int:
        return self.manifest.version

    def chunk(self, index: int) -> memoryview:
        start, end = self.manifest.layout.chunk_range(index)
        return memoryview(self.payload)[start:end]
