"""What the learner saw of its ports from outside its network, for ``echo-rl doctor``.

Behind a cloud's 1:1 NAT the learner's public address is on no interface of its host, and a
connection from the host to it does not loop back: the doctor on that host cannot reach its
own ports the way workers do. The workers in session can: a worker whose NAT probe came from
a public address (``echo_rl.core.addresses.reach``) joined through the control port and reached a
reflector port from outside, and one that installed a snapshot was fed, directly or through
its relays, from the chunk port. The counts travel in the ``doctor`` answer
(``wire.DoctorAck``); a worker cannot inflate them beyond its own session.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from echo_rl.broadcast.coordinator import Coordinator
from echo_rl.control.sessions import WorkerState
from echo_rl.core import wire
from echo_rl.core.addresses import reach

if TYPE_CHECKING:
    from echo_rl.control.server import LearnerServer


def outside_view(
    workers: Iterable[WorkerState], coordinator: Coordinator | None
) -> tuple[int, int]:
    """(workers in session seen from a public address, those of them that installed a
    snapshot)."""
    joined = installed = 0
    for w in workers:
        host = w.nat_address.rpartition(":")[0]
        if not host or reach(host) != "public":
            continue
        joined += 1
        peer = coordinator.peers.get(w.worker_id) if coordinator is not None else None
        if peer is not None and peer.installed:
            installed += 1
    return joined, installed


def doctor_ack(s: LearnerServer) -> wire.DoctorAck:
    """The answer to a health check (``echo-worker doctor``, ``echo-rl doctor``): the
    endpoints a worker is handed, and what the learner saw of its ports from outside."""
    joined, installed = outside_view(s.table.workers.values(), s.coordinator)
    return wire.DoctorAck(
        run_id=s.run_id,
        instance_id=s.parts.identity.instance_id,
        snapshot_endpoint=s.snapshot_endpoint,
        reflectors=s.reflector.endpoints if s.reflector else [],
        join=s.cfg.security.join,
        version=s.routes.latest()[0],
        outside_joined=joined,
        outside_installed=installed,
        snapshot_path=s.routes.path.verdict(len(s.table.workers)) or "",
    )
