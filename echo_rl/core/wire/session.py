"""The session plane: join, heartbeats, leaving, NAT traversal, health checks and errors
(learner <-> worker, control socket)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from echo_rl.core.wire.base import Message


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
    snapshot_endpoint: str  # where this worker pulls the current version (a peer or the learner)
    snapshot_key: bytes = b""  # CURVE public key of that source (b"": plaintext)
    ticket: bytes = b""  # lets this worker pull from it (echo_rl.broadcast.tickets)
    worker_id: str = ""  # the id this session is known by (bound to the worker's key)
    reflectors: list[str] = Field(default_factory=list, max_length=2)  # "ip:port": NAT probes
    # A LoRA run on a model folder: the signed manifest of its base model, which a worker
    # without it fetches (chunk requests of form "base") and caches (echo_rl.broadcast.basemodel)
    base_manifest: dict[str, Any] | None = None
    # the learner's own snapshot endpoint, the source of last resort a worker never avoids
    # (echo_rl/worker/snapshots.py); "" from a learner older than the field
    learner_snapshot_endpoint: str = ""


class Account(BaseModel):
    """The learner's books on one worker, as the worker is told them (heartbeat_ack, farewell,
    shutdown) and as /metrics exports them (``echo_rl.control.accounts``): the volunteer sees the
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
    # How many runs this worker's device serves (docs/multirun.md). Above 1 the learner counts
    # it at the rate it delivers here (wall time), not per busy second: capacity received.
    runs: int = Field(1, ge=1, le=64)
    resident: bool = True  # this run's model is on the device now (else a switch comes first)


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
    # The run's capacity requirement over the capacity it has (1: enough; 2: it wants twice
    # as much). A worker shared with other runs weighs its turns by it, clamped to [1/4, 4]
    # (echo_rl/worker/sharing.py, docs/multirun.md).
    need: float = Field(1.0, ge=0, le=1000)


class Leave(Message):
    TYPE = "leave"
    worker_id: str


class Farewell(Message):
    """The reply to ``leave``: the worker's final account."""

    TYPE = "farewell"
    account: Account


class Shutdown(Message):
    TYPE = "shutdown"
    reason: str
    account: Account | None = None  # this worker's final account


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
    # What the learner saw of its ports from outside (``echo-rl doctor`` behind a 1:1 NAT,
    # where this host cannot reach its own public address): workers in session whose NAT probe
    # came from a public address (they reached the control and reflector ports), those of them
    # that installed a snapshot (fed from the chunk port, directly or through their relays),
    # and what the workers' failed fetches say of the chunk port (echo_rl/control/snapshot_path.py).
    outside_joined: int = 0
    outside_installed: int = 0
    snapshot_path: str = Field("", max_length=1024)


class Error(Message):
    TYPE = "error"
    reason: str
    detail: str
    ref: str = ""  # batch id or request the error answers, if any
