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


def make_topology(name: str) -> Topology:
    return TOPOLOGIES[name]()


__all__ = ["Peer", "Topology", "StarTopology", "StarUnlimitedTopology", "ChainsTopology",
           "TOPOLOGIES", "make_topology"]
