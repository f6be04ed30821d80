"""A publication on the server's loop: the version is stored (servable, offered in heartbeat
replies) and planned, and its notices go out from a task of their own, to a bounded number of
workers (docs/security.md, "Sybils"); the rest learn of it from their next heartbeat reply.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Awaitable, Callable

from echo_rl.broadcast.manifest import Manifest
from echo_rl.broadcast.snapshot import Snapshot
from echo_rl.broadcast.store import SnapshotBuffer
from echo_rl.control.cpu import CpuBook
from echo_rl.control.members import Members
from echo_rl.control.routes import SnapshotRoutes
from echo_rl.control.sessions import SessionTable, WorkerState
from echo_rl.core import wire
from echo_rl.core.config import EchoConfig


class Notices:
    def __init__(
        self,
        cfg: EchoConfig,
        *,
        table: SessionTable,
        members: Members,
        routes: SnapshotRoutes,
        cpu: CpuBook,
        send: Callable[[WorkerState, wire.Message], Awaitable[None]],
    ):
        self.table = table
        self.members = members
        self.routes = routes
        self.cfg = cfg  # security.notices_per_publication, read at each publication
        self.cpu = cpu
        self.send = send
        self.noticed: Counter[str] = Counter()  # notices sent / deferred to heartbeats
        self._tasks: set[asyncio.Task[None]] = set()  # fan-outs in flight (kept referenced)

    async def publish(self, snap: Snapshot) -> None:
        """Store the version and plan it (members only: pending keys are not in the plan);
        the notices go out from their own task, so the publisher waits for none of them."""
        routes = self.routes
        assert routes.coordinator is not None
        routes.store.add(SnapshotBuffer(snap.manifest, snap.payload))
        routes.probes.published(snap.manifest.layout)  # kept for probes of relays behind
        routes.results.add(SnapshotBuffer(snap.manifest.result_layout, snap.full))
        routes.coordinator.publish(snap.version)
        task = asyncio.create_task(self.notify(snap.version, snap.manifest))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def order(self, version: int) -> list[WorkerState]:
        """Who is told of ``version`` now: at most ``security.notices_per_publication``;
        members first, among them those whose deliveries were admitted (what no key fakes
        without doing the work), then active ones, then pending keys, each least recently
        told first. The rest learn it from their next heartbeat reply (``worker.heartbeat_s``
        later), so a thousand keys add a bounded amount of work to a publication."""
        order = sorted(
            self.table.workers.values(),
            key=lambda w: (
                not w.member,
                w.admitted == 0,
                not (w.member and self.members.is_active(w.worker_id)),
                w.noticed,
            ),
        )
        chosen = order[: self.cfg.security.notices_per_publication]
        for w in chosen:
            w.noticed = version
        self.noticed["sent"] += len(chosen)
        self.noticed["deferred"] += len(order) - len(chosen)
        return chosen

    async def notify(self, version: int, manifest: Manifest) -> None:
        store = self.routes.store
        for n, w in enumerate(self.order(version)):
            latest = store.latest()
            if latest is None or latest.version != version:
                return  # superseded: the next publication's notices carry the newer version
            if self.table.workers.get(w.worker_id) is not w:
                continue  # left meanwhile
            t0 = time.thread_time()
            src = self.routes.snapshot_source(w)
            await self.send(
                w,
                wire.SnapshotNotice(
                    version=version,
                    manifest=manifest.to_wire(),
                    source=src.endpoint,
                    source_key=src.key,
                    ticket=src.ticket,
                ),
            )
            self.cpu.add("notice", time.thread_time() - t0)
            if n % 8 == 7:
                # A notice costs a ticket signature and an encryption: let waiting heartbeats
                # in between (a send to a ROUTER does not suspend).
                await asyncio.sleep(0)
