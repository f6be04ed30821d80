"""The snapshot plane: publication notices, sources, install reports (control socket) and chunk
requests (snapshot socket)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from echo_rl.core.wire.base import Message


class SnapshotNotice(Message):
    TYPE = "snapshot_notice"
    version: int
    manifest: dict[str, Any]
    source: str  # endpoint to pull the chunks from (the topology's choice for this worker)
    source_key: bytes = b""  # its CURVE public key
    ticket: bytes = b""  # lets this worker pull from it (echo_rl.broadcast.tickets)


# Why a worker asks for a source: a failure of ``bad_source`` (the first four are evidence
# against it, echo_rl.broadcast.reports), a punched link that failed, ``avoided`` (a notice named a
# relay that failed this worker before: no new evidence, echo_rl/worker/snapshots.py) or ``no_base``
# (the first source of a keyframe or of the base model). A closed set: a peer's string never
# becomes a metric's key.
SourceReason = Literal[
    "corrupt",
    "suspect",
    "timeout",
    "disconnected",
    "refused",
    "unpunchable",
    "tunnel_lost",
    "avoided",
    "no_base",
]


class SourceRequest(Message):
    """A worker's snapshot source failed (disconnected, timeout, corrupt, refused): where now?"""

    TYPE = "source_request"
    worker_id: str
    version: int
    bad_source: str
    reason: SourceReason
    # with reason "corrupt": the chunk that failed its hash (checked by the learner)
    chunk: int = -1
    # "full": a keyframe source for this version; "base": a source of the run's base model
    # (a LoRA run, echo_rl.broadcast.basemodel; version 0)
    form: Literal["payload", "full", "base"] = "payload"


class SourceGrant(Message):
    TYPE = "source_grant"
    version: int
    source: str
    source_key: bytes = b""
    ticket: bytes = b""


class Installed(Message):
    """A worker installed (or, for a pure relay, completely received) a snapshot."""

    TYPE = "installed"
    worker_id: str
    version: int
    digest: bytes = b""  # BLAKE3 of the whole payload, so the root can count corrupt installs
    # Measured for this version (Mbit/s, 0 = not measured), docs/security.md "Measured, not
    # declared": bytes received / seconds the fetch took, and bytes this worker's chunk server
    # sent / seconds a reply was waiting to go out (its upload while it had something to send).
    down_mbit: float = Field(0.0, ge=0)
    up_mbit: float = Field(0.0, ge=0)
    # Rebuilding the version from its delta (s; 0 for a full snapshot), and whether this worker
    # had to fetch a keyframe (it lacked the base). Shown on the dashboard, trusted for nothing.
    decode_s: float = Field(0.0, ge=0, le=86400)
    keyframe: bool = False


class ChunkRequest(Message):
    TYPE = "chunk_request"
    version: int
    index: int = Field(ge=0)
    ticket: bytes = Field(b"", max_length=512)  # who may pull (echo_rl.broadcast.tickets)
    # "full": the rebuilt payload (a keyframe); "base": the run's base model (echo_rl.broadcast.basemodel)
    form: Literal["payload", "full", "base"] = "payload"


class Chunk(Message):
    TYPE = "chunk"
    version: int
    index: int
