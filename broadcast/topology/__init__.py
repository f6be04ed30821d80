"""Broadcast topologies, picked by ``broadcast.topology`` in the config."""

from broadcast.topology.base import Peer, Topology
from broadcast.topology.star import StarTopology

TOPOLOGIES: dict[str, type[Topology]] = {"star": StarTopology}


def make_topology(name: str) -> Topology:
    return TOPOLOGIES[name]()


__all__ = ["Peer", "Topology", "StarTopology", "TOPOLOGIES", "make_topology"]
