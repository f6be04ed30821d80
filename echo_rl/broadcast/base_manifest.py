"""The base-model manifest (a LoRA run's base model folder as a signed snapshot of its own kind,
echo_rl/broadcast/basemodel.py) as a declared type, its wire form and its reading: the same
rules as the snapshot manifest's (echo_rl/broadcast/manifest.py), whose checks it shares."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import ClassVar

from echo_rl.broadcast.manifest import (
    BASE_HASH,
    BASE_KIND,
    BASE_VERSION,
    MAX_BASE_BYTES,
    MAX_CHUNK,
    MAX_FILES,
    NAME,
    SCHEMA,
    ChunkLayout,
    Form,
    PackedMap,
    SnapshotError,
    _hashes,
    _int,
    _schema,
    _show,
    _signature,
    signed_bytes,
)


@dataclass(frozen=True)
class BaseFile:
    name: str
    offset: int
    nbytes: int


@dataclass(frozen=True)
class BaseManifest:
    """A LoRA run's base model folder as a signed snapshot of its own kind (echo_rl.broadcast.basemodel):
    its files concatenated in name order."""

    run_id: str
    base_model: str  # hex content hash (echo_rl.core.lora.base_hash) of the model
    files: tuple[BaseFile, ...]
    payload_size: int
    chunk_size: int
    chunk_hashes: tuple[bytes, ...] = ()
    signature: bytes = b""
    schema: ClassVar[int] = SCHEMA
    version: ClassVar[int] = BASE_VERSION
    form: ClassVar[Form] = "base"

    def to_wire(self) -> PackedMap:
        """The map that travels and is signed (its key order fixes the signed bytes)."""
        return {
            "schema": self.schema,
            "kind": BASE_KIND,
            "run_id": self.run_id,
            "version": self.version,
            "base_model": self.base_model,
            "files": [{"name": f.name, "offset": f.offset, "nbytes": f.nbytes} for f in self.files],
            "payload_size": self.payload_size,
            "chunk_size": self.chunk_size,
            "form": self.form,
            "chunk_hashes": list(self.chunk_hashes),
            "signature": self.signature,
        }

    def signed_bytes(self) -> bytes:
        return signed_bytes(self.to_wire())

    @cached_property
    def layout(self) -> ChunkLayout:
        return ChunkLayout(
            self.version, self.payload_size, self.chunk_size, self.chunk_hashes, self.form
        )


def _files(files: object, size: int) -> tuple[BaseFile, ...]:
    """Files that tile the payload exactly, each a plain name, none twice."""
    if not isinstance(files, list) or not 1 <= len(files) <= MAX_FILES:
        raise SnapshotError(
            f"base manifest files is {_show(files)}, expected a list of 1 to {MAX_FILES} entries"
        )
    at, names, out = 0, set(), []
    for i, f in enumerate(files):
        name = f.get("name") if isinstance(f, dict) else None
        if not isinstance(name, str) or not NAME.fullmatch(name) or name in names:
            raise SnapshotError(
                f"base manifest file {i}: name {_show(name)} is not a plain file "
                f"name (letters, digits, . _ -; no path), or names a file twice"
            )
        names.add(name)
        _int(f, "offset", at, at, f"base manifest file {i}")  # starts where the last ended
        nbytes = _int(f, "nbytes", 0, size - at, f"base manifest file {i}")
        out.append(BaseFile(name, at, nbytes))
        at += nbytes
    if at != size:
        raise SnapshotError(f"base manifest files cover {at} of {size} payload bytes")
    return tuple(out)


def parse_base_manifest(raw: object) -> BaseManifest:
    """A base manifest's map as a ``BaseManifest``: every key a worker reads, its type and
    range, and file names that cannot leave the cache folder."""
    if not isinstance(raw, dict) or raw.get("kind") != BASE_KIND:
        raise SnapshotError(
            f"base manifest is {_show(raw)} of kind "
            f"{_show(raw.get('kind') if isinstance(raw, dict) else None)}"
            f", expected kind {BASE_KIND!r}"
        )
    _schema(raw, "base manifest")
    _int(raw, "version", BASE_VERSION, BASE_VERSION, "base manifest")
    if raw.get("form") != BASE_KIND or not isinstance(raw.get("run_id"), str):
        raise SnapshotError("base manifest: form or run_id missing")
    base = raw.get("base_model")
    if not isinstance(base, str) or not BASE_HASH.fullmatch(base):
        raise SnapshotError(f"base manifest base_model is {_show(base)}, expected 64 hex digits")
    size = _int(raw, "payload_size", 1, MAX_BASE_BYTES, "base manifest")
    chunk = _int(raw, "chunk_size", 1, MAX_CHUNK, "base manifest")
    hashes = _hashes("chunk_hashes", raw.get("chunk_hashes"), size, chunk)
    files = _files(raw.get("files"), size)
    signature = _signature(raw, "base manifest")
    return BaseManifest(raw["run_id"], base, files, size, chunk, hashes, signature)
