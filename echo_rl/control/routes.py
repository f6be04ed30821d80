"""The learner server's snapshot routes: who pulls the current snapshot from where, with what
ticket, and what happens when a worker reports a bad source or a corrupt chunk.

One object, ``SnapshotRoutes``, owned by ``echo_rl.control.server.LearnerServer``: it reads the session
table and the snapshot stores it is given; the reports of bad sources it hands to its
``RelayProbes`` (``echo_rl.control.probes``), which probe the accused and count refusals into the
server's counter.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass

from echo_rl.broadcast.base_manifest import BaseManifest
from echo_rl.broadcast.coordinator import Coordinator
from echo_rl.broadcast.manifest import Manifest
from echo_rl.broadcast.nat.links import plain
from echo_rl.broadcast.snapshot import RunKey
from echo_rl.broadcast.store import SnapshotStore
from echo_rl.broadcast.tickets import Source, mint
from echo_rl.control.gate import Gate
from echo_rl.control.probes import RelayProbes
from echo_rl.control.sessions import SessionTable, WorkerState
from echo_rl.control.snapshot_path import SnapshotPathWatch
from echo_rl.control.verify import Verifier
from echo_rl.core import wire
from echo_rl.core.config import EchoConfig

log = logging.getLogger("echo.control")


@dataclass(frozen=True)
class RunIdentity:
    """What every join_ack and doctor reply names: the run, this learner instance, its key;
    the run and its key sign the snapshot tickets."""

    run_id: str
    key: RunKey
    instance_id: str

    @staticmethod
    def new(run_id: str, key: RunKey) -> RunIdentity:
        return RunIdentity(run_id, key, uuid.uuid4().hex[:12])


class SnapshotRoutes:
    """Where each worker pulls the current snapshot (its place in the plan, a peer, or the
    learner), with what ticket; a report of a bad source or chunk goes to ``probes``
    (``echo_rl.control.probes``: the learner's own probe, then a ban or a strike against the
    reporter). Runs on the server's loop; the coordinator, verifier and snapshot endpoint exist
    once the loop has bound its sockets (``attach``)."""

    def __init__(
        self,
        cfg: EchoConfig,
        *,
        gate: Gate,
        table: SessionTable,
        identity: RunIdentity,
        store: SnapshotStore,
        results: SnapshotStore,
        rejected: Counter[str],
        push: Callable[[str, wire.Message], None],
    ):
        self.cfg = cfg
        self.gate = gate
        self.table = table
        self.key, self.run_id = identity.key, identity.run_id
        self.store = store
        self.results = results
        self.push = push  # a message to a worker now (a punch before its source)
        self.base_manifest: BaseManifest | None = None  # a LoRA run's base model
        # (version, decode seconds, took a keyframe) per accepted install report; bounded.
        self.installs: deque[tuple[int, float, bool]] = deque(maxlen=1024)
        self.keyframe_installs = 0  # installs that needed a keyframe (the run's total)
        # reports of bad relays and the learner's own probes of them (echo_rl.control.probes)
        self.probes = RelayProbes(cfg, gate=gate, table=table, store=store, rejected=rejected)
        self.coordinator: Coordinator | None = None
        self.snapshot_endpoint = ""
        # workers' failed fetches from the learner's own snapshot port (a closed firewall port)
        self.path = SnapshotPathWatch(time.monotonic, lambda: self.store.bytes_sent)

    def attach(
        self, coordinator: Coordinator, verifier: Verifier | None, snapshot_endpoint: str
    ) -> None:
        """What exists once the loop runs: the plan, the prober and the learner's chunk socket."""
        self.coordinator = coordinator
        self.probes.attach(coordinator, verifier)
        self.snapshot_endpoint = snapshot_endpoint
        self.path.attach(snapshot_endpoint)

    def join_ack(
        self,
        w: WorkerState,
        run_id: str,
        instance_id: str,
        public_key: bytes,
        view: dict[str, object],
        reflectors: list[str],
    ) -> wire.JoinAck:
        """What a joining worker is told: the run, its config view, the newest version and
        where to pull it (its place in the last plan, a peer; until a plan places it, the
        learner), and the learner's own snapshot endpoint (never avoided, echo_rl/worker/snapshots.py)."""
        version, manifest = self.latest()
        src, base = self.snapshot_source(w), self.base_manifest
        return wire.JoinAck(
            run_id=run_id,
            instance_id=instance_id,
            public_key=public_key,
            version=version,
            manifest=manifest.to_wire() if manifest is not None else None,
            config=view,
            snapshot_endpoint=src.endpoint,
            snapshot_key=src.key,
            ticket=src.ticket,
            worker_id=w.worker_id,
            reflectors=reflectors,
            base_manifest=base.to_wire() if base is not None else None,
            learner_snapshot_endpoint=self.snapshot_endpoint,
        )

    def latest(self) -> tuple[int, Manifest | None]:
        buf = self.store.latest()
        return (buf.version, buf.manifest) if buf else (-1, None)

    def zap_chunks(self, address: str, key: str) -> str:
        """The learner's chunk socket accepts connections from joined keys only: a stranger's
        requests then cost a refused handshake, not a decode and a reply each."""
        reason = self.gate.handshake(address, key)
        if not reason and key not in self.table.sessions:
            self.gate.refused["not_joined"] += 1
            reason = "not_joined"
        return reason

    def may_pull(self, key: str, ticket: bytes) -> str:
        """The learner's own chunk socket serves joined workers only (by key)."""
        if self.gate.keys is None or key in self.table.sessions:
            return ""
        return "not_joined"

    def source(self, worker_id: str) -> Source:
        """Where ``worker_id`` pulls the current snapshot from: endpoint, that server's key, and
        a ticket that lets this worker (and only it) in there."""
        assert self.coordinator is not None
        return self.ticketed(worker_id, self.coordinator.source_for(worker_id))

    def ticketed(self, worker_id: str, endpoint: str) -> Source:
        """``endpoint`` with its server's key and a ticket for ``worker_id`` to pull there;
        through a punched link when the server is only punchable (its punches leave first)."""
        w = self.table.workers.get(worker_id)
        assert self.coordinator is not None  # attached before the server serves (attach)
        source, punches = self.coordinator.route(worker_id, endpoint)
        for to, punch in punches:
            self.push(to, punch)
        if self.gate.keys is None or w is None:
            return Source(source)
        server = (
            self.gate.keys.text
            if endpoint == self.snapshot_endpoint
            else self.table.relay_keys.get(endpoint, "")
        )
        ticket = mint(self.key, w.key, endpoint, self.run_id, self.cfg.security.ticket_ttl_s)
        return Source(source, server.encode(), ticket)

    def _keyframe_grant(self, key: str, msg: wire.SourceRequest) -> wire.Message:
        """A worker lacks the base of a delta (or its keyframe source failed): a peer that
        installed the version serves its rebuilt payload, else the learner does."""
        assert self.coordinator is not None
        if msg.reason == "corrupt" and msg.bad_source != self.snapshot_endpoint:
            buf = self.results.get(msg.version)  # None: no longer held (an unfounded report)
            layout, total = (buf.layout, buf.total) if buf is not None else (None, 0)
            self.probes.chunk_report(key, msg.bad_source, layout, msg.chunk, total)
        endpoint = self.coordinator.keyframe_source(msg.worker_id, msg.version, msg.bad_source)
        if endpoint == self.snapshot_endpoint and self.results.get(msg.version) is None:
            return wire.Error(
                reason="unknown_version",
                detail=f"version {msg.version} is no "
                f"longer held: install the current one (heartbeat replies offer it)",
            )
        log.info(
            "worker %s: keyframe of v%d from %s (%s)",
            msg.worker_id,
            msg.version,
            endpoint,
            msg.reason,
        )
        src = self.ticketed(msg.worker_id, endpoint)
        return wire.SourceGrant(
            version=msg.version, source=src.endpoint, source_key=src.key, ticket=src.ticket
        )

    def _base_grant(self, key: str, msg: wire.SourceRequest) -> wire.Message:
        """A worker lacks the run's base model (or its base source failed): a peer that holds
        it whole serves it, else the learner does; a corrupt chunk is probed as any other."""
        assert self.coordinator is not None
        if self.base_manifest is None:
            return wire.Error(
                reason="no_base",
                detail="this run publishes no base model (not a "
                "LoRA run on a model folder): load model.name on the worker",
            )
        if msg.reason == "corrupt" and msg.bad_source != self.snapshot_endpoint:
            layout = self.base_manifest.layout
            self.probes.chunk_report(key, msg.bad_source, layout, msg.chunk, layout.num_chunks)
        endpoint = self.coordinator.base_source(msg.worker_id, msg.bad_source)
        log.info("worker %s: base model from %s (%s)", msg.worker_id, endpoint, msg.reason)
        src = self.ticketed(msg.worker_id, endpoint)
        return wire.SourceGrant(
            version=msg.version, source=src.endpoint, source_key=src.key, ticket=src.ticket
        )

    def on_source_request(self, ident: bytes, key: str, msg: wire.SourceRequest) -> wire.Message:
        assert self.coordinator is not None
        self.table.joined(ident, key, msg.worker_id)
        # a punched source is named by its relay endpoint (docs/nat.md)
        msg = msg.model_copy(update={"bad_source": plain(msg.bad_source)})
        if msg.form == "full":
            return self._keyframe_grant(key, msg)
        if msg.form == "base":
            return self._base_grant(key, msg)
        # About the learner's own port: what a closed firewall port looks like from the fleet.
        if self.path.report(key, msg.worker_id, msg.bad_source, msg.reason):
            self.path.say(len(self.table.workers))
        # The report is evidence even when its version was superseded meanwhile (a black hole
        # that held a child past the next publication must not escape the count).
        self.probes.relay_report(key, msg)
        if self.store.get(msg.version) is None:  # superseded: no source holds it any more
            return wire.Error(
                reason="unknown_version",
                detail=f"version {msg.version} is no "
                f"longer held: install the current one (heartbeat replies offer it)",
            )
        src = self.source(msg.worker_id)
        if plain(src.endpoint) == plain(msg.bad_source):  # the plan still trusts it: go to the root
            src = self._root_source(msg.worker_id)
        log.info(
            "worker %s: source %s failed (%s); now pulls from %s",
            msg.worker_id,
            msg.bad_source,
            msg.reason,
            src.endpoint,
        )
        return wire.SourceGrant(
            version=msg.version, source=src.endpoint, source_key=src.key, ticket=src.ticket
        )

    def _root_source(self, worker_id: str) -> Source:
        if self.gate.keys is None:
            return Source(self.snapshot_endpoint)
        ticket = mint(
            self.key,
            self.table.workers[worker_id].key,
            self.snapshot_endpoint,
            self.run_id,
            self.cfg.security.ticket_ttl_s,
        )
        return Source(self.snapshot_endpoint, self.gate.keys.public, ticket)

    def on_installed(self, ident: bytes, key: str, msg: wire.Installed) -> None:
        assert self.coordinator is not None
        self.table.joined(ident, key, msg.worker_id)
        peer = self.coordinator.peers.get(msg.worker_id)
        first = peer is not None and msg.version not in peer.installed  # a repeat counts once
        if self.coordinator.installed(msg.worker_id, msg.version) is not None and first:
            self.installs.append((msg.version, msg.decode_s, msg.keyframe))
            self.keyframe_installs += msg.keyframe
        # Its measured link rates: combined with the other end of each link (echo_rl.broadcast.link_meter),
        # the first report per version only; the next publication plans on them.
        self.coordinator.measured(msg.worker_id, msg.version, msg.down_mbit, msg.up_mbit)
        return None

    def last_t_bcast(self) -> float | None:
        if self.coordinator is None or not self.coordinator.published:
            return None
        for version in sorted(self.coordinator.published, reverse=True):
            t = self.coordinator.t_bcast(version)
            if t is not None:
                return round(t, 4)
        return None

    def install_stats(self) -> tuple[float | None, int]:
        """Of the newest delta workers rebuilt: the median seconds (None: none rebuilt); and
        the installs that took a keyframe."""
        rebuilt = [(v, d) for v, d, k in self.installs if d > 0 and not k]
        if not rebuilt:
            return None, self.keyframe_installs
        newest = max(v for v, _ in rebuilt)
        times = sorted(d for v, d in rebuilt if v == newest)
        return (round(times[len(times) // 2], 4) if times else None), self.keyframe_installs

    def snapshot_source(self, w: WorkerState) -> Source:
        """Where ``w`` pulls the current snapshot: its place in the last plan when it has one,
        else a peer that installed it (``Coordinator.joiner_source``), else the learner itself.
        Never a re-plan: that is O(fleet) and a join or heartbeat must be O(1)."""
        assert self.coordinator is not None
        if w.member and w.worker_id in self.coordinator.sources:
            return self.source(w.worker_id)
        version, _ = self.latest()
        peer = self.coordinator.joiner_source(w.worker_id, version)
        if peer != self.snapshot_endpoint:  # a member that installed it (pull-on-join)
            return self.ticketed(w.worker_id, peer)
        if self.gate.keys is None:
            return Source(self.snapshot_endpoint)
        expires, ticket = w.entry_ticket
        now = time.time()
        ttl = self.cfg.security.ticket_ttl_s
        if expires - now < ttl / 2:  # minted once per half lifetime, not per heartbeat
            ticket = mint(self.key, w.key, self.snapshot_endpoint, self.run_id, ttl, now=now)
            w.entry_ticket = (now + ttl, ticket)
        return Source(self.snapshot_endpoint, self.gate.keys.public, ticket)
