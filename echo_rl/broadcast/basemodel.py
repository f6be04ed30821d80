"""The base model of a LoRA run as a signed, chunked snapshot, and the worker's cache of it.

A LoRA version is an adapter plus the content hash of the base model it applies to
(``echo_rl/core/lora.py``). A worker that lacks that base gets it the way it gets versions: the learner
publishes the base model's folder (config, tokenizer and safetensors files, concatenated) as a
snapshot of its own kind, signed with the run's key and cut into chunks with BLAKE3 hashes::

  base manifest = {
    "schema": 2, "kind": "base", "run_id": str, "version": 0,
    "base_model": str,                   # hex content hash (echo_rl.core.lora.base_hash) of the model
    "files": [{"name", "offset", "nbytes"}, ...],  # the folder's files, in the payload
    "payload_size": int, "chunk_size": int, "chunk_hashes": [bytes32, ...],
    "form": "base",                      # what a chunk request names (echo_rl.broadcast.source)
    "signature": bytes64,                # Ed25519 over the canonical msgpack of the rest
  }

The declared type is ``echo_rl.broadcast.base_manifest.BaseManifest`` (its wire map above is written only
there). ``kind`` keeps the two apart: a policy manifest has no ``kind`` (and ``check_manifest`` needs
``tensors``), so neither verifies as the other. Chunks are requested with form "base" from any
node holding the whole base (the learner, or a worker that fetched it or found it in its cache),
and each is checked against the signed hashes before it is stored or served onward.

The cache (``BaseCache``): ``$ECHO_HOME/base/<hash>/`` (default ``~/.cache/echo/base``), one
folder per base hash, written whole or not at all (a temporary folder renamed into place). A
folder found there is used only after its files, packed again, match every chunk hash of the
run's manifest (the same bytes the learner published); a folder that does not is removed and
fetched again. The loaded model's content hash is then checked against ``base_model`` before
any version is installed on it.
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import replace
from pathlib import Path

from echo_rl.broadcast.base_manifest import BaseFile, BaseManifest, parse_base_manifest
from echo_rl.broadcast.manifest import (
    BASE_KIND,
    BASE_VERSION,
    MAX_BASE_BYTES,
    MAX_FILES,
    NAME,
    SnapshotError,
    verify_signature,
)
from echo_rl.broadcast.snapshot import RunKey, chunk_hashes

log = logging.getLogger(__name__)

KIND = BASE_KIND
VERSION = BASE_VERSION
__all__ = [
    "KIND",
    "MAX_BASE_BYTES",
    "MAX_FILES",
    "VERSION",
    "BaseCache",
    "build_base_manifest",
    "cache_root",
    "check_base_manifest",
    "folder_files",
    "pack",
    "verify_base_manifest",
]
# The folder's files that travel: what from_pretrained reads (no code, no subfolders).
SUFFIXES = (".json", ".safetensors", ".txt", ".model", ".jinja", ".tiktoken")


def folder_files(folder: Path) -> list[Path]:
    """The files of a model folder that make up its base snapshot, sorted by name."""
    files = sorted(
        p
        for p in folder.iterdir()
        if p.is_file() and p.suffix in SUFFIXES and NAME.fullmatch(p.name)
    )
    if not any(p.suffix == ".safetensors" for p in files):
        raise SnapshotError(
            f"{folder} holds no .safetensors file: save the model with "
            f"save_pretrained(safe_serialization=True) to publish it to workers"
        )
    if len(files) > MAX_FILES:
        raise SnapshotError(f"{folder} has {len(files)} model files, at most {MAX_FILES} travel")
    return files


def build_base_manifest(
    *, run_id: str, base_model: str, folder: Path, chunk_size: int, key: RunKey
) -> tuple[BaseManifest, bytearray]:
    """The signed manifest of ``folder`` (a base model whose content hash is ``base_model``)
    and its payload, the files concatenated in name order."""
    entries, offset = [], 0
    for path in folder_files(folder):
        size = path.stat().st_size
        entries.append(BaseFile(path.name, offset, size))
        offset += size
    manifest = BaseManifest(
        run_id=run_id,
        base_model=base_model,
        files=tuple(entries),
        payload_size=offset,
        chunk_size=chunk_size,
    )
    payload = pack(folder, manifest)  # read once into one buffer (no second copy)
    if payload is None:
        raise SnapshotError(f"{folder} changed while it was being read")
    manifest = replace(manifest, chunk_hashes=tuple(chunk_hashes(payload, chunk_size)))
    return replace(manifest, signature=key.sign(manifest.signed_bytes())), payload


def check_base_manifest(raw: object) -> BaseManifest:
    """The shape of a base manifest's map: every key a worker reads, its type and range, and
    file names that cannot leave the cache folder."""
    return parse_base_manifest(raw)


def verify_base_manifest(raw: object, public_key: bytes, run_id: str | None = None) -> BaseManifest:
    """The base manifest a map from the wire holds; refused (SnapshotError) when of the wrong
    shape, of another run, or not signed by this run's key."""
    manifest = parse_base_manifest(raw)
    if run_id is not None and manifest.run_id != run_id:
        raise SnapshotError(
            f"base manifest of run {manifest.run_id!r}, this worker joined {run_id!r}"
        )
    assert isinstance(raw, dict)  # parse_base_manifest refuses anything else
    verify_signature(raw, public_key, "base model")
    return manifest


