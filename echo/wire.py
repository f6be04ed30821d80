"""Echo's wire schema: every message between learner and workers, in one place.

Transport: pyzmq with CurveZMQ (``echo.security``): the sender of every message is the public
key its connection authenticated, never a field of the message; a ``worker_id`` field must be the
id bound to that key at join, else the message is refused (``identity_mismatch``). The learner binds a ROUTER socket (control) and a second ROUTER (snapshot
chunks); each worker connects one DEALER to each. A message is one frame: a msgpack map with
``v`` (schema version, ``WIRE_VERSION``) and ``type``; a chunk reply carries the chunk bytes in
a second frame so they are never copied into msgpack.

Worker -> learner (control socket)
  join            worker_id, price, backend, can_relay  -> join_ack | error
                  join_ack.base_manifest: a LoRA run's signed base model manifest
                  (``broadcast.basemodel``), or None
  heartbeat       worker_id, version, throughput, state, base -> heartbeat_ack{account}
                  base: this worker's relay holds the run's base model whole (a LoRA run;
                  the learner may send others to fetch it there, form "base")
                  account: the learner's books on this worker (``Account``): what the
                  worker's status view shows (docs/volunteers.md)
  work_request    worker_id, max_groups, holding        -> work_grant
  trajectories    worker_id, batch_id, count, payload   -> ack
                  payload = lz4.frame(msgpack([record, ...])), record schema in
                  ``dataplane.records``; at-least-once: the worker resends until acked.
  handback        worker_id, reason, groups, prefixes   -> handback_ack
                  leases given back before stopping (preempted, yielded): prefixes are
                  the samples cut short, continued by another worker (docs/preemption.md)
  leave           worker_id                             -> farewell{account}
                  the final account; a worker that does not wait for it loses nothing
  source_request  worker_id, version, bad_source, reason, form -> source_grant{source}
                  form "full": where to fetch the version's rebuilt (full) payload, a
                  keyframe: this worker lacks the base of a delta (reason "no_base") or its
                  keyframe source failed (docs/broadcast.md, "Delta snapshots"); form "base":
                  where to fetch the base model of a LoRA run (join_ack.base_manifest)
  installed       worker_id, version, digest, down_mbit, up_mbit, decode_s, keyframe -> (none)
                  down_mbit/up_mbit: the link rates this worker *measured* for that version
                  (its fetch; its chunk server's serving), 0 = not measured. Added with
                  defaults in v1: an older worker's report parses as "not measured"; the
                  learner believes them only combined with the other end (broadcast.links).
  doctor          (nothing)                             -> doctor_ack{snapshot_endpoint, reflectors}
                  a health check (``echo-worker doctor``, ``echo-rl doctor``): answered to any
                  key that passed the handshake, joined or not; nothing is stored or counted
  nat_report      worker_id, nonces                     -> nat_status{nat, address}
                  nonces: the two probes this worker sent to the learner's reflector from
                  its punch port (``broadcast.nat.reflect``); the learner classifies from
                  what its reflector saw, not from anything the worker says it saw
Learner -> worker (control socket, unsolicited)
  snapshot_notice version, manifest                     a new snapshot is published
  punch           punch_id, role, address, endpoint     open a punched link to a peer now
                  (docs/nat.md): the child's source is then "punch/<id>/<endpoint>"
  shutdown        reason, account                       the run is over (with the final account)
  farewell        account                               quarantined: the final account, just
                                                        before the refusal that stops the worker
Worker -> learner or parent relay (snapshot socket)
  chunk_request   version, index, form                  -> chunk (+ bytes frame) | error
                  (a relay parks a request for a chunk it does not hold yet and answers
                  when the chunk has arrived and verified: see ``broadcast.source``;
                  form "full" asks for a chunk of the rebuilt payload of an installed version)

Receipt: ``decode`` checks size, msgpack, version, type and fields, and raises ``WireError``
with a short machine reason (counted by the receiver) and a human detail (logged with the
sender's id). Unknown fields are rejected so a typo never passes silently. Any bytes at all
give a message or a ``WireError``, never another exception (docs/fuzzing.md): msgpack runs
with every length bounded by the frame's size and extension types refused, and the fields
are validated strictly (``True`` is not an int, ``1`` is not a bool, no NaN or infinity).
"""

from __future__ import annotations

import reprlib
from typing import Annotated, Any, ClassVar, Literal

import lz4.frame
import msgpack
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

WIRE_VERSION = 1


