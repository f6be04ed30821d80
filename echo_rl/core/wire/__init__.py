"""Echo's wire schema: every message between learner and workers, in one place.

Transport: pyzmq with CurveZMQ (``echo_rl.core.security``): the sender of every message is the public
key its connection authenticated, never a field of the message; a ``worker_id`` field must be the
id bound to that key at join, else the message is refused (``identity_mismatch``). The learner binds a ROUTER socket (control) and a second ROUTER (snapshot
chunks); each worker connects one DEALER to each. A message is one frame: a msgpack map with
``v`` (schema version, ``WIRE_VERSION``) and ``type``; a chunk reply carries the chunk bytes in
a second frame so they are never copied into msgpack.

Worker -> learner (control socket)
  join            worker_id, price, backend, can_relay  -> join_ack | error
                  join_ack.base_manifest: a LoRA run's signed base model manifest
                  (``echo_rl.broadcast.basemodel``), or None
  heartbeat       worker_id, version, throughput, state, base -> heartbeat_ack{account}
                  base: this worker's relay holds the run's base model whole (a LoRA run;
                  the learner may send others to fetch it there, form "base")
                  account: the learner's books on this worker (``Account``): what the
                  worker's status view shows (docs/volunteers.md)
  work_request    worker_id, max_groups, holding        -> work_grant
  trajectories    worker_id, batch_id, count, payload   -> ack
                  payload = lz4.frame(msgpack([record, ...])), record schema in
                  ``echo_rl.data.records``; at-least-once: the worker resends until acked.
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
                  learner believes them only combined with the other end (echo_rl.broadcast.link_meter).
  doctor          (nothing)                             -> doctor_ack{snapshot_endpoint, reflectors}
                  a health check (``echo-worker doctor``, ``echo-rl doctor``): answered to any
                  key that passed the handshake, joined or not; nothing is stored or counted
  nat_report      worker_id, nonces                     -> nat_status{nat, address}
                  nonces: the two probes this worker sent to the learner's reflector from
                  its punch port (``echo_rl.broadcast.nat.reflect``); the learner classifies from
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
                  when the chunk has arrived and verified: see ``echo_rl.broadcast.source``;
                  form "full" asks for a chunk of the rebuilt payload of an installed version)

Receipt: ``decode`` checks size, msgpack, version, type and fields, and raises ``WireError``
with a short machine reason (counted by the receiver) and a human detail (logged with the
sender's id). Unknown fields are rejected so a typo never passes silently. Any bytes at all
give a message or a ``WireError``, never another exception (docs/fuzzing.md): msgpack runs
with every length bounded by the frame's size and extension types refused, and the fields
are validated strictly (``True`` is not an int, ``1`` is not a bool, no NaN or infinity).

The messages are grouped by plane: ``echo_rl.core.wire.session`` (join, heartbeat, leave, NAT, doctor,
error), ``echo_rl.core.wire.work`` (grants, trajectories, hand-backs), ``echo_rl.core.wire.snapshot`` (notices,
sources, installs, chunks); ``echo_rl.core.wire.codec`` turns frames into them. Import them from here.
"""

from __future__ import annotations

from echo_rl.core.wire.base import WIRE_VERSION, Message, WireError
from echo_rl.core.wire.codec import MESSAGES, decode, encode, pack_records, unpack, unpack_records
from echo_rl.core.wire.session import (
    Account,
    Doctor,
    DoctorAck,
    Error,
    Farewell,
    Heartbeat,
    HeartbeatAck,
    Join,
    JoinAck,
    Leave,
    NatReport,
    NatStatus,
    Punch,
    Shutdown,
)
from echo_rl.core.wire.snapshot import (
    Chunk,
    ChunkRequest,
    Installed,
    SnapshotNotice,
    SourceGrant,
    SourceRequest,
)
from echo_rl.core.wire.work import (
    REFUSAL_WORDS,
    Ack,
    Group,
    Handback,
    HandbackAck,
    Prefix,
    Trajectories,
    WorkGrant,
    WorkRequest,
)

__all__ = [
    "Account",
    "Ack",
    "Chunk",
    "ChunkRequest",
    "Doctor",
    "DoctorAck",
    "Error",
    "Farewell",
    "Group",
    "Handback",
    "HandbackAck",
    "Heartbeat",
    "HeartbeatAck",
    "Installed",
    "Join",
    "JoinAck",
    "Leave",
    "MESSAGES",
    "Message",
    "NatReport",
    "NatStatus",
    "Prefix",
    "Punch",
    "REFUSAL_WORDS",
    "Shutdown",
    "SnapshotNotice",
    "SourceGrant",
    "SourceRequest",
    "Trajectories",
    "WIRE_VERSION",
    "WireError",
    "WorkGrant",
    "WorkRequest",
    "decode",
    "encode",
    "pack_records",
    "unpack",
    "unpack_records",
]