def pack(folder: Path, manifest: BaseManifest) -> bytearray | None:
    """The payload of ``folder``'s files as ``manifest`` lists them, or None if one is missing
    or of another size."""
    out = bytearray(manifest.payload_size)
    for f in manifest.files:
        path = folder / f.name
        try:
            with open(path, "rb") as fh:
                n = fh.readinto(memoryview(out)[f.offset : f.offset + f.nbytes])
            if n != f.nbytes or path.stat().st_size != f.nbytes:
                return None
        except OSError:
            return None
    return out


def cache_root() -> Path:
    """``$ECHO_HOME/base``, else ``~/.cache/echo/base`` (docs/volunteers.md)."""
    home = os.environ.get("ECHO_HOME")
    return (Path(home) if home else Path.home() / ".cache" / "echo") / "base"


class BaseCache:
    """Base models on disk, one folder per content hash (written whole or not at all)."""

    def __init__(self, root: Path | None = None):
        self.root = root or cache_root()

    def folder(self, manifest: BaseManifest) -> Path:
        return self.root / manifest.base_model

    def lookup(self, manifest: BaseManifest) -> tuple[Path, bytearray] | None:
        """The cached folder of this base and its payload, when its files are exactly the
        manifest's (every chunk hash); a folder that is not is removed (fetched again)."""
        folder = self.folder(manifest)
        if not folder.is_dir():
            return None
        payload = pack(folder, manifest)
        if (
            payload is not None
            and tuple(chunk_hashes(payload, manifest.chunk_size)) == manifest.chunk_hashes
        ):
            return folder, payload
        log.warning(
            "cached base model %s does not match the run's base manifest (damaged or "
            "partly deleted): removing it and fetching it again",
            folder,
        )
        shutil.rmtree(folder, ignore_errors=True)
        return None

    def room(self, manifest: BaseManifest) -> None:
        """Refuse a fetch the disk cannot hold (the payload plus 5 %)."""
        self.root.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(self.root).free
        need = manifest.payload_size * 21 // 20
        if free < need:
            raise SnapshotError(
                f"the run's base model needs {need / 2**30:.2f} GiB in "
                f"{self.root}, {free / 2**30:.2f} GiB are free: free space "
                f"there or set ECHO_HOME to a larger disk (docs/volunteers.md)"
            )

    def write(self, manifest: BaseManifest, payload: bytes | bytearray) -> Path:
        """The verified payload as the base's folder: files written and synced in a temporary
        folder, then renamed into place (a crash leaves only the temporary folder)."""
        final = self.folder(manifest)
        tmp = self.root / f".{final.name}.{os.getpid()}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        view = memoryview(payload)
        for f in manifest.files:
            with open(tmp / f.name, "wb") as fh:
                fh.write(view[f.offset : f.offset + f.nbytes])
                fh.flush()
                os.fsync(fh.fileno())
        try:
            os.replace(tmp, final)
        except OSError:  # another worker on this machine wrote the same base first
            shutil.rmtree(tmp, ignore_errors=True)
            if not final.is_dir():
                raise
        return final

    def remove(self, manifest: BaseManifest) -> None:
        shutil.rmtree(self.folder(manifest), ignore_errors=True)