class WireError(ValueError):
    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class Message(BaseModel):
    # allow_inf_nan=False: a NaN or infinite rate or price is refused when the message is built
    # and when it is received, so it never reaches the learner's arithmetic.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    TYPE: ClassVar[str] = ""
    v: int = WIRE_VERSION
    type: str = ""
    rid: int = 0  # request id, echoed in the reply so late replies can be told apart

    # A before-validator, not an ``__init__``: pydantic routes ``model_validate`` through a
    # custom ``__init__``, which would validate received frames in lax mode (``True`` as 1).
    @model_validator(mode="before")
    @classmethod
    def _default_type(cls, data: Any) -> Any:
        if isinstance(data, dict) and "type" not in data:
            data = {**data, "type": cls.TYPE}
        return data


class Join(Message):
    TYPE = "join"
    worker_id: str = Field(min_length=1, max_length=128)
    price: float = Field(0.0, ge=0)
    backend: str = "transformers"
    can_relay: bool = True
    relay_endpoint: str = ""  # where this worker serves chunks to a child; "" = unreachable
    down_mbit: float = Field(0.0, ge=0)  # declared link rates, 0 = unknown
    up_mbit: float = Field(0.0, ge=0)
    token: str = Field("", max_length=128)  # join token, when the learner asks for one


class NatReport(Message):
    TYPE = "nat_report"
    worker_id: str
    nonces: list[bytes] = Field(min_length=2, max_length=2)


class NatStatus(Message):
    TYPE = "nat_status"
    nat: Literal["reachable", "punchable", "none"]
    address: str = ""  # the punch port's public ip:port as the learner saw it


class Punch(Message):
    """Open a punched link: connect from the punch port to ``address`` now (the peer is told
    the same). ``endpoint`` is the parent's relay endpoint: the parent forwards the link's
    sessions there; the child's fetches name it in their tickets."""

    TYPE = "punch"
    punch_id: bytes = Field(min_length=16, max_length=16)
    role: Literal["parent", "child"]
    address: str = Field(min_length=3, max_length=64)
    endpoint: str = Field(min_length=1, max_length=256)
    timeout_s: float = Field(10.0, gt=0, le=120)


class JoinAck(Message):
    TYPE = "join_ack"
    run_id: str
    instance_id: str  # changes when the learner restarts; workers re-join when it does
    public_key: bytes  # Ed25519 key that signs every snapshot manifest
    version: int  # latest published snapshot version, -1 if none yet
    manifest: dict[str, Any] | None = None
    config: dict[str, Any]  # EchoConfig.worker_view()
    snapshot_endpoint: str
    snapshot_key: bytes = b""  # CURVE public key of that source (b"": plaintext)
    ticket: bytes = b""  # lets this worker pull from it (broadcast.tickets)
    worker_id: str = ""  # the id this session is known by (bound to the worker's key)
    reflectors: list[str] = Field(default_factory=list, max_length=2)  # "ip:port": NAT probes
    # A LoRA run on a model folder: the signed manifest of its base model, which a worker
    # without it fetches (chunk requests of form "base") and caches (broadcast.basemodel)
    base_manifest: dict[str, Any] | None = None


