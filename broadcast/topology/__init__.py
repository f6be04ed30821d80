"""Broadcast topologies, picked by ``broadcast.topology`` in the config."""

from broadcast.topology.base import Peer, Topology
from broadcast.topology.chains import ChainsTopology
from broadcast.topology.star import StarTopology
from broadcast.topology.star_unlimited import StarUnlimitedTopology

TOPOLOGIES: dict[str, type[Topology]] = {
    "star": StarTopology,
    "star-unlimited": StarUnlimitedTopology,
    "chains": ChainsTopology,
}


def make_topology(
    name: str,
    *,
    uplink_mbit: float | None = None,
    link_mbit: float | None = None,
    chunk_bytes: int = 1 << 20,
) -> Topology:
    if name not in TOPOLOGIES:
        raise ValueError(f"unknown broadcast.topology {name!r}: choose one of {sorted(TOPOLOGIES)}")
    return TOPOLOGIES[name].from_params(
        uplink_mbit=uplink_mbit, link_mbit=link_mbit, chunk_bytes=chunk_bytes
    )


__all__ = [
    "Peer",
    "Topology",
    "StarTopology",
    "StarUnlimitedTopology",
    "ChainsTopology",
    "TOPOLOGIES",
    "make_topology",
]
