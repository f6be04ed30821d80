"""A topology decides where each worker fetches a snapshot from."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass


@dataclass(frozen=True)
class Peer:
    worker_id: str
    down_mbit: float = 0.0  # 0: unknown
    up_mbit: float = 0.0
    reachable: bool = True  # may be a parent
    endpoint: str = ""  # where this peer serves chunks, if it relays
    # docs/nat.md: "reachable" (any child), "punchable" (a parent of children that can punch
    # too), "none" (never a parent; its own parent must be "reachable")
    nat: str = "reachable"


class Topology(ABC):
    @classmethod
    def from_params(
        cls, *, uplink_mbit: float | None, link_mbit: float | None, chunk_bytes: int
    ) -> Topology:
        """Build from the broadcast config; topologies that need no rates ignore them."""
        return cls()

    @abstractmethod
    def plan(self, peers: list[Peer], source: str) -> dict[str, str]:
        """Map every worker id to the endpoint it pulls chunks from (``source`` is the learner)."""
