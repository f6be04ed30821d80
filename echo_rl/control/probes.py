"""The learner's own probes of reported relays (docs/security.md, "Relay reports"): which
reports count as evidence, the fetch the learner then makes from the accused itself, and what
its outcome sets off (a ban, a strike against the reporter, or nothing).

One object, ``RelayProbes``, owned by ``echo_rl.control.routes.SnapshotRoutes`` (which hands it each
report) and fed the verifier's outcomes by the server. It counts refusals into the server's
counter. Runs on the server's loop.
"""

from __future__ import annotations

import logging
import random
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable

from echo_rl.broadcast.coordinator import Coordinator
from echo_rl.broadcast.manifest import ChunkLayout
from echo_rl.broadcast.reports import KIND
from echo_rl.broadcast.store import SnapshotStore
from echo_rl.control.gate import Gate
from echo_rl.control.sessions import SessionTable
from echo_rl.control.verify import Verifier
from echo_rl.core import wire
from echo_rl.core.config import EchoConfig
from echo_rl.core.security import fingerprint

log = logging.getLogger("echo.control")

ASKED = 4  # versions a timeout's probe asks for, one chunk each (echo_rl/control/verify.py)
LAYOUTS = 64  # versions whose layouts are kept for probes after their payloads went
RETRIES, RETRY_S = 3, 1.0  # a timeout probe every version refused: tried again, this often


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
        self.layouts: OrderedDict[int, ChunkLayout] = OrderedDict()  # version -> its layout
        # timeout probes that may be tried again: endpoint -> (when: 0 while one is under way,
        # the accuser, tries left); one per relay, so bounded by the relays
        self.again: dict[str, tuple[float, str, int]] = {}
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
        (``echo_rl.control.verify``), at most ``security.report_probes_per_min`` times a minute for
        one witness. A timeout convicts only through that probe (``echo_rl.broadcast.reports``)."""
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
            # A timeout is probed on the versions the relay likely holds now (_candidates):
            # by the time the probe runs the reported one is often superseded.
            corrupt = KIND[msg.reason] == "corrupt"
            if (
                self.probe(
                    msg.bad_source,
                    key,
                    msg.version if corrupt else -1,
                    msg.chunk if corrupt else -1,
                )
                and not corrupt
            ):
                self.again[msg.bad_source] = (0.0, key, RETRIES)

    def _may_probe(self, credit: str) -> bool:
        """At most ``report_probes_per_min`` probes a minute on one witness's reports."""
        limit, now = self.cfg.security.report_probes_per_min, self.clock()
        times = self.probed.setdefault(credit, deque(maxlen=limit))
        if len(times) == limit and now - times[0] < 60.0:
            self.rejected["report_probe_limited"] += 1
            return False
        times.append(now)
        return True

    def published(self, layout: ChunkLayout) -> None:
        """A version's layout (its chunk hashes), kept after the payload is dropped: a relay
        that is catching up holds versions the learner no longer does, and a probe can still
        ask for one and check what comes back."""
        self.layouts[layout.version] = layout
        while len(self.layouts) > LAYOUTS:
            self.layouts.popitem(last=False)

    def probe(self, endpoint: str, accuser: str, version: int, chunk: int = -1) -> bool:
        """Queue the learner's own fetch from ``endpoint``: of ``version`` (a corrupt report's),
        or for a timeout (-1) of the versions the relay is likeliest to hold (``_candidates``);
        False when there is nothing to probe with or the queue is full (counted)."""
        accused = self.table.relay_keys.get(endpoint)
        buf = self.store.get(version) if version >= 0 else None
        asks = [buf.layout] if buf is not None else self._candidates(endpoint)
        if (
            accused is None
            or not asks
            or not asks[0].num_chunks
            or self.verifier is None
            or self.gate.keys is None
            or not self._reachable(endpoint)
        ):
            return False
        if not 0 <= chunk < asks[0].num_chunks:
            chunk = random.randrange(asks[0].num_chunks)
        if not self.verifier.submit(endpoint, accused, accuser, asks[0], chunk, tuple(asks[1:])):
            self.rejected["verify_queue_full"] += 1
            return False
        return True

    def _candidates(self, endpoint: str) -> list[ChunkLayout]:
        """For a timeout's probe, newest first: the versions the relay said it installed (its
        store keeps the last two), then the learner's newest, at most ``ASKED``. One it no
        longer or not yet holds it refuses at once ("answered", no verdict); one it holds and
        never serves is a black hole (echo_rl/control/verify.py). Asking the learner's newest alone
        let the quiet drill's black hole escape: at twenty versions a second, and catching up
        after its join, it held none of them (issue 52)."""
        peer = self.coordinator.owner(endpoint) if self.coordinator else None
        installed = sorted(peer.installed if peer else (), reverse=True)
        mine = [b.version for b in reversed(self.store.buffers())]
        out: dict[int, ChunkLayout] = {}
        for v in [*installed[:2], *mine]:
            layout = self.layouts.get(v) or (b.layout if (b := self.store.get(v)) else None)
            if layout is not None and layout.num_chunks and v not in out:
                out[v] = layout
        return list(out.values())[:ASKED]

    def reprobe(self) -> None:
        """Relays whose conviction has run out are probed again before they are planned, and
        timeout probes that every version refused are tried again (from housekeeping; one
        probe in the queue per relay)."""
        assert self.coordinator is not None
        now = self.clock()
        for endpoint, (due, accuser, left) in list(self.again.items()):
            if due and now >= due:  # due 0: the first probe is still under way
                self.again[endpoint] = (0.0, accuser, left)
                if not self.probe(endpoint, accuser, -1):
                    del self.again[endpoint]
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
        again = self.again.pop(endpoint, None)
        if outcome == "answered" and again is not None and again[2] > 0:
            # Every version asked was refused: a relay catching up after its join, or one whose
            # two held versions moved on. Asked again shortly, at most RETRIES times; the
            # reporter's credit waits for the last answer.
            self.again[endpoint] = (self.clock() + RETRY_S, again[1], again[2] - 1)
            self.coordinator.reports.counts["probe:answered_again"] += 1
            return
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
