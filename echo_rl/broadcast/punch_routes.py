"""How a planned snapshot link is carried across NATs (docs/nat.md): the learner's verdict on each
worker's NAT, the punched links to punchable parents (``echo_rl.broadcast.nat.links.PunchBook``), and the
demotion of a child or a parent whose punched links fail.

Reads the coordinator's live peers and updates their ``nat`` and ``address``; finds a relay by
its endpoint through the coordinator's index (``owner``); owns the punch book.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from echo_rl.broadcast.nat.links import PunchBook
from echo_rl.core import wire

if TYPE_CHECKING:
    from echo_rl.broadcast.coordinator import PeerState

log = logging.getLogger(
    "echo_rl.broadcast.coordinator"
)  # the coordinator's words, as before the split


class PunchRoutes:
    def __init__(
        self, peers: dict[str, PeerState], owner: Callable[[str], PeerState | None]
    ) -> None:
        self.peers, self.owner = peers, owner
        self.punches = PunchBook()

    def classify(self, worker_id: str, nat: str, address: str) -> None:
        """The learner's verdict on a worker's NAT (``echo_rl.broadcast.nat.reflect``)."""
        peer = self.peers.get(worker_id)
        if peer is not None:
            peer.nat, peer.address = nat, address
            self.punches.forget(worker_id)

    def route(self, worker_id: str, endpoint: str) -> tuple[str, list[tuple[str, wire.Punch]]]:
        """``endpoint`` as ``worker_id`` is sent it, with the punches that link needs (to send
        first): a reachable parent's endpoint as it is, a punchable one's through a punched link."""
        parent = self.owner(endpoint)
        child = self.peers.get(worker_id)
        if (
            parent is None
            or child is None
            or parent.nat != "punchable"
            or not child.address
            or not parent.address
        ):
            return endpoint, []
        return self.punches.route(
            worker_id, parent.worker_id, endpoint, child.address, parent.address
        )

    def carried(self, source: str) -> str:
        """How a link from ``source`` is carried: "punched" (to a punchable parent) or "tcp"
        (the learner or a reachable parent)."""
        parent = self.owner(source)
        return "punched" if parent is not None and parent.nat == "punchable" else "tcp"

    def link_failed(self, worker_id: str, parent: PeerState, reason: str) -> None:
        """A punched link failed: the child becomes a tail fed by a reachable source, and a
        parent that failed two children relays no more through punched links."""
        demote_child, demote_parent = self.punches.failed_link(worker_id, parent.worker_id, reason)
        child = self.peers.get(worker_id)
        if demote_child and child is not None and child.nat == "punchable":
            child.nat = "none"
            log.warning(
                "punch from %s to %s failed: %s is now a tail fed by a reachable source",
                worker_id,
                parent.worker_id,
                worker_id,
            )
        if demote_parent and parent.nat == "punchable":
            parent.nat = "none"
            log.warning(
                "%s failed punched links with two workers: it no longer relays", parent.worker_id
            )

    def forget(self, worker_id: str) -> None:
        """A worker left: its punched links go."""
        self.punches.forget(worker_id)
