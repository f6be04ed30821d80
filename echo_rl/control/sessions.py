"""The learner server's sessions: a worker *is* its key. Joining binds a key to a worker id
(with the join policy of ``echo_rl.control.gate``), and every later message from that key must name
the same id (docs/security.md, "Identity").

Joining is cheap for the learner (docs/security.md, "Sybils"): a joined key is *pending*: it
holds its session and books, is a tail in the broadcast plan from the next publication (never
a parent of anyone), is not registered with the provisioner and is told of new versions last.
Until the plan places it, it pulls from the learner with a ticket minted once per half ticket
lifetime. Its first act beyond joining and heartbeats (an ``installed`` report or a work
request) makes it a *member*: a relay candidate from the next publication, registered with the
provisioner. No join or heartbeat re-plans (O(fleet)): a join costs O(1) whatever the fleet.

``SessionTable`` is the registry alone (key -> id -> ``WorkerState``, relay endpoints, heartbeat
periods); what a join or a promotion does to the rest of the learner is ``echo_rl.control.members``.
It runs on the server's loop.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from echo_rl.core import wire
from echo_rl.core.addresses import canonical_endpoint, same_endpoint
from echo_rl.core.config import EchoConfig

log = logging.getLogger("echo.control")

EWMA_ALPHA = 0.3


@dataclass
class WorkerState:
    worker_id: str
    ident: bytes
    key: str  # the CURVE public key this session is bound to (its identity)
    price: float
    last_seen: float
    version: int = -1
    state: str = "idle"
    claimed_throughput: float = 0.0
    measured_throughput: float = 0.0  # EWMA of admitted samples/s, measured here
    admitted: int = 0
    last_batch_at: float = field(default_factory=time.monotonic)
    busy_s: float = 0.0  # the worker's cumulative busy seconds and output (heartbeats)
    busy_samples: int = 0
    runs: int = 1  # runs sharing the worker's device (its heartbeat; docs/multirun.md)
    resident: bool = True
    nat: str = "unknown"  # docs/nat.md: reachable, punchable, none (the reflector's verdict)
    # Lazy state (docs/security.md, "Sybils"): a pending key is no member of the plan or of the
    # provisioner until its first useful act; what its join asked for is kept until then.
    member: bool = False
    relay_endpoint: str = ""
    down_mbit: float = 0.0
    up_mbit: float = 0.0
    nat_address: str = ""  # the punch port the reflector saw (replayed at promotion)
    entry_ticket: tuple[float, bytes] = (0.0, b"")  # (expiry, ticket) for the learner's socket
    noticed: int = -1  # the last version it was sent a notice of (least recent go first)
    period: float = 0.0  # the heartbeat period it was last told (0: worker.heartbeat_s)


_JOINED = {
    True: "joined: active, generating rollouts",
    False: "joined: standby (keeps the snapshot current and relays; the provisioner activates "
    "workers when the learner needs more rollouts)",
}


class SessionTable:
    """Who holds a session: public key -> worker id -> its ``WorkerState``, and which key
    serves at each relay endpoint. Timing rules read worker.heartbeat_s,
    transport.heartbeat_timeout_s and transport.heartbeats_per_s when asked (not at start)."""

    def __init__(self, cfg: EchoConfig):
        self.cfg = cfg
        self.sessions: dict[str, str] = {}  # public key -> worker id (one session per key)
        self.workers: dict[str, WorkerState] = {}
        self.relay_keys: dict[str, str] = {}  # relay endpoint -> the key that serves there
        self.relay_canon: dict[
            str, str
        ] = {}  # the same, by canonical endpoint (echo_rl.core.addresses)

    def session(self, ident: bytes, key: str, worker_id: str) -> WorkerState | None:
        """The sender's own session, refreshed; None if this key has not joined. A message
        naming another worker's id is refused: a key speaks only for itself."""
        own = self.sessions.get(key)
        if own is None:
            return None
        if worker_id != own:
            raise wire.WireError(
                "identity_mismatch",
                f"this key joined as {own!r}, not {worker_id!r}: a worker speaks only for itself",
            )
        w = self.workers[own]
        w.ident = ident  # a reconnecting DEALER gets a new routing id
        w.last_seen = time.monotonic()
        return w

    def joined(self, ident: bytes, key: str, worker_id: str) -> WorkerState:
        w = self.session(ident, key, worker_id)
        if w is None:
            raise wire.WireError("not_joined", "this key has not joined: send join first")
        return w

    def period(self) -> float:
        """The heartbeat period to tell a worker now (docs/scale.md): worker.heartbeat_s, or
        longer once the fleet would send more than transport.heartbeats_per_s heartbeats."""
        return self.fleet_interval(self.cfg.worker.heartbeat_s)

    def fleet_interval(self, base: float) -> float:
        """``base`` seconds between one worker's messages, or fleet size over
        transport.heartbeats_per_s once that is longer (0: never longer)."""
        budget = self.cfg.transport.heartbeats_per_s
        return max(base, len(self.workers) / budget) if budget > 0 else base

    def timeout(self, w: WorkerState) -> float:
        """How long ``w`` may stay silent: transport.heartbeat_timeout_s, stretched as its
        heartbeat period was (the same number of missed beats)."""
        base = self.cfg.worker.heartbeat_s
        return self.cfg.transport.heartbeat_timeout_s * max(1.0, (w.period or base) / base)

    def live(self, w: WorkerState, now: float) -> bool:
        return now - w.last_seen < self.timeout(w)

    def claim(
        self, key: str, msg: wire.Join, known: WorkerState | None, own_endpoints: tuple[str, ...]
    ) -> str:
        """The worker id and relay endpoint a join asks for must not belong to another key
        (nor be one of the learner's own endpoints); the refusal reason, or ""."""
        if known is None:
            holder = self.workers.get(msg.worker_id)
            if holder is not None and holder.key != key:
                return "id_taken"
        ep = msg.relay_endpoint
        if ep and msg.can_relay:
            if any(same_endpoint(ep, own) for own in own_endpoints):
                return "endpoint_taken"
            # by canonical form: localhost:7000 is 127.0.0.1:7000 (one lookup, not a scan)
            owner = self.relay_canon.get(canonical_endpoint(ep))
            if owner is not None and owner != key and owner in self.sessions:
                return "endpoint_taken"
        return ""

    def add(self, ident: bytes, key: str, msg: wire.Join) -> WorkerState:
        w = WorkerState(msg.worker_id, ident, key, msg.price, time.monotonic())
        self.sessions[key] = msg.worker_id
        self.workers[msg.worker_id] = w
        if msg.relay_endpoint and msg.can_relay:
            self.relay_keys[msg.relay_endpoint] = key
            self.relay_canon[canonical_endpoint(msg.relay_endpoint)] = key
        return w

    def remove(self, worker_id: str) -> WorkerState | None:
        """The session ends (its relay endpoint stays recorded: a report may still name it)."""
        w = self.workers.pop(worker_id, None)
        if w is not None:
            self.sessions.pop(w.key, None)
        return w
