"""The control plane's sessions: a worker *is* its key. Joining binds a key to a worker id
(with the join policy of ``learner.gate``), and every later message from that key must name
the same id (docs/security.md, "Identity").

Joining is cheap for the learner (docs/security.md, "Sybils"): a joined key is *pending*: it
holds its session and books, is a tail in the broadcast plan from the next publication (never
a parent of anyone), is not registered with the provisioner and is told of new versions last.
Until the plan places it, it pulls from the learner with a ticket minted once per half ticket
lifetime. Its first act beyond joining and heartbeats (an ``installed`` report or a work
request) makes it a *member*: a relay candidate from the next publication, registered with the
provisioner. No join or heartbeat re-plans (O(fleet)): a join costs O(1) whatever the fleet.

A mixin of ``learner.control.ControlPlane`` (split out by job; it runs on the control loop and
uses the plane's ``gate``, ``sessions``, ``workers``, ``relay_keys``, ``coordinator``,
``controller`` and ``_forget``/``_source``/``_latest``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from broadcast.nat.reflect import NatError
from broadcast.tickets import Source, mint
from echo import wire
from echo.addresses import canonical_endpoint, same_endpoint
from echo.security import fingerprint
from provisioning.controller import ACTIVE, STANDBY

log = logging.getLogger("echo.control")

_JOIN_FIX = {
    "banned": "this key is banned from the run",
    "not_allowlisted": "this key is not on the learner's allow-list: send its public key to the operator",
    "token_required": "this learner needs a join token: use the join line with ?token=... from its operator",
    "bad_token": "the token is not valid for this run: ask the operator for a new one",
    "token_expired": "the token has expired: ask the operator for a new one",
    "token_used": "the token has no uses left: ask the operator for a new one",
    "learner_full": "the learner has as many workers as it accepts (security.max_workers)",
    "rate_limited": "too many joins right now: try again in a few seconds",
    "id_taken": "another worker holds this id: pick another --id (or none)",
    "endpoint_taken": "another worker serves at this relay address: check --relay-host",
}

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


class Sessions:
    cfg: Any
    accounts: Any
    gate: Any
    sessions: dict[str, str]
    workers: dict[str, WorkerState]
    relay_keys: dict[str, str]
    relay_canon: dict[str, str]  # canonical relay endpoint -> key (echo.addresses)
    coordinator: Any
    controller: Any
    reflector: Any
    endpoint: str
    snapshot_endpoint: str

    def _session(self, ident: bytes, key: str, worker_id: str) -> WorkerState | None:
        """The sender's own session, refreshed; None if this key has not joined. A message
        naming another worker's id is refused: a key speaks only for itself."""
        own = self.sessions.get(key)
        if own is None:
            return None
        if worker_id != own:
            raise wire.WireError("identity_mismatch", f"this key joined as {own!r}, not "
                                 f"{worker_id!r}: a worker speaks only for itself")
        w = self.workers[own]
        w.ident = ident  # a reconnecting DEALER gets a new routing id
        w.last_seen = time.monotonic()
        return w

    def _period(self) -> float:
        """The heartbeat period to tell a worker now (docs/scale.md): worker.heartbeat_s, or
        longer once the fleet would send more than transport.heartbeats_per_s heartbeats."""
        return self._fleet_interval(self.cfg.worker.heartbeat_s)

    def _fleet_interval(self, base: float) -> float:
        """``base`` seconds between one worker's messages, or fleet size over
        transport.heartbeats_per_s once that is longer (0: never longer)."""
        budget = self.cfg.transport.heartbeats_per_s
        return max(base, len(self.workers) / budget) if budget > 0 else base

    def _timeout(self, w: WorkerState) -> float:
        """How long ``w`` may stay silent: transport.heartbeat_timeout_s, stretched as its
        heartbeat period was (the same number of missed beats)."""
        base = self.cfg.worker.heartbeat_s
        return self.cfg.transport.heartbeat_timeout_s * max(1.0, (w.period or base) / base)

    def _joined(self, ident: bytes, key: str, worker_id: str) -> WorkerState:
        w = self._session(ident, key, worker_id)
        if w is None:
            raise wire.WireError("not_joined", "this key has not joined: send join first")
        return w

    def _on_join(self, ident: bytes, key: str, msg: wire.Join) -> wire.Message:
        own = self.sessions.get(key)
        if own is not None and own != msg.worker_id:
            if time.monotonic() - self.workers[own].last_seen < self._timeout(self.workers[own]):
                self.gate.refused["key_in_use"] += 1
                raise wire.WireError("key_in_use", f"this key is joined as {own!r} by a live "
                                     f"worker: give each worker its own --identity FILE")
            self._forget(own, f"its key re-joined as {msg.worker_id}")
        known = self._session(ident, key, msg.worker_id)
        # The claim first: a join refused for its id must not spend a token's use.
        refused = self._claim(key, msg, known)
        if refused:
            self.gate.refused[refused] += 1
        else:
            refused = self.gate.join(key, msg.token, len(self.sessions), known is not None)
        if refused:
            raise wire.WireError(refused, _JOIN_FIX.get(refused, "the learner refused this join"))
        if known is None:
            self._add_worker(ident, key, msg)
        w = self.workers[self.sessions[key]]
        w.relay_endpoint = msg.relay_endpoint if msg.can_relay else ""
        w.down_mbit, w.up_mbit = msg.down_mbit, msg.up_mbit
        self._place(w)
        version, manifest = self._latest()
        # From its place in the last plan (a peer); until a plan places it, from the learner.
        src = self._snapshot_source(w)
        view = self.cfg.worker_view()
        view["worker"]["heartbeat_s"] = w.period = self._period()  # from the first beat on
        return wire.JoinAck(run_id=self.run_id, instance_id=self.instance_id,
                            public_key=self.key.public_bytes, version=version, manifest=manifest,
                            config=view, snapshot_endpoint=src.endpoint,
                            snapshot_key=src.key, ticket=src.ticket, worker_id=self.sessions[key],
                            reflectors=self.reflector.endpoints if self.reflector else [],
                            base_manifest=self.base_manifest)

    def _on_nat_report(self, ident: bytes, key: str, msg: wire.NatReport) -> wire.Message:
        """Classify a worker's NAT from what the learner's own reflector saw (docs/nat.md)."""
        w = self._joined(ident, key, msg.worker_id)
        if self.reflector is None:
            raise wire.WireError("nat_off", "this learner runs without NAT traversal "
                                 "(broadcast.nat_traversal = false): relay endpoints are trusted")
        try:  # the endpoint it asked to relay at (a pending key is planned as a tail)
            nat, address = self.reflector.classify(msg.nonces, w.relay_endpoint)
        except NatError as err:
            raise wire.WireError("probe_not_seen", str(err)) from None
        if self.coordinator is not None:
            self.coordinator.classify(w.worker_id, nat, address)
        w.nat, w.nat_address = nat, address
        log.info("worker %s: NAT %s (punch port seen as %s)", w.worker_id, nat, address)
        return wire.NatStatus(nat=nat, address=address)

    def _claim(self, key: str, msg: wire.Join, known: WorkerState | None) -> str:
        """The worker id and relay endpoint a join asks for must not belong to another key."""
        if known is None:
            holder = self.workers.get(msg.worker_id)
            if holder is not None and holder.key != key:
                return "id_taken"
        ep = msg.relay_endpoint
        if ep and msg.can_relay:
            if any(same_endpoint(ep, own) for own in (self.endpoint, self.snapshot_endpoint)):
                return "endpoint_taken"
            # by canonical form: localhost:7000 is 127.0.0.1:7000 (one lookup, not a scan)
            owner = self.relay_canon.get(canonical_endpoint(ep))
            if owner is not None and owner != key and owner in self.sessions:
                return "endpoint_taken"
        return ""

    def _add_worker(self, ident: bytes, key: str, msg: wire.Join) -> None:
        now = time.monotonic()
        self.sessions[key] = msg.worker_id
        self.workers[msg.worker_id] = WorkerState(msg.worker_id, ident, key, msg.price, now)
        if msg.relay_endpoint and msg.can_relay:
            self.relay_keys[msg.relay_endpoint] = key
            self.relay_canon[canonical_endpoint(msg.relay_endpoint)] = key
        log.info("worker %s joined (key %s, price $%.3f/h, relay %s): pending its first "
                 "install", msg.worker_id, fingerprint(key), msg.price, msg.relay_endpoint or "none")
        active = self.controller is None  # with the provisioner, decided at promotion
        self.accounts.open(msg.worker_id, key, msg.price, active, _JOINED[active])

    def _promote(self, w: WorkerState, why: str) -> None:
        """A pending key's first useful act: it becomes a member of the broadcast plan (from
        the next publication) and of the provisioner. Idempotent."""
        if w.member:
            return
        w.member = True
        self._place(w)
        if self.controller is not None:
            # Bootstrap: the first members start active while nobody has been measured; after
            # that a member waits in standby for the controller (probation when short).
            active = len(self.controller.active_ids())
            boot = (active < self.cfg.provisioning.initial_active
                    and not self.controller.measured_any())
            state = ACTIVE if boot else STANDBY
            self.controller.add_worker(w.worker_id, w.price, state=state,
                                       mu_prior=self._mu_prior(),
                                       # plaintext (--insecure) workers prove no key: no memory
                                       identity=w.key or None)
            self.accounts.note(w.worker_id, _JOINED[state == ACTIVE])
            log.info("worker %s is a member (%s): %s", w.worker_id, why, state)
        else:
            log.info("worker %s is a member (%s)", w.worker_id, why)

    def _place(self, w: WorkerState) -> None:
        """Into the broadcast plan (O(1) here; planned at the next publication): a pending key
        as a tail, never a parent; a member with the relay endpoint it asked for. With NAT
        traversal on, a worker relays only once the reflector has classified it."""
        assert self.coordinator is not None
        self.coordinator.join(w.worker_id, w.relay_endpoint if w.member else "", w.down_mbit,
                              w.up_mbit,
                              nat="unknown" if self.reflector is not None else "reachable")
        if self.reflector is not None and w.nat != "unknown":
            self.coordinator.classify(w.worker_id, w.nat, w.nat_address)

    def _snapshot_source(self, w: WorkerState) -> Source:
        """Where ``w`` pulls the current snapshot: its place in the last plan when it has one,
        else a peer that installed it (``Coordinator.joiner_source``), else the learner itself.
        Never a re-plan: that is O(fleet) and a join or heartbeat must be O(1)."""
        assert self.coordinator is not None
        if w.member and w.worker_id in self.coordinator.sources:
            return self._source(w.worker_id)
        version, _ = self._latest()
        peer = self.coordinator.joiner_source(w.worker_id, version)
        if peer != self.snapshot_endpoint:  # a member that installed it (pull-on-join)
            return self._ticketed(w.worker_id, peer)
        if self.gate.keys is None:
            return Source(self.snapshot_endpoint)
        expires, ticket = w.entry_ticket
        now = time.time()
        ttl = self.cfg.security.ticket_ttl_s
        if expires - now < ttl / 2:  # minted once per half lifetime, not per heartbeat
            ticket = mint(self.key, w.key, self.snapshot_endpoint, self.run_id, ttl, now=now)
            w.entry_ticket = (now + ttl, ticket)
        return Source(self.snapshot_endpoint, self.gate.keys.public, ticket)

    def _mu_prior(self) -> float:
        """No throughput credit before delivery: a joiner's capacity is what the learner
        measures it deliver, never what it (or the fleet's average) claims; otherwise 10,000
        fake $0 joiners would out-bid paying workers. The controller activates unmeasured
        workers only on bounded probation (``provisioning.probation_slots``)."""
        return 0.0
