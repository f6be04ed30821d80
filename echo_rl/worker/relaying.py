"""The worker's relay side: the relay that serves snapshot chunks to the children the learner
names (echo_rl.broadcast.relay), the punched links it serves them over (docs/nat.md), the NAT probe
that says whether this worker can relay at all, and the memory its payloads hold.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import zmq.asyncio

from echo_rl.broadcast.nat.links import Tunnels
from echo_rl.broadcast.nat.reflect import NatError, pick_punch_port, probe_all, punch_port_free
from echo_rl.broadcast.relay import Relay, RelayConfig, RelayPortTaken
from echo_rl.core import wire
from echo_rl.core.client import Client, RequestTimeout
from echo_rl.core.security import KeyPair
from echo_rl.worker.session import RelayOffer, WorkerError

if TYPE_CHECKING:
    import torch

log = logging.getLogger("echo.worker")

_NAT_MEANING = {
    "reachable": ": other workers connect to this one directly",
    "punchable": ": this worker relays through punched links",
    "none": ": the NAT maps each destination apart (symmetric); this worker stays a chain tail",
}


def probe_failed(err: NatError, reflectors: list[str]) -> str:
    """The log line of a failed NAT probe: what happened and what the volunteer can check."""
    host = reflectors[0].rpartition(":")[0] if reflectors else "the learner"
    ports = " and ".join(r.rpartition(":")[2] for r in reflectors[:2]) or "?"
    return (
        f"NAT probe failed ({err}): this worker will not relay (the learner feeds it itself; "
        f"the run goes on, its uplink carries more). Check that this machine may open TCP "
        f"connections to {host} port {ports} (a firewall here that blocks outbound TCP "
        f"stops the probe); if it may, the learner's operator has not opened them "
        f"(learner.reflector_ports, docs/ports.md). `echo-worker doctor` with the same join "
        f"line tests the path"
    )


class RelayNode:
    """The relay and its tunnels, bound at start (a port in use ends the worker, saying how
    to pick another); tuned by the learner's config at each join."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        cfg: RelayConfig,
        *,
        keys: KeyPair | None,
        run_key: Callable[[], bytes],
    ):
        self.cfg = cfg
        self.nat = "unknown"  # the learner's verdict on our NAT (docs/nat.md)
        try:
            self.relay = Relay(ctx, cfg, keys=keys, run_key=run_key, resolve=self._resolve)
        except RelayPortTaken as exc:
            raise WorkerError(str(exc)) from None
        host = cfg.punch_host or cfg.bind_host
        punch = cfg.punch_port
        if punch and not punch_port_free(host, punch):
            self.relay.close()
            raise WorkerError(
                f"punch port {punch} on {host} is in use (a second worker on this "
                f"machine?): give each worker its own --relay-port and "
                f"--punch-port, or 0 to let the OS pick (docs/ports.md)"
            )
        self.tunnels = Tunnels(host, punch or pick_punch_port(host), endpoint=self.relay.endpoint)

    async def _resolve(self, source: str) -> str:
        """Where the relay's fetches connect for ``source``: through a punched link when
        there is one (the tunnels need the relay's endpoint, so they are built after it)."""
        return await self.tunnels.resolve(source)

    def offer(self) -> RelayOffer:
        """What the join says of this relay."""
        return RelayOffer(self.relay.endpoint, self.cfg.down_mbit, self.cfg.up_mbit)

    def tune(self, view: dict[str, Any]) -> None:
        """The learner's broadcast and security settings, as a join states them."""
        bc = view["broadcast"]
        self.relay.cfg.window, self.relay.cfg.timeout_s = bc["window"], bc["timeout_s"]
        sec = view.get("security", {})
        self.relay.cfg.max_parked_per_peer = sec.get("max_parked_per_peer", 64)
        if self.relay.server is not None:  # the relay's server already exists: tune it
            self.relay.server.max_parked_per_peer = self.relay.cfg.max_parked_per_peer
            self.relay.server.max_parked_total = sec.get("max_parked_total", 4096)

    async def probe_nat(
        self, client: Client, worker_id: str, reflectors: list[str], timeout: float
    ) -> None:
        """Probe the learner's reflector from the punch port and have the learner classify
        this worker's NAT (docs/nat.md). A failure leaves this worker a tail, nothing worse."""
        port = int(self.relay.endpoint.rpartition(":")[2]) if self.relay.endpoint else 0
        try:
            nonces = await probe_all(reflectors, self.tunnels.host, self.tunnels.port, port)
            status = await client.request(
                wire.NatReport(worker_id=worker_id, nonces=nonces), timeout
            )
        except NatError as err:
            log.warning("%s", probe_failed(err, reflectors))
            return
        except RequestTimeout as err:
            log.warning(
                "NAT report not answered (%s): this worker will not relay (the learner "
                "feeds it itself; the run goes on)",
                err,
            )
            return
        if isinstance(status, wire.NatStatus):
            self.nat = status.nat
            log.info(
                "NAT: %s (punch port seen as %s)%s",
                status.nat,
                status.address,
                _NAT_MEANING.get(status.nat, ""),
            )
        else:
            log.warning("NAT report refused: %s", getattr(status, "detail", status))

    def memory(self, model: torch.nn.Module | None) -> dict[str, int]:
        """Where this worker's memory goes (docs/memory.md): its resident set, the model, and
        the snapshot payloads it holds (relay store, full versions, base model)."""
        from echo_rl.core.memstat import payload_bytes, resident, tensor_bytes

        stores = [getattr(self.relay, name, None) for name in ("store", "results", "bases")]
        held = payload_bytes(b.payload for st in stores if st is not None for b in st.buffers())
        return {
            **resident(),
            "model": tensor_bytes(model.parameters()) if model is not None else 0,
            "payloads_ram": held["ram"],
            "payloads_spilled": held["spilled"],
        }

    def close(self) -> None:
        self.relay.close()