class Account(BaseModel):
    """The learner's books on one worker, as the worker is told them (heartbeat_ack, farewell,
    shutdown) and as /metrics exports them (``learner.accounts``): the volunteer sees the
    learner's accounting, not its own guess (docs/volunteers.md)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    state: Literal["standby", "active", "quarantined", "left"]
    version: int = -1  # the snapshot version the learner knows this worker holds
    install_s: float = Field(0.0, ge=0)  # publication to this worker's install report, that version
    granted: int = Field(0, ge=0)  # groups handed to this worker
    accepted: int = Field(0, ge=0)  # records admitted to the buffer
    duplicates: int = Field(0, ge=0)  # records already held (resends), acknowledged, not paid twice
    rejected: dict[str, int] = Field(default_factory=dict, max_length=64)  # records, by reason
    checks: int = Field(0, ge=0)  # deliveries checked (recomputed rewards, audits)
    check_failures: int = Field(0, ge=0)  # strikes
    throughput: float = Field(0.0, ge=0)  # admitted trajectories/s, measured by the learner
    down_mbit: float = Field(0.0, ge=0)  # link rates the learner measured (0 = not yet)
    up_mbit: float = Field(0.0, ge=0)
    nat: str = Field("unknown", max_length=16)
    price: float = Field(0.0, ge=0)  # the declared price, USD/hour
    active_s: float = Field(0.0, ge=0)  # seconds the learner counted this worker active
    earned_usd: float = Field(0.0, ge=0)  # price * active_s / 3600
    message: str = Field("", max_length=512)  # the learner's last word to this worker
    message_age_s: float = Field(0.0, ge=0)


class Heartbeat(Message):
    TYPE = "heartbeat"
    worker_id: str
    version: int  # installed snapshot version, -1 if none
    throughput: float = Field(0.0, ge=0)  # trajectories/s per busy second, recent (EWMA)
    busy_s: float = Field(0.0, ge=0)  # total seconds in wait-for-grant, generate, score cycles
    busy_samples: int = Field(0, ge=0)  # trajectories produced in those cycles
    # yielded: the machine's owner needs it (docs/preemption.md); the learner treats the
    # worker as standby, not as gone
    state: Literal["idle", "generating", "installing", "leaving", "yielded"] = "idle"
    base: bool = False  # this worker's relay serves the run's base model (form "base")


class HeartbeatAck(Message):
    TYPE = "heartbeat_ack"
    instance_id: str
    version: int
    manifest: dict[str, Any] | None = None  # included when the worker is behind
    source: str = ""  # where to pull that snapshot's chunks from
    source_key: bytes = b""
    ticket: bytes = b""
    known: bool = True  # False: the learner does not know this worker (restart): re-join
    account: Account | None = None  # the learner's books on this worker (None: unknown worker)
    # Seconds until this worker's next heartbeat (docs/scale.md: longer in a large fleet);
    # 0: its configured worker.heartbeat_s.
    heartbeat_s: float = Field(0.0, ge=0)


class Prefix(BaseModel):
    """A sample cut short by preemption (docs/preemption.md): the tokens generated so far,
    their behaviour log-probs, and the snapshot version of each as runs ``[version, count]``,
    oldest first. Sent by the preempted worker (``handback``); handed by the learner to the
    worker that continues the sample (``Group.prefixes``), which must deliver a record whose
    completion starts with exactly these tokens and log-probs."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    sample_idx: int = Field(ge=0, le=4096)
    ids: list[int] = Field(min_length=1, max_length=65536)
    logprobs: list[float] = Field(min_length=1, max_length=65536)
    # [version, count] pairs (lists: msgpack has no tuples)
    versions: list[Annotated[list[int], Field(min_length=2, max_length=2)]] = Field(
        min_length=1, max_length=64)
    # Multi-turn: the prefix is the policy's decisions so far, in order, and these are their
    # lengths; the continuing worker replays them in the episode's environment (empty: one
    # stretch of tokens of a single-turn sample).
    turns: list[int] = Field(default_factory=list, max_length=4096)


