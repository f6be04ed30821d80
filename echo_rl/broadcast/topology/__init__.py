"""Broadcast topologies, picked by ``broadcast.topology`` in the config."""

from echo_rl.broadcast.topology.base import Peer, Topology
from echo_rl.broadcast.topology.chains import ChainsTopology
from echo_rl.broadcast.topology.star import StarTopology
from echo_rl.broadcast.topology.star_unlimited import StarUnlimitedTopology

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
