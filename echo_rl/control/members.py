"""The fleet's members: what a join, a first useful act, a heartbeat or a departure does beyond
the session table (docs/security.md, "Identity" and "Sybils").

A joined key is *pending*: it holds its session and books, is a tail in the broadcast plan from
the next publication (never a parent of anyone), is not registered with the provisioner and is
told of new versions last. Its first act beyond joining and heartbeats (an ``installed`` report
or a work request) makes it a *member*: a relay candidate from the next publication, registered
with the provisioner. No join or heartbeat re-plans (O(fleet)): a join costs O(1) whatever the
fleet. The provisioner's ticks are here too: they are about who is in the fleet and in what
state (its books across a restart are ``echo_rl.control.fleet.FleetRecord``). Runs on the server's loop.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from echo_rl.broadcast.coordinator import Coordinator
from echo_rl.broadcast.nat.reflect import NatError, Reflector
from echo_rl.control.accounts import Accounts
from echo_rl.control.gate import Gate
from echo_rl.control.reputation import Reputation
from echo_rl.control.routes import RunIdentity, SnapshotRoutes
from echo_rl.control.sessions import SessionTable, WorkerState
from echo_rl.control.work import WorkQueue
from echo_rl.core import wire
from echo_rl.core.addresses import declared_endpoint
from echo_rl.core.config import EchoConfig
from echo_rl.core.security import fingerprint
from echo_rl.provisioning.controller import ACTIVE, STANDBY, Controller, Decision
from echo_rl.provisioning.words import in_words

log = logging.getLogger("echo.control")
# Why a member left, when its capacity is gone for certain (provisioning replaces it at once):
# its own goodbye (wire.Leave), a ban, a quarantine; a silent timeout waits the window.
GONE_FOR_GOOD = ("left", "banned", "quarantined")

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

# A join's relay endpoint in its one spelling, or why it has none (echo_rl.core.addresses).


def _declared(msg: wire.Join) -> wire.Join:
    if not (msg.relay_endpoint and msg.can_relay):
        return msg
    try:
        canonical = declared_endpoint(msg.relay_endpoint)
    except ValueError as err:
        raise wire.WireError("bad_endpoint", str(err)) from None
    return msg.model_copy(update={"relay_endpoint": canonical})


_JOINED = {
    True: "joined: active, generating rollouts",
    False: "joined: standby (keeps the snapshot current and relays; the provisioner activates "
    "workers when the learner needs more rollouts)",
}


@dataclass(frozen=True)
class Books:
    """What the learner keeps of each worker: the account it is told about itself
    (``echo_rl.control.accounts``) and the checks made of it (``echo_rl.control.reputation``),
    which that account shows."""

    accounts: Accounts
    reputation: Reputation


class Members:
    """Joins, promotions, heartbeats, departures and the provisioner's view of the fleet."""

    def __init__(
        self,
        cfg: EchoConfig,
        *,
        identity: RunIdentity,
        table: SessionTable,
        gate: Gate,
        books: Books,
        work: WorkQueue,
        routes: SnapshotRoutes,
        controller: Controller | None,
    ):
        self.cfg = cfg
        self.identity = identity
        self.table = table
        self.gate = gate
        self.accounts = books.accounts
        self.reputation = books.reputation
        self.work = work
        self.routes = routes
        # Without the controller every worker is active; with it, workers join as standby
        # (they keep their snapshot current and relay) until it activates them.
        self.controller = controller
        self.decisions: list[Decision] = []  # appended by the loop, drained by the trainer
        self.coordinator: Coordinator | None = None
        self.reflector: Reflector | None = None  # docs/nat.md; None with nat_traversal off
        self.endpoints: tuple[str, ...] = ()  # the learner's own (no worker may claim them)

    def attach(
        self, coordinator: Coordinator, reflector: Reflector | None, endpoints: tuple[str, ...]
    ) -> None:
        """What exists once the loop has bound its sockets."""
        self.coordinator, self.reflector, self.endpoints = coordinator, reflector, endpoints

    # ------------------------------------------------------------------ joining

    def zap_control(self, address: str, key: str) -> str:
        """The control socket's door: the gate's checks, and for a key without a session (a
        newcomer) the admission budget of its IP prefix (``security.newcomers_per_s_per_prefix``):
        a thousand fresh keys from one host wait their turn at the handshake, before any
        message of theirs is decoded. A key with a session reconnects freely."""
        reason = self.gate.handshake(address, key)
        if not reason and key not in self.table.sessions:
            reason = self.gate.newcomer(address)
        return reason

    def on_join(self, ident: bytes, key: str, msg: wire.Join) -> wire.Message:
        t = self.table
        try:  # stored and compared in one spelling from here on
            msg = _declared(msg)
        except wire.WireError:
            self.gate.refused["bad_endpoint"] += 1
            raise
        own = t.sessions.get(key)
        if own is not None and own != msg.worker_id:
            if t.live(t.workers[own], time.monotonic()):
                self.gate.refused["key_in_use"] += 1
                raise wire.WireError(
                    "key_in_use",
                    f"this key is joined as {own!r} by a live "
                    f"worker: give each worker its own --identity FILE",
                )
            self.forget(own, f"its key re-joined as {msg.worker_id}")
        known = t.session(ident, key, msg.worker_id)
        # The claim first: a join refused for its id must not spend a token's use.
        refused = t.claim(key, msg, known, self.endpoints)
        if refused:
            self.gate.refused[refused] += 1
        else:
            refused = self.gate.join(key, msg.token, len(t.sessions), known is not None)
        if refused:
            raise wire.WireError(refused, _JOIN_FIX.get(refused, "the learner refused this join"))
        w = known if known is not None else self._add(ident, key, msg)
        w.relay_endpoint = msg.relay_endpoint if msg.can_relay else ""
        w.down_mbit, w.up_mbit = msg.down_mbit, msg.up_mbit
        self.place(w)
        return self._join_ack(w)

    def _join_ack(self, w: WorkerState) -> wire.JoinAck:
        view = self.cfg.worker_view()
        view["worker"]["heartbeat_s"] = w.period = self.table.period()  # from the first beat on
        me, reflectors = self.identity, self.reflector.endpoints if self.reflector else []
        return self.routes.join_ack(
            w, me.run_id, me.instance_id, me.key.public_bytes, view, reflectors
        )

    def _add(self, ident: bytes, key: str, msg: wire.Join) -> WorkerState:
        w = self.table.add(ident, key, msg)
        log.info(
            "worker %s joined (key %s, price $%.3f/h, relay %s): pending its first install",
            msg.worker_id,
            fingerprint(key),
            msg.price,
            msg.relay_endpoint or "none",
        )
        active = self.controller is None  # with the provisioner, decided at promotion
        self.accounts.open(msg.worker_id, key, msg.price, active, _JOINED[active])
        return w

    def on_nat_report(self, ident: bytes, key: str, msg: wire.NatReport) -> wire.Message:
        """Classify a worker's NAT from what the learner's own reflector saw (docs/nat.md)."""
        w = self.table.joined(ident, key, msg.worker_id)
        if self.reflector is None:
            raise wire.WireError(
                "nat_off",
                "this learner runs without NAT traversal "
                "(broadcast.nat_traversal = false): relay endpoints are trusted",
            )
        try:  # the endpoint it asked to relay at (a pending key is planned as a tail)
            nat, address = self.reflector.classify(msg.nonces, w.relay_endpoint)
        except NatError as err:
            raise wire.WireError("probe_not_seen", str(err)) from None
        if self.coordinator is not None:
            self.coordinator.classify(w.worker_id, nat, address)
        w.nat, w.nat_address = nat, address
        log.info("worker %s: NAT %s (punch port seen as %s)", w.worker_id, nat, address)
        return wire.NatStatus(nat=nat, address=address)

    def promote(self, w: WorkerState, why: str) -> None:
        """A pending key's first useful act: it becomes a member of the broadcast plan (from
        the next publication) and of the provisioner. Idempotent."""
        if w.member:
            return
        w.member = True
        self.place(w)
        if self.controller is None:
            log.info("worker %s is a member (%s)", w.worker_id, why)
            return
        # Bootstrap: the first members start active while nobody has been measured; after
        # that a member waits in standby for the controller (probation when short).
        boot = (
            len(self.controller.active_ids()) < self.cfg.provisioning.initial_active
            and not self.controller.measured_any()
        )
        state = ACTIVE if boot else STANDBY
        # No throughput credit before delivery (mu_prior 0): a joiner's capacity is what the
        # learner measures it deliver, never what it claims; otherwise 10,000 fake $0 joiners
        # would out-bid paying workers (probation activates unmeasured ones, bounded).
        # Plaintext (--insecure) workers prove no key: no memory by identity.
        self.controller.add_worker(
            w.worker_id, w.price, state=state, mu_prior=0.0, identity=w.key or None
        )
        self.accounts.note(w.worker_id, _JOINED[state == ACTIVE])
        log.info("worker %s is a member (%s): %s", w.worker_id, why, state)

    def place(self, w: WorkerState) -> None:
        """Into the broadcast plan (O(1) here; planned at the next publication): a pending key
        as a tail, never a parent; a member with the relay endpoint it asked for. With NAT
        traversal on, a worker relays only once the reflector has classified it."""
        assert self.coordinator is not None
        self.coordinator.join(
            w.worker_id,
            w.relay_endpoint if w.member else "",
            w.down_mbit,
            w.up_mbit,
            nat="unknown" if self.reflector is not None else "reachable",
        )
        if self.reflector is not None and w.nat != "unknown":
            self.coordinator.classify(w.worker_id, w.nat, w.nat_address)

    # ------------------------------------------------------------------ staying and leaving

    def on_heartbeat(self, ident: bytes, key: str, msg: wire.Heartbeat) -> wire.Message:
        w = self.table.session(ident, key, msg.worker_id)
        version, manifest = self.routes.latest()
        instance_id = self.identity.instance_id
        if w is None:
            return wire.HeartbeatAck(instance_id=instance_id, version=version, known=False)
        w.version, w.state, w.claimed_throughput = msg.version, msg.state, msg.throughput
        w.busy_s, w.busy_samples = msg.busy_s, msg.busy_samples
        w.runs, w.resident = msg.runs, msg.resident
        if self.coordinator is not None:
            self.coordinator.holds_base(
                msg.worker_id, msg.base and self.routes.base_manifest is not None
            )
        if self.controller is not None and w.member:
            self.controller.heartbeat(msg.worker_id, up=True)
            if self.controller.set_yielded(msg.worker_id, msg.state == "yielded"):
                log.info("worker %s yielded to its owner: standby", msg.worker_id)
        account = self.account(w)
        w.period = self.table.period()
        need = self.controller.need() if self.controller is not None else 1.0
        if msg.version >= version:
            return wire.HeartbeatAck(
                instance_id=instance_id,
                version=version,
                account=account,
                heartbeat_s=w.period,
                need=need,
            )
        src = self.routes.snapshot_source(w)
        return wire.HeartbeatAck(
            instance_id=instance_id,
            version=version,
            manifest=manifest.to_wire() if manifest is not None else None,
            source=src.endpoint,
            source_key=src.key,
            ticket=src.ticket,
            account=account,
            heartbeat_s=w.period,
            need=need,
        )

    def on_leave(self, ident: bytes, key: str, msg: wire.Leave) -> wire.Message:
        self.table.joined(ident, key, msg.worker_id)
        self.forget(msg.worker_id, "left")
        account = self.accounts.account(msg.worker_id)
        assert account is not None  # forget closed the book; closed books are kept
        return wire.Farewell(account=account)

    def account(self, w: WorkerState, message: str = "") -> wire.Account:
        """This worker's books, brought up to date (echo_rl.control.accounts)."""
        self.refresh_book(w)
        if message:
            self.accounts.note(w.worker_id, message)
        account = self.accounts.account(w.worker_id)
        assert account is not None  # every joined worker has a book
        return account

    def refresh_book(self, w: WorkerState) -> None:
        rep, co = self.reputation, self.coordinator
        peer = co.peers.get(w.worker_id) if co else None  # O(1): this runs at every heartbeat
        install = peer.installed.get(w.version, 0.0) if peer is not None else 0.0
        self.accounts.refresh(
            w.worker_id,
            version=w.version,
            install_s=install,
            nat=w.nat,
            throughput=w.measured_throughput,
            checks=rep.audits[w.worker_id],
            check_failures=rep.failures[w.worker_id],
            down_mbit=co.links.down.get(w.worker_id, 0.0) if co else 0.0,
            up_mbit=co.links.up.get(w.worker_id, 0.0) if co else 0.0,
        )

    def forget(self, worker_id: str, why: str) -> None:
        w = self.table.remove(worker_id)
        if w is None:
            return
        self.refresh_book(w)
        self.accounts.close(worker_id, "left", f"removed: {why}")
        n = self.work.release_worker(worker_id, w.key)
        if self.coordinator is not None:
            self.coordinator.leave(worker_id)
        if self.controller is not None and w.member:
            # said goodbye, banned or quarantined: its capacity is gone for certain
            self.controller.remove_worker(worker_id, why in GONE_FOR_GOOD)
        log.info("worker %s removed (%s); %d group(s) handed out again", worker_id, why, n)

    def end_session(self, key: str, why: str) -> None:
        """The session bound to ``key``, if any, ends (a banned key's, at its next message:
        CURVE keeps the connection)."""
        worker_id = self.table.sessions.get(key)
        if worker_id is not None:
            self.forget(worker_id, why)

    def reap(self, now: float) -> None:
        """Sessions silent past their timeout end (from housekeeping)."""
        t = self.table
        for w in [w for w in t.workers.values() if now - w.last_seen > t.timeout(w)]:
            self.forget(w.worker_id, f"no heartbeat for {now - w.last_seen:.1f}s")

    # ------------------------------------------------------------------ the provisioner

    def is_active(self, worker_id: str) -> bool:
        return self.controller is None or worker_id in self.controller.active_ids()

    def active_count(self) -> int:
        return (
            len(self.controller.active_ids())
            if self.controller is not None
            else len(self.table.workers)
        )

    def provision(self) -> None:
        if self.controller is None:
            return
        for d in self.controller.tick():
            log.info("provisioner: %s %s: %s", d.action, d.worker_id or "-", d.reason)
            self.decisions.append(d)
            if d.worker_id:
                self.accounts.note(d.worker_id, in_words(d))  # a sentence, then the numbers
