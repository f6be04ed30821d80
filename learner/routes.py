"""The learner server's snapshot routes: who pulls the current snapshot from where, with what
ticket, and what happens when a worker reports a bad source or a corrupt chunk.

One object, ``SnapshotRoutes``, owned by ``learner.server.LearnerServer``: it reads the session
table and the snapshot stores it is given and counts refusals into the server's counter.
"""

from __future__ import annotations

import logging
import random
import time
from collections import Counter, deque
from collections.abc import Callable

from broadcast.coordinator import Coordinator
from broadcast.manifest import BaseManifest, Manifest
from broadcast.nat.links import plain
from broadcast.reports import KIND
from broadcast.snapshot import RunKey
from broadcast.store import SnapshotStore
from broadcast.tickets import Source, mint
from echo import wire
from echo.config import EchoConfig
from echo.security import fingerprint
from learner.gate import Gate
from learner.sessions import SessionTable, WorkerState
from learner.verify import Verifier

log = logging.getLogger("echo.control")


class SnapshotRoutes:
    """Where each worker pulls the current snapshot (its place in the plan, a peer, or the
    learner), with what ticket, and what a report of a bad source or chunk sets off: the
    learner's own probe, then a ban or a strike against the reporter. Runs on the server's
    loop; the coordinator, verifier and snapshot endpoint exist once the loop has bound its
    sockets (``attach``)."""

    def __init__(
        self,
        cfg: EchoConfig,
        *,
        gate: Gate,
        table: SessionTable,
        key: RunKey,
        run_id: str,
        store: SnapshotStore,
        results: SnapshotStore,
        rejected: Counter[str],
        push: Callable[[str, wire.Message], None],
    ):
        self.cfg = cfg
        self.gate = gate
        self.table = table
        self.key = key
        self.run_id = run_id
        self.store = store
        self.results = results
        self.rejected = rejected  # the server's refusal counts, by reason (shared)
        self.push = push  # a message to a worker now (a punch before its source)
        self.base_manifest: BaseManifest | None = None  # a LoRA run's base model
        # (version, decode seconds, took a keyframe) per accepted install report; bounded.
        self.installs: deque[tuple[int, float, bool]] = deque(maxlen=1024)
        self.keyframe_installs = 0  # installs that needed a keyframe (the run's total)
        self.unconfirmed: Counter[str] = Counter()  # reporter key -> reports not confirmed
        self.reprobing: set[str] = set()  # endpoints with a re-probe in the verifier's queue
        self.coordinator: Coordinator | None = None
        self.verifier: Verifier | None = None
        self.snapshot_endpoint = ""

    def attach(
        self, coordinator: Coordinator, verifier: Verifier | None, snapshot_endpoint: str
    ) -> None:
        """What exists once the loop runs: the plan, the prober and the learner's chunk socket."""
        self.coordinator = coordinator
        self.verifier = verifier
        self.snapshot_endpoint = snapshot_endpoint

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
            self._report_keyframe(key, msg)
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
            accused = self.table.relay_keys.get(msg.bad_source)
            if (
                accused is None
                or not 0 <= msg.chunk < self.base_manifest.layout.num_chunks
                or self.verifier is None
            ):
                self.rejected["unfounded_report"] += 1
            elif not self.verifier.submit(
                msg.bad_source, accused, key, self.base_manifest.layout, msg.chunk
            ):
                self.rejected["verify_queue_full"] += 1
        endpoint = self.coordinator.base_source(msg.worker_id, msg.bad_source)
        log.info("worker %s: base model from %s (%s)", msg.worker_id, endpoint, msg.reason)
        src = self.ticketed(msg.worker_id, endpoint)
        return wire.SourceGrant(
            version=msg.version, source=src.endpoint, source_key=src.key, ticket=src.ticket
        )

    def _report_keyframe(self, key: str, msg: wire.SourceRequest) -> None:
        """A keyframe chunk that failed its hash: the learner fetches it from the accused
        itself before anyone is banned (as for the chain's chunks, ``_corrupt_report``)."""
        accused = self.table.relay_keys.get(msg.bad_source)
        buf = self.results.get(msg.version)
        if (
            accused is None
            or buf is None
            or not 0 <= msg.chunk < buf.total
            or self.verifier is None
        ):
            self.rejected["unfounded_report"] += 1
        elif not self.verifier.submit(msg.bad_source, accused, key, buf.layout, msg.chunk):
            self.rejected["verify_queue_full"] += 1

    def on_source_request(self, ident: bytes, key: str, msg: wire.SourceRequest) -> wire.Message:
        assert self.coordinator is not None
        self.table.joined(ident, key, msg.worker_id)
        # a punched source is named by its relay endpoint (docs/nat.md)
        msg = msg.model_copy(update={"bad_source": plain(msg.bad_source)})
        if msg.form == "full":
            return self._keyframe_grant(key, msg)
        if msg.form == "base":
            return self._base_grant(key, msg)
        # The report is evidence even when its version was superseded meanwhile (a black hole
        # that held a child past the next publication must not escape the count).
        self._relay_report(key, msg)
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

    def _relay_report(self, key: str, msg: wire.SourceRequest) -> None:
        """A child says its source failed (docs/security.md, "Relay reports"): it is moved off
        that relay at once; the report counts as evidence only from an assigned child whose
        earlier reports the learner's probes have not kept failing to confirm, and then the
        learner probes the relay itself (``learner.verify``)."""
        assert self.coordinator is not None
        credible = self.unconfirmed[key] < self.cfg.security.false_reports
        if not credible:
            self.rejected["report_not_counted"] += 1
        assigned = self.coordinator.assigned(msg.worker_id, msg.bad_source)
        self.coordinator.reattach(msg.worker_id, msg.bad_source, msg.reason, count=credible)
        if credible and assigned and msg.reason in KIND:
            # A timeout is probed on the newest version: by the time the probe runs the
            # reported one is often superseded, and "no longer held" is an answer, no verdict.
            corrupt = KIND[msg.reason] == "corrupt"
            self.probe(
                msg.bad_source, key, msg.version if corrupt else -1, msg.chunk if corrupt else -1
            )

    def probe(self, endpoint: str, accuser: str, version: int, chunk: int = -1) -> bool:
        """Queue the learner's own fetch from ``endpoint`` (``version``, or the newest held);
        False when there is nothing to probe with or the queue is full (counted)."""
        accused = self.table.relay_keys.get(endpoint)
        buf = self.store.get(version) if version >= 0 else None
        buf = self.store.latest() if buf is None else buf
        if (
            accused is None
            or buf is None
            or buf.total == 0
            or self.verifier is None
            or self.gate.keys is None
            or not self._reachable(endpoint)
        ):
            return False
        if not 0 <= chunk < buf.total:
            chunk = random.randrange(buf.total)
        if not self.verifier.submit(endpoint, accused, accuser, buf.layout, chunk):
            self.rejected["verify_queue_full"] += 1
            return False
        return True

    def reprobe(self) -> None:
        """Relays whose conviction has run out are probed again before they are planned
        (from housekeeping; one probe in the queue per relay)."""
        assert self.coordinator is not None
        for endpoint in self.coordinator.reports.due(time.monotonic()):
            if not self._reachable(endpoint):
                self.coordinator.lift(endpoint)  # the learner cannot look: another chance
            elif endpoint not in self.reprobing and endpoint in self.table.relay_keys:
                if self.probe(endpoint, "", -1):
                    self.reprobing.add(endpoint)

    def _reachable(self, endpoint: str) -> bool:
        """Can the learner connect to this relay itself? Not to one behind a NAT that only
        punched links reach (docs/nat.md): no probe there, so no verdict from one."""
        peer = self.coordinator.owner(endpoint) if self.coordinator else None
        return peer is None or peer.nat != "punchable"

    def verdict(self, endpoint: str, accused: str, accuser: str, outcome: str) -> None:
        """The learner's own fetch from a reported (or re-probed) relay: ``corrupt`` (the
        learner saw it: banned), ``unreachable`` (out of the plan for a while), ``intact`` or
        ``answered`` (no verdict on anyone: the reporter's report stays unconfirmed)."""
        assert self.coordinator is not None
        self.reprobing.discard(endpoint)
        self.coordinator.reports.counts[f"probe:{outcome}"] += 1
        self.coordinator.confirm(endpoint, outcome)
        if outcome == "corrupt":
            self.gate.ban(accused, f"served a corrupt chunk at {endpoint}")
            self.rejected["relay_corrupt"] += 1
        elif outcome in ("intact", "answered") and accuser:
            self.unconfirmed[accuser] += 1
            self.rejected["unconfirmed_report"] += 1
        log.info(
            "probe of %s (%s) after a report from %s: %s",
            endpoint,
            fingerprint(accused),
            fingerprint(accuser) if accuser else "-",
            outcome,
        )

    def on_installed(self, ident: bytes, key: str, msg: wire.Installed) -> None:
        assert self.coordinator is not None
        self.table.joined(ident, key, msg.worker_id)
        peer = self.coordinator.peers.get(msg.worker_id)
        first = peer is not None and msg.version not in peer.installed  # a repeat counts once
        if self.coordinator.installed(msg.worker_id, msg.version) is not None and first:
            self.installs.append((msg.version, msg.decode_s, msg.keyframe))
            self.keyframe_installs += msg.keyframe
        # Its measured link rates: combined with the other end of each link (broadcast.link_meter),
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
