"""Who pulls each snapshot from whom, and how long publication took.

Runs wherever the broadcast is rooted: inside the learner's control plane, and in the
broadcast benchmark's root process (same code). It keeps the relay peers (endpoint, rates,
reachability, liveness, corruption reports), asks the topology for a plan at every
publication, re-plans when a worker reports a failed source, and turns install reports into
per-worker install times and ``T_bcast`` at quantile q. A report moves the reporter off the
accused at once; the accused leaves the plan (unreachable) or parent positions (corrupt) only
when convicted by distinct assigned children or by the learner's own probe, for a while, and
comes back after a re-probe (``echo_rl.broadcast.reports``).

Install times and ``T_bcast`` are kept by ``echo_rl.broadcast.install_log``, the sources of whole payloads
(keyframes, the base model) chosen by ``echo_rl.broadcast.whole_sources``, the punched links to punchable
parents (and the demotions when they fail) by ``echo_rl.broadcast.punch_routes``.

Link rates: the plan uses what the workers *measured* (``measured``, combined at both ends of
each link by ``echo_rl.broadcast.link_meter.LinkMeter``), and a worker's declared rates only until it is
measured, capped at the fleet's median measured rate. (Planning on the declarations alone, the
old behaviour, is the liar benchmark's baseline: ``labs.doubles.DeclaredRatesCoordinator``.)
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

from echo_rl.broadcast.install_log import InstallLog, quantile_rank
from echo_rl.broadcast.link_meter import LinkMeter
from echo_rl.broadcast.nat.links import plain
from echo_rl.broadcast.punch_routes import PunchRoutes
from echo_rl.broadcast.reports import CORRUPT, UNREACHABLE, ReportBook
from echo_rl.broadcast.topology import Peer, Topology
from echo_rl.broadcast.whole_sources import WholeSources
from echo_rl.core import wire

log = logging.getLogger(__name__)

__all__ = ["GIVEN", "Coordinator", "PeerState", "quantile_rank"]  # quantile_rank: its old home


GIVEN = 8  # sources remembered per worker (what it may report on)


@dataclass
class PeerState:
    worker_id: str
    endpoint: str  # "" when the worker cannot accept connections (NAT): never a parent
    down_mbit: float = 0.0
    up_mbit: float = 0.0
    alive: bool = True
    corrupt: bool = False
    # docs/nat.md: "reachable" (anyone can connect), "punchable" (a parent through a punched
    # link), "none" (a tail fed by a reachable parent), "unknown" (not classified yet: a tail)
    nat: str = "reachable"
    address: str = ""  # public ip:port of its punch port, as the reflector saw it
    installed: dict[int, float] = field(default_factory=dict)  # version -> s after publication
    base: bool = False  # serves the run's base model (LoRA; echo_rl.broadcast.basemodel)
    joined: float = field(default_factory=time.monotonic)


class Coordinator:
    def __init__(
        self, topology: Topology, source: str, *, q: float = 1.0, reports: ReportBook | None = None
    ):
        self.topology = topology
        self.source = source
        self.q = q
        self.links = LinkMeter()
        self.plans: dict[int, dict[str, str]] = {}  # version -> the plan it was published with
        self.peers: dict[str, PeerState] = {}
        self.sources: dict[str, str] = {}  # the last plan: worker -> endpoint it pulls from
        self.reports = reports or ReportBook()
        self.given: dict[str, list[str]] = {}  # worker -> the last GIVEN sources it was sent
        # worker -> the source a report of its own moved it to (no witness there), till a plan
        self.placed_by_report: dict[str, str] = {}
        self._by_endpoint: dict[str, str] = {}  # relay endpoint -> worker id (``owner``)
        # Parts with a job of their own, reading the same live peers and reports.
        self.install_log = InstallLog(self.peers, self.reports, source, q)
        self.whole = WholeSources(self.peers, self.reports, source)
        self.nat = PunchRoutes(self.peers, self.owner)
        self.punches = self.nat.punches  # the learner sets its timeout from the config

    @property
    def published(self) -> dict[int, float]:
        """version -> monotonic publication time."""
        return self.install_log.published

    def join(
        self,
        worker_id: str,
        endpoint: str,
        down_mbit: float = 0.0,
        up_mbit: float = 0.0,
        nat: str = "reachable",
        now: float | None = None,
    ) -> None:
        self.peers[worker_id] = PeerState(
            worker_id,
            endpoint,
            down_mbit,
            up_mbit,
            nat=nat,
            joined=time.monotonic() if now is None else now,
        )
        if endpoint:
            self._by_endpoint[endpoint] = worker_id

    def classify(self, worker_id: str, nat: str, address: str) -> None:
        """The learner's verdict on a worker's NAT (``echo_rl.broadcast.nat.reflect``)."""
        self.nat.classify(worker_id, nat, address)

    def _relays(self, p: PeerState) -> bool:
        return bool(p.endpoint) and not p.corrupt and p.nat in ("reachable", "punchable")

    def route(self, worker_id: str, endpoint: str) -> tuple[str, list[tuple[str, wire.Punch]]]:
        """The source ``worker_id`` is sent for ``endpoint`` and the punches that link needs
        (to send first): a reachable parent's endpoint as it is, a punchable one's through a
        punched link (docs/nat.md). Remembered: the worker may report on that source."""
        given = self.given.setdefault(worker_id, [])
        if endpoint not in given:
            given[:] = [*given[-(GIVEN - 1) :], endpoint]
        return self.nat.route(worker_id, endpoint)

    def transport(self, worker_id: str) -> str:
        """How this worker's planned snapshot link is carried: "punched" (through a punched
        link to a punchable parent) or "tcp" (the learner or a reachable parent)."""
        return self.nat.carried(self.sources.get(worker_id, ""))

    def owner(self, endpoint: str) -> PeerState | None:
        """The peer relaying at ``endpoint`` (an index: reports and routes call this per
        message, and a scan of the fleet each time is O(fleet))."""
        p = self.peers.get(self._by_endpoint.get(plain(endpoint), ""))
        return p if p is not None and p.endpoint and p.endpoint == plain(endpoint) else None

    def leave(self, worker_id: str) -> None:
        gone = self.peers.pop(worker_id, None)
        if gone is not None:
            self.whole.forget(gone.endpoint)
            if self._by_endpoint.get(gone.endpoint) == worker_id:
                del self._by_endpoint[gone.endpoint]
        self.reports.forget(worker_id, gone.endpoint if gone is not None else "")
        self.nat.forget(worker_id)
        self.sources.pop(worker_id, None)
        self.given.pop(worker_id, None)
        self.placed_by_report.pop(worker_id, None)
        self.links.forget(worker_id)

    def rates(self) -> dict[str, tuple[float, float]]:
        """(down, up) Mbit/s per live peer, as the planner gets them."""
        declared = {p.worker_id: (p.down_mbit, p.up_mbit) for p in self.peers.values() if p.alive}
        return self.links.rates(declared)

    def _planned_peers(self, hidden: AbstractSet[str] = frozenset()) -> list[Peer]:
        """The live peers as the planner sees them; corrupt and ``hidden`` relays as no one's
        parent."""
        rates = self.rates()
        return [
            Peer(
                p.worker_id,
                *rates[p.worker_id],
                reachable=self._relays(p),
                endpoint="" if p.corrupt or p.endpoint in hidden else p.endpoint,
                nat=p.nat if p.nat in ("reachable", "punchable") else "none",
            )
            for p in self.peers.values()
            if p.alive
        ]

    def _plan(self) -> dict[str, str]:
        peers = self._planned_peers()
        self.sources = self.topology.plan(peers, self.source) if peers else {}
        now = time.monotonic()
        for w in list(self.sources):  # a reporter stays off the relay it accused
            self.sources[w] = self._upstream(w, self.reports.avoided(w, now))
        if self.published:
            self.plans[max(self.published)] = dict(self.sources)
        return self.sources

    def _placement(self, worker_id: str, hidden: set[str]) -> str:
        """Where a plan with the ``hidden`` relays in no parent position would put this
        worker (one planning pass: an assigned child's report, i.e. a real failure). After a
        relay dies its child lands where the planner finds free upload, as before reports
        were evidence; the re-attached child's grandparent would split its own upload."""
        peers = self._planned_peers(hidden)
        plan = self.topology.plan(peers, self.source) if peers else {}
        src = plan.get(worker_id, self.source)
        return self.source if src in hidden else src

    def _upstream(self, worker_id: str, avoided: set[str]) -> str:
        """The worker's planned source, or, when it avoids that relay, the relay's own source
        (and so on up): it re-attaches upstream, as after a relay's death."""
        src = self.sources.get(worker_id, self.source)
        for _ in range(len(self.sources) + 1):
            if src == self.source or src not in avoided:
                return src
            owner = self.owner(src)
            src = self.sources.get(owner.worker_id, self.source) if owner else self.source
        return self.source

    def publish(self, version: int, now: float | None = None) -> dict[str, str]:
        self.install_log.publish(version, now)
        self.placed_by_report.clear()  # the plan places every child for its own reasons
        for old in sorted(self.plans)[:-4]:
            del self.plans[old]
        return dict(self._plan())  # a copy: reports move single workers in self.sources

    def measured(self, worker_id: str, version: int, down_mbit: float, up_mbit: float) -> bool:
        """A worker's measured link rates for ``version`` (its install report), combined with
        the other end of each of its links in that version's plan; used from the next plan."""
        if worker_id not in self.peers or version not in self.published:
            return False
        by_ep = {p.endpoint: p.worker_id for p in self.peers.values() if p.endpoint}
        plan = {w: by_ep.get(ep) for w, ep in self.plans.get(version, self.sources).items()}
        return self.links.report(version, worker_id, down_mbit, up_mbit, plan, self._root_share())

    def _root_share(self) -> float:
        """The learner's uplink per chain (Mbit/s), when the topology knows it: a head that
        downloads at that rate was limited by the learner, not by its own link."""
        params = getattr(self.topology, "params", None)
        plan = getattr(self.topology, "last_plan", None)
        uplink = getattr(params, "uplink_mbit", None)
        if not uplink or plan is None or not plan.streams:
            return math.inf
        return float(uplink / plan.streams)  # (the topology's plan is not typed)

    def source_for(self, worker_id: str) -> str:
        """Where a worker (e.g. a late joiner) pulls the current snapshot from: its place in
        the plan, usually a peer that already holds it rather than the learner."""
        if worker_id not in self.sources:
            self._plan()
        return self.sources.get(worker_id, self.source)

    def keyframe_source(self, worker_id: str, version: int, bad_source: str = "") -> str:
        """Where a worker without the base of a delta fetches ``version``'s full payload."""
        return self.whole.keyframe(
            worker_id, version, bad_source, max(self.published, default=version)
        )

    def base_source(self, worker_id: str, bad_source: str = "") -> str:
        """Where a worker without the run's base model fetches it."""
        return self.whole.base(worker_id, bad_source)

    def holds_base(self, worker_id: str, held: bool) -> None:
        """A worker's heartbeat says whether its relay serves the base model."""
        peer = self.peers.get(worker_id)
        if peer is not None:
            peer.base = held

    def assigned(self, worker_id: str, endpoint: str) -> bool:
        """Was ``endpoint`` this worker's source: handed to it (``route``), or in the current
        plan or a kept earlier one (a report about a superseded version still counts)?"""
        return endpoint in self.given.get(worker_id, ()) or any(
            plan.get(worker_id) == endpoint for plan in (self.sources, *self.plans.values())
        )

    def witnessed(self, worker_id: str, endpoint: str) -> bool:
        """Would a report from ``worker_id`` on ``endpoint`` count: its assigned source, and not
        one it was moved to because it reported another (``echo_rl.broadcast.reports``)?"""
        return self.assigned(worker_id, endpoint) and self.placed_by_report.get(worker_id) != plain(
            endpoint
        )

    def reattach(
        self,
        worker_id: str,
        bad_source: str,
        reason: str,
        now: float | None = None,
        count: bool = True,
        group: str | None = None,
    ) -> str:
        """A worker's source failed: the worker gets another one at once; the report is
        evidence against the source (``echo_rl.broadcast.reports``), counted when ``count``, as the
        word of witness ``group`` (None: the worker itself)."""
        now = time.monotonic() if now is None else now
        bad_source = plain(bad_source)
        accused = self.owner(bad_source)
        if accused is not None and reason in ("unpunchable", "tunnel_lost"):
            self.nat.link_failed(worker_id, accused, reason)
        elif accused is not None:
            assigned = count and self.witnessed(worker_id, bad_source)
            outcome = self.reports.report(worker_id, bad_source, reason, assigned, now, group)
            if outcome != "convicted":
                # Only the reporter moves; everyone else keeps the source it is pulling from.
                log.info(
                    "relay %s reported by %s (%s, %s): %s routed around it",
                    accused.worker_id,
                    worker_id,
                    reason,
                    outcome,
                    worker_id,
                )
                avoided = self.reports.avoided(worker_id, now)
                if outcome == "counted":  # a real child: its place in a plan without the relay
                    self.sources[worker_id] = self._placement(worker_id, avoided)
                    # ... which is no place it could report from as a witness, till the next plan
                    self.placed_by_report[worker_id] = self.sources[worker_id]
                elif worker_id in self.sources:  # anyone else: upstream, no planning cost
                    self.sources[worker_id] = self._upstream(worker_id, avoided)
                new = self.sources.get(worker_id, self.source)
                return self.source if new == bad_source else new
            self._apply(accused)
            log.warning(
                "relay %s convicted by reports from %d witnesses (%s): kept out until re-probed",
                accused.worker_id,
                self.reports.convict_after,
                reason,
            )
        self._plan()
        new = self.sources.get(worker_id, self.source)
        if new == bad_source:  # the plan still trusts it (e.g. a learner hiccup): go to the root
            new = self.source
        return new

    def confirm(self, endpoint: str, outcome: str, now: float | None = None) -> None:
        """The learner's own probe of ``endpoint``: ``corrupt`` or ``unreachable`` convicts it,
        ``intact`` after an expired mark lifts the mark (a passed re-probe)."""
        now = time.monotonic() if now is None else now
        peer = self.owner(endpoint)
        if outcome in (CORRUPT, UNREACHABLE):
            if self.reports.marks.get(endpoint) is not None:
                self.reports.extend(endpoint, now)
            else:
                self.reports.convict(endpoint, outcome, now)
        elif endpoint in self.reports.due(now):  # a re-probe: passed, or marked for longer
            if outcome == "intact":
                self.reports.clear(endpoint)
            else:
                self.reports.extend(endpoint, now)
        if peer is not None:
            self._apply(peer)
        self._plan()

    def lift(self, endpoint: str) -> None:
        """An expired mark the learner cannot re-probe (a relay only punched links reach):
        planned again, on its strikes' record."""
        self.reports.clear(endpoint)
        peer = self.owner(endpoint)
        if peer is not None:
            self._apply(peer)

    def _apply(self, peer: PeerState) -> None:
        mark = self.reports.marks.get(peer.endpoint)
        peer.corrupt = mark is not None and mark.kind == CORRUPT
        peer.alive = not (mark is not None and mark.kind == UNREACHABLE)

    def installed(self, worker_id: str, version: int, now: float | None = None) -> float | None:
        return self.install_log.installed(worker_id, version, now)

    def joiner_source(self, worker_id: str, version: int, tries: int = 8) -> str:
        return self.install_log.joiner_source(worker_id, version, tries)

    def install_times(self, version: int) -> dict[str, float]:
        return self.install_log.install_times(version)

    def t_bcast(self, version: int, q: float | None = None) -> float | None:
        return self.install_log.t_bcast(version, q)
