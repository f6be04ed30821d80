"""The learner's own probes of reported relays (docs/security.md, "Relay reports"): which
reports count as evidence, the fetch the learner then makes from the accused itself, and what
its outcome sets off (a ban, a strike against the reporter, or nothing).

One object, ``RelayProbes``, owned by ``learner.routes.SnapshotRoutes`` (which hands it each
report) and fed the verifier's outcomes by the server. It counts refusals into the server's
counter. Runs on the server's loop.
"""

from __future__ import annotations

import logging
import random
import time
from collections import Counter, deque
from collections.abc import Callable

from broadcast.coordinator import Coordinator
from broadcast.manifest import ChunkLayout
from broadcast.reports import KIND
from broadcast.store import SnapshotBuffer, SnapshotStore
from echo import wire
from echo.config import EchoConfig
from echo.security import fingerprint
from learner.gate import Gate
from learner.sessions import SessionTable
from learner.verify import Verifier

log = logging.getLogger("echo.control")


class RelayProbes:
    """Reports of bad relays and the learner's probes of them. The coordinator and verifier
    exist once the loop has bound its sockets (``attach``)."""

    def __init__(
        self,
        cfg: EchoConfig,
        *,
        gate: Gate,
        table: SessionTable,
        store: SnapshotStore,
        rejected: Counter[str],
        clock: Callable[[], float] = time.monotonic,
    ):
        self.cfg = cfg
        self.gate = gate
        self.table = table
        self.store = store
        self.rejected = rejected  # the server's refusal counts, by reason (shared)
        self.clock = clock
        # witness (a token's keys are one; Gate.witness) -> its reports no probe confirmed
        self.unconfirmed: Counter[str] = Counter()
        self.probed: dict[str, deque[float]] = {}  # witness -> times of its latest probes
        self.reprobing: set[str] = set()  # endpoints with a re-probe in the verifier's queue
        self.coordinator: Coordinator | None = None
        self.verifier: Verifier | None = None

    def attach(self, coordinator: Coordinator, verifier: Verifier | None) -> None:
        self.coordinator, self.verifier = coordinator, verifier

    def chunk_report(
        self, key: str, endpoint: str, layout: ChunkLayout | None, chunk: int, total: int
    ) -> None:
        """A keyframe or base-model chunk from ``endpoint`` failed its hash: the learner
        fetches it from the accused itself before anyone is banned (as for the chain's chunks,
        ``relay_report``); ``layout`` None: the reported payload is no longer held."""
        accused = self.table.relay_keys.get(endpoint)
        if accused is None or layout is None or not 0 <= chunk < total or self.verifier is None:
            self.rejected["unfounded_report"] += 1
        elif not self.verifier.submit(endpoint, accused, key, layout, chunk):
            self.rejected["verify_queue_full"] += 1

    def relay_report(self, key: str, msg: wire.SourceRequest) -> None:
        """A child says its source failed (docs/security.md, "Relay reports"): it is moved off
        that relay at once; the report counts as evidence only from a child the plan put there
        whose witness (its token: ``Gate.witness``) the learner's probes have not kept
        contradicting, and then the learner probes the relay itself at once
        (``learner.verify``), at most ``security.report_probes_per_min`` times a minute for
        one witness. A timeout convicts only through that probe (``broadcast.reports``)."""
        assert self.coordinator is not None
        witness = self.gate.witness(key)
        credit = witness or key  # open mode: each key answers for its own reports
        credible = self.unconfirmed[credit] < self.cfg.security.false_reports
        if not credible:
            self.rejected["report_not_counted"] += 1
        counts = self.coordinator.witnessed(msg.worker_id, msg.bad_source)
        self.coordinator.reattach(
            msg.worker_id, msg.bad_source, msg.reason, count=credible, group=witness
        )
        if credible and counts and msg.reason in KIND and self._may_probe(credit):
            # A timeout is probed on the newest version: by the time the probe runs the
            # reported one is often superseded, and "no longer held" is an answer, no verdict.
            corrupt = KIND[msg.reason] == "corrupt"
            self.probe(
                msg.bad_source, key, msg.version if corrupt else -1, msg.chunk if corrupt else -1
            )

    def _may_probe(self, credit: str) -> bool:
        """At most ``report_probes_per_min`` probes a minute on one witness's reports."""
        limit, now = self.cfg.security.report_probes_per_min, self.clock()
        times = self.probed.setdefault(credit, deque(maxlen=limit))
        if len(times) == limit and now - times[0] < 60.0:
            self.rejected["report_probe_limited"] += 1
            return False
        times.append(now)
        return True

    def probe(self, endpoint: str, accuser: str, version: int, chunk: int = -1) -> bool:
        """Queue the learner's own fetch from ``endpoint`` (``version``; -1: the newest the relay
        installed that the learner holds, ``_held_by``, else the newest held);
        False when there is nothing to probe with or the queue is full (counted)."""
        accused = self.table.relay_keys.get(endpoint)
        buf = self.store.get(version) if version >= 0 else self._held_by(endpoint)
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

    def _held_by(self, endpoint: str) -> SnapshotBuffer | None:
        """The newest version the relay at ``endpoint`` said it installed that the learner
        still holds: what it must be able to serve. The learner's newest is often one it has
        not received yet when versions come many a second, and its "not yet" is an answer, no
        verdict (the quiet drill's black hole escaped so: issue 52)."""
        peer = self.coordinator.owner(endpoint) if self.coordinator else None
        held = [v for v in (peer.installed if peer else ()) if self.store.get(v) is not None]
        return self.store.get(max(held)) if held else None

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
            # the accuser's token loses the credit, every key of it (Gate.witness)
            self.unconfirmed[self.gate.witness(accuser) or accuser] += 1
            self.rejected["unconfirmed_report"] += 1
        log.info(
            "probe of %s (%s) after a report from %s: %s",
            endpoint,
            fingerprint(accused),
            fingerprint(accuser) if accuser else "-",
            outcome,
        )