class Group(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    group_id: str
    prompt_ids: list[int]
    n: int = Field(ge=1)
    seed: int
    task: dict[str, Any] = Field(default_factory=dict)  # what the reward needs (e.g. answer)
    # A continuation (docs/preemption.md): these samples go on from their prefix, the others
    # are generated from the prompt; every sample of the group is delivered, as always.
    prefixes: list[Prefix] = Field(default_factory=list, max_length=4096)


class WorkRequest(Message):
    TYPE = "work_request"
    worker_id: str
    max_groups: int = Field(ge=1, le=1024)
    # Groups this worker generated whose batch is not acknowledged yet. A worker asks for work
    # only when it generates nothing, so every other open lease of its own is a grant that was
    # lost on the way: the learner hands those out again at once instead of waiting for the
    # lease to expire. (Absent, from an older worker: every open lease is re-granted and the
    # duplicates are deduplicated at admission.)
    holding: list[str] = Field(default_factory=list, max_length=4096)


class WorkGrant(Message):
    TYPE = "work_grant"
    groups: list[Group]
    retry_after_s: float = 0.0  # set when no work could be handed out


class Trajectories(Message):
    TYPE = "trajectories"
    worker_id: str
    batch_id: str
    count: int = Field(ge=0)
    payload: bytes


# What a volunteer is told, in words, about records refused for reasons that are no fault of
# theirs (the worker's log adds it to the counts an ``ack`` carries).
REFUSAL_WORDS = {
    "learner_restarted": "the learner restarted and did not keep the lease these groups were "
                         "generated under; this work is not counted, nothing to fix: new work "
                         "follows",
    "stale": "generated under a snapshot older than the staleness bound allows; the group is "
             "generated again under a newer one",
    "not_your_group": "the lease moved to another worker (it expired first); deliver sooner or "
                      "ask for fewer groups",
}


class Ack(Message):
    TYPE = "ack"
    batch_id: str
    accepted: int
    duplicates: int
    rejected: dict[str, int] = Field(default_factory=dict)
    rejected_idx: list[int] = Field(default_factory=list)  # positions in the batch not stored


class Leave(Message):
    TYPE = "leave"
    worker_id: str


class Handback(Message):
    """A worker gives its leases back before it stops generating (preempted, or yielding
    the machine to its owner): ``groups`` it will not deliver, with ``prefixes`` of the
    samples it had started, per group id. Answered by ``handback_ack``."""

    TYPE = "handback"
    worker_id: str
    reason: Literal["preempted", "yielded"]
    groups: list[str] = Field(max_length=4096)
    prefixes: dict[str, list[Prefix]] = Field(default_factory=dict, max_length=4096)


class HandbackAck(Message):
    TYPE = "handback_ack"
    groups: int = Field(ge=0)  # leases taken back
    prefixes: int = Field(ge=0)  # prefixes kept for a continuation
    refused: dict[str, int] = Field(default_factory=dict)  # prefixes not kept, by reason


class SnapshotNotice(Message):
    TYPE = "snapshot_notice"
    version: int
    manifest: dict[str, Any]
    source: str  # endpoint to pull the chunks from (the topology's choice for this worker)
    source_key: bytes = b""  # its CURVE public key
    ticket: bytes = b""  # lets this worker pull from it (broadcast.tickets)


class SourceRequest(Message):
    """A worker's snapshot source failed (disconnected, timeout, corrupt, refused): where now?"""
    TYPE = "source_request"
    worker_id: str
    version: int
    bad_source: str
    reason: str
    chunk: int = -1  # with reason "corrupt": the chunk that failed its hash (checked by the learner)
    # "full": a keyframe source for this version; "base": a source of the run's base model
    # (a LoRA run, broadcast.basemodel; version 0)
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


class Farewell(Message):
    """The reply to ``leave``: the worker's final account."""

    TYPE = "farewell"
    account: Account


class Shutdown(Message):
    TYPE = "shutdown"
    reason: str
    account: Account | None = None  # this worker's final account


class ChunkRequest(Message):
    TYPE = "chunk_request"
    version: int
    index: int = Field(ge=0)
    ticket: bytes = Field(b"", max_length=512)  # broadcast.tickets: who may pull from this server
    # "full": the rebuilt payload (a keyframe); "base": the run's base model (broadcast.basemodel)
    form: Literal["payload", "full", "base"] = "payload"


class Chunk(Message):
    TYPE = "chunk"
    version: int
    index: int


class Doctor(Message):
    TYPE = "doctor"


class DoctorAck(Message):
    """What a doctor checks next: the learner's other endpoints, as it hands them out."""

    TYPE = "doctor_ack"
    run_id: str = Field(max_length=128)
    instance_id: str = Field(max_length=64)
    snapshot_endpoint: str = Field(max_length=256)
    reflectors: list[str] = Field(default_factory=list, max_length=2)
    join: str = Field(max_length=32)  # how it admits workers: open, token, allowlist
    version: int  # the newest snapshot, -1 before the first


class Error(Message):
    TYPE = "error"
    reason: str
    detail: str
    ref: str = ""  # batch id or request the error answers, if any


MESSAGES: dict[str, type[Message]] = {
    m.TYPE: m
    for m in (Join, JoinAck, Heartbeat, HeartbeatAck, WorkRequest, WorkGrant, Trajectories, Ack,
              Leave, SnapshotNotice, Shutdown, ChunkRequest, Chunk, Error, SourceRequest,
              SourceGrant, Installed, NatReport, NatStatus, Punch, Farewell, Handback,
              HandbackAck, Doctor, DoctorAck)
}


def encode(msg: Message) -> bytes:
    return msgpack.packb(msg.model_dump(), use_bin_type=True)


def _reject_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"msgpack extension type {code} is not part of the wire schema")


