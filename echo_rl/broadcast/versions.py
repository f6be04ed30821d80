"""Versions as they are published and rebuilt: the encoder at the root, the rebuild on workers.

``VersionEncoder`` (the learner's publisher thread, and the broadcast benchmark's root) turns the
full payload of each new version into a publication: a keyframe (full snapshot) every
``keyframe_every`` publications, when there is no base yet, or when the delta would not save
enough (``max_ratio``); otherwise a delta against the previous publication. It keeps only the
previous version's full payload (the base of the next delta).

``rebuild`` (every worker, after its relay verified every chunk of the payload) turns a
publication's payload into the version's full payload, from the full payload of the base it
holds, and checks every chunk of the result against the manifest's signed ``result_hashes``:
a rebuilt version is installed only if it is bit for bit the learner's. No torch here.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from echo_rl.broadcast.delta import DeltaError, DeltaStats, decode, encode
from echo_rl.broadcast.manifest import Manifest
from echo_rl.broadcast.snapshot import RunKey, SnapshotError, build_manifest, chunk_hashes
from echo_rl.core.layout import Payload, TensorLayout
from echo_rl.core.spill import drop_pages


@dataclass
class Publication:
    manifest: Manifest
    payload: Payload  # what travels (the delta, or the full payload of a keyframe)
    result: Payload  # the full payload it rebuilds
    stats: DeltaStats = field(default_factory=DeltaStats)
    build_s: float = 0.0  # encode + hashes + signature

    @property
    def version(self) -> int:
        return self.manifest.version


class VersionEncoder:
    def __init__(
        self,
        *,
        run_id: str,
        key: RunKey,
        chunk_size: int,
        dtype: str,
        delta: bool = True,
        keyframe_every: int = 10,
        max_ratio: float = 0.8,
        base_model: str | None = None,
    ):
        self.run_id, self.key, self.chunk_size, self.dtype = run_id, key, chunk_size, dtype
        # A delta's encode uses up to 8 of the host's cores: idle under a GPU step, and between
        # steps on a CPU learner, which builds its publication inline (docs/broadcast.md,
        # "Delta snapshots"); the bytes do not depend on it.
        self.threads = min(8, os.cpu_count() or 1)
        self.base_model = base_model  # LoRA: every version is an adapter for this base model
        self.delta, self.keyframe_every, self.max_ratio = delta, keyframe_every, max_ratio
        self._base: tuple[int, list[TensorLayout], Payload] | None = None
        self._since_keyframe = 0

    def build(self, version: int, tensors: list[TensorLayout], full: Payload) -> Publication:
        t0 = time.perf_counter()
        pub = self._delta(version, tensors, full) if self._wants_delta(tensors, full) else None
        if pub is None:
            manifest = build_manifest(
                run_id=self.run_id,
                version=version,
                tensors=tensors,
                payload=full,
                chunk_size=self.chunk_size,
                dtype=self.dtype,
                key=self.key,
                base_model=self.base_model,
            )
            pub = Publication(
                manifest, full, full, DeltaStats(full_bytes=len(full), payload_bytes=len(full))
            )
            self._since_keyframe = 0
        else:
            self._since_keyframe += 1
        drop_pages(full)  # hashed whole for the manifest (the encoder drops its own reads)
        self._base = (version, tensors, full)
        pub.build_s = time.perf_counter() - t0
        return pub

    def _wants_delta(self, tensors: list[TensorLayout], full: Payload) -> bool:
        if not self.delta or self._base is None or self._since_keyframe + 1 >= self.keyframe_every:
            return False
        _, base_tensors, base = self._base
        return base_tensors == tensors and len(base) == len(full)

    def _delta(
        self, version: int, tensors: list[TensorLayout], full: Payload
    ) -> Publication | None:
        assert self._base is not None
        base_version, _, base = self._base
        entries, payload, stats = encode(tensors, full, base, self.threads)
        if stats.ratio > self.max_ratio:  # most of the model changed: a keyframe costs as much
            return None
        manifest = build_manifest(
            run_id=self.run_id,
            version=version,
            tensors=entries,
            payload=payload,
            chunk_size=self.chunk_size,
            dtype=self.dtype,
            key=self.key,
            base_version=base_version,
            result=full,
            base_model=self.base_model,
        )
        return Publication(manifest, payload, full, stats)


class BaseMissing(SnapshotError):
    """This node does not hold the base a delta was made from: it needs a keyframe."""

    default_reason = "base_missing"


def rebuild(
    manifest: Manifest, payload: Payload, base: Payload | None, out: bytearray | None = None
) -> Payload:
    """The full payload of a verified manifest whose payload chunks all verified.

    ``base``: the full payload of ``manifest.base_version`` held here (None: none). Raises
    ``BaseMissing`` when a delta cannot be applied here, ``SnapshotError`` when the rebuilt
    bytes differ from the signed result (then fetch a keyframe)."""
    if manifest.encoding == "full":
        return payload  # its chunks were checked against chunk_hashes == result_hashes
    if base is None:
        raise BaseMissing(
            f"version {manifest.version} is a delta from version "
            f"{manifest.base_version}, not held here"
        )
    try:
        result = decode(manifest.tensors, payload, base, manifest.result_size, out)
    except DeltaError as err:
        raise SnapshotError(f"version {manifest.version}: {err}") from None
    check_result(manifest, result)
    return result


def check_result(manifest: Manifest, result: Payload) -> None:
    """Every chunk of a rebuilt payload against the signed result hashes."""
    view = memoryview(result)
    if len(view) != manifest.result_size:
        raise SnapshotError(
            f"version {manifest.version}: rebuilt {len(view)} bytes, the "
            f"manifest says {manifest.result_size}"
        )
    hashes = chunk_hashes(view, manifest.chunk_size)
    for i, (got, expected) in enumerate(zip(hashes, manifest.result_hashes)):
        if got != expected:
            raise SnapshotError(
                f"version {manifest.version}: rebuilt chunk {i} differs from "
                f"the learner's (base {manifest.base_version} not the "
                f"learner's?); fetching a keyframe"
            )