def unpack(buf: bytes) -> Any:
    """msgpack -> Python objects with every limit set (``decode``, records, fuzzing).

    No string, byte string, array or map may claim more items than ``buf`` has bytes (a 5-byte
    array header cannot make the unpacker reserve 4 G slots), map keys are str or bytes (no
    unhashable key reaches a dict), extension types are refused (``max_ext_len=0`` also stops
    msgpack's built-in timestamp, which bypasses ``ext_hook``), and nesting is bounded by
    msgpack itself (``StackError`` past 1024 levels). Raises whatever msgpack raises.
    """
    n = len(buf)
    return msgpack.unpackb(buf, raw=False, strict_map_key=True, ext_hook=_reject_ext,
                           max_ext_len=0, max_str_len=n, max_bin_len=n, max_array_len=n,
                           max_map_len=n // 2)


def _short_repr() -> reprlib.Repr:
    r = reprlib.Repr()  # bounded in depth and length: a sender's junk goes into our logs
    r.maxlevel, r.maxstring, r.maxother, r.maxlist, r.maxdict = 2, 40, 40, 4, 4
    r.maxbytes = 40  # type: ignore[attr-defined]
    return r


_show = _short_repr().repr


def decode(frame: bytes, max_bytes: int) -> Message:
    """Parse and validate one frame; raise WireError naming what is wrong (and nothing else)."""
    if len(frame) > max_bytes:
        raise WireError("oversize", f"{len(frame)} bytes > limit {max_bytes} "
                        f"(raise transport.max_message_mib or send smaller batches)")
    try:
        obj = unpack(frame)
    except Exception as exc:  # msgpack raises several unrelated types on junk
        raise WireError("malformed", f"not a msgpack message ({type(exc).__name__}: "
                        f"{_show(str(exc))})") from None
    if not isinstance(obj, dict):
        raise WireError("malformed", f"message is a {type(obj).__name__}, expected a map")
    v = obj.get("v")
    if type(v) is not int or v != WIRE_VERSION:  # type(): True == 1 but is no version
        raise WireError("wrong_version", f"wire version {_show(v)}, this learner speaks "
                        f"{WIRE_VERSION}: upgrade echo-rl on the worker")
    t = obj.get("type")
    cls = MESSAGES.get(t) if isinstance(t, str) else None  # a list is unhashable
    if cls is None:
        raise WireError("unknown_type", f"unknown message type {_show(t)}")
    try:
        # strict: the wire carries exact types, so nothing is coerced (bool->int, int->bool,
        # str->bytes); a message that validates here re-encodes to the same frame.
        return cls.model_validate(obj, strict=True)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(_show(p) if not isinstance(p, str) else p[:40] for p in first["loc"])
        raise WireError("invalid_fields", f"{cls.TYPE}.{loc}: {first['msg']}") from None


def pack_records(records: list[dict[str, Any]]) -> bytes:
    return lz4.frame.compress(msgpack.packb(records, use_bin_type=True))


def _inflate(payload: bytes, max_bytes: int) -> bytes:
    """lz4 frame -> bytes, refusing to inflate past ``max_bytes`` (lz4 bombs)."""
    d = lz4.frame.LZ4FrameDecompressor()
    try:
        raw = d.decompress(payload, max_length=max_bytes)
    except Exception as exc:  # lz4 raises RuntimeError for anything that is not a frame
        raise WireError("malformed", f"trajectory payload is not an lz4 frame "
                        f"({type(exc).__name__}: {_show(str(exc))})") from None
    if d.eof:
        if d.unused_data:
            raise WireError("malformed", f"{len(d.unused_data)} bytes after the trajectory "
                            f"payload's lz4 frame")
        return raw
    if not d.needs_input:  # stopped by max_length with input left: really over the limit
        raise WireError("oversize", f"trajectory payload inflates past {max_bytes} bytes "
                        f"(raise transport.max_message_mib or send smaller batches)")
    raise WireError("malformed", f"trajectory payload is an empty or truncated lz4 frame "
                    f"({len(payload)} bytes)")


def unpack_records(payload: bytes, max_bytes: int) -> list[Any]:
    """Decompress and unpack a trajectory payload: a list, each record still to be checked by
    ``dataplane.records.parse_record``. Raises WireError and nothing else."""
    raw = _inflate(payload, max_bytes)
    try:
        obj = unpack(raw)
    except Exception as exc:  # msgpack raises several unrelated types on junk
        raise WireError("malformed", f"trajectory payload is lz4 but not msgpack "
                        f"({type(exc).__name__}: {_show(str(exc))})") from None
    if not isinstance(obj, list):
        raise WireError("malformed", f"trajectory payload is a {type(obj).__name__}, "
                        f"expected a list of records")
    return obj
