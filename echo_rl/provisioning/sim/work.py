"""The simulated fleet's work: grants, the idle queue, each worker's process (request, generate,
deliver) and the replay buffer the deliveries land in. Admission, grant sizes and the room left
under the outstanding-work cap are ``echo_rl.data.rules``, the learner's own."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Generator

import numpy as np
import simpy

from echo_rl.data import rules
from echo_rl.data.rules import ReadyQueue
from echo_rl.provisioning.sim.fleet import Provisioner
from echo_rl.provisioning.sim.state import Shared
from echo_rl.provisioning.sim.tail import Lengths


class Work:
    """Hands out work as ``echo_rl.control.work.WorkQueue`` does and runs one process per worker.

    ``version`` tells the learner's current version (for admission); ``batch_ready`` is called
    after an admitted delivery with the buffer's size. ``provisioner`` gives the controller, if
    any, and what it is fed (``ctl``, ``observe_delivered``, ``observe_busy``)."""

    def __init__(
        self,
        shared: Shared,
        ids: list[str],
        mu: list[float],
        provisioner: Provisioner,
        version: Callable[[], int],
        batch_ready: Callable[[int], None],
    ) -> None:
        sc, rng = shared.sc, shared.rng
        self.env, self.sc, self.rng = shared.env, sc, rng
        self.ids, self.mu = ids, mu
        self.ws, self.snaps = shared.ws, shared.snaps
        self.ledger, self.counters = shared.ledger, shared.counters
        self.prov, self.version, self.batch_ready = provisioner, version, batch_ready
        L = sc.learner
        self.G, self.S = L.group_size, L.staleness
        self.max_out = L.effective_outstanding
        self.gpr = sc.rollout.groups_per_request
        self.buffer: ReadyQueue[None] = ReadyQueue()  # counts per version, arrival order
        self.in_flight = 0
        self.idle: deque[int] = deque()
        self._jitter = np.empty(0)
        self._jit_pos = 0
        self.lengths = Lengths(sc.rollout, self.G, rng, len(ids), mu)

    @property
    def buffered(self) -> int:
        return len(self.buffer)

    def _rand_jitter(self) -> float:
        sigma = self.sc.rollout.duration_sigma
        if not sigma:
            return 1.0
        if self._jit_pos >= len(self._jitter):
            # mean-one lognormal, drawn in batches (one numpy call per 65k requests)
            self._jitter = self.rng.lognormal(-sigma * sigma / 2, sigma, 65536)
            self._jit_pos = 0
        x = self._jitter[self._jit_pos]
        self._jit_pos += 1
        return float(x)

    def _free_slots(self) -> int:
        return rules.room(self.max_out, self.in_flight, self.buffered)

    def _grant_size(self, i: int) -> int:
        ctl = self.prov.ctl
        probation = ctl is not None and self.ws.registered[i] and ctl.on_probation(self.ids[i])
        # a worker carrying groups asks for that many fewer (echo_rl/worker/generation.py)
        ask = max(1, self.gpr - len(self.lengths.carry[i]))
        return rules.grant_size(
            ask, self.max_out, self.in_flight, self.buffered, self.ledger.n_active, probation
        )

    def fill(self) -> None:
        """Hand free slots to queued idle workers (oldest request first)."""
        ws = self.ws
        while self.idle and self._free_slots() > 0:
            i = self.idle.popleft()
            ws.queued[i] = False
            if not ws.working(i) or ws.granted[i] or ws.busy[i]:
                continue  # gone, or it already found work by itself
            if self.snaps.install_wait(i) > 0:
                ws.wake_up(i)  # it goes to wait for its snapshot, and queues again later
                continue
            g = self._grant_size(i)
            ws.granted[i] = g
            self.in_flight += g
            ws.wake_up(i)

    def _sleep(self, i: int) -> Generator[simpy.Event, object, None]:
        ev = self.env.event()
        self.ws.wake[i] = ev
        try:
            yield ev
        except simpy.Interrupt:
            pass
        self.ws.wake[i] = None

    def _queue(self, i: int) -> None:
        if not self.ws.queued[i]:
            self.ws.queued[i] = True
            self.idle.append(i)

    def _wait_for_work(self, i: int) -> Generator[simpy.Event, object, int | None]:
        """Worker i holds no grant: wait for its snapshot or for a slot, or take a grant now.
        Returns the groups granted (None: look again)."""
        ws = self.ws
        wait = self.snaps.install_wait(i)
        if wait > 0:
            if not math.isinf(wait) and self._free_slots() <= 0:
                # no work for it anyway: queue now, fill re-checks the install
                # (saves one wake-up per worker and publication on large fleets)
                self._queue(i)
                yield from self._sleep(i)
            elif math.isinf(wait):
                yield from self._sleep(i)
            else:
                try:
                    yield self.env.timeout(wait)
                except simpy.Interrupt:
                    pass
            return None
        if self._free_slots() <= 0 or self.idle:
            if not ws.queued[i]:
                self._queue(i)
                self.fill()
            if not ws.granted[i]:
                yield from self._sleep(i)
            return None
        g = self._grant_size(i)
        self.in_flight += g
        return g

    def worker(self, i: int) -> Generator[simpy.Event, object, None]:
        """Worker i's process, for the whole run."""
        ws = self.ws
        Gmu = self.G / self.mu[i]
        while True:
            if not ws.working(i):
                lost = self.lengths.carry[i].clear()  # its carried groups go with it
                self.in_flight -= lost
                self.counters.lost_groups += lost
                if ws.granted[i]:  # reserved for it, but it was released/left meanwhile
                    self.in_flight -= ws.granted[i]
                    ws.granted[i] = 0
                    self.fill()
                yield from self._sleep(i)
                continue
            g = ws.granted[i]
            if not g and len(self.lengths.carry[i]):
                g = 0  # its carried groups go on, granted more or not (echo_rl/worker/tail.py)
            elif not g:
                got = yield from self._wait_for_work(i)
                if got is None:
                    continue
                g = got
            else:
                ws.granted[i] = 0
            u = self.snaps.inst_ver[i]
            ctl = self.prov.ctl
            if ctl is not None and ws.registered[i]:
                ctl.ready(self.ids[i])  # as a work request does (echo_rl/control/deliveries.py)
            carried = len(self.lengths.carry[i])
            ws.busy[i] = g + carried
            epoch = ws.leave_epoch[i]
            if (
                self.lengths.on
            ):  # sample lengths and the tail cut (echo_rl/provisioning/sim/tail.py)
                share, done = self.lengths.request(i, g, u)
                gen_s = self.gpr * Gmu * share * self._rand_jitter()
            else:
                done, gen_s = [(u, g)], g * Gmu * self._rand_jitter()
            try:
                yield self.env.timeout(gen_s)
            except simpy.Interrupt:
                pass
            ws.busy[i] = 0
            if epoch != ws.leave_epoch[i]:
                # left while generating: the groups are lost (the learner re-issues them)
                lost = g + carried
                self.lengths.carry[i].clear()
                self.in_flight -= lost
                self.counters.lost_groups += lost
                self.fill()
                continue
            for v, n in done:
                self._deliver(i, n, v, gen_s * n / max(1, sum(k for _, k in done)))

    def _deliver(self, i: int, g: int, u: int, gen_s: float) -> None:
        self.in_flight -= g
        c = self.counters
        c.delivered_groups += g
        admitted = rules.admission(u, self.version(), self.S) == rules.OK
        prov = self.prov
        ctl = prov.ctl
        if ctl is not None and prov.observe_delivered and self.ws.registered[i]:
            # echo_rl/control/deliveries.py: admitted records only, with the batch's generation seconds
            # (none when nothing was admitted: refused work earns nothing).
            ctl.observe(
                self.ids[i],
                g * self.G if admitted else 0,
                busy_s=gen_s if prov.observe_busy and admitted else None,
            )
        if not admitted:
            c.dropped_stale_groups += g
        else:
            c.admitted_groups += g
            self.buffer.push(u, count=g)
            self.batch_ready(self.buffered)
        self.fill()

    def evict_stale(self, version: int) -> None:
        self.counters.dropped_stale_groups += self.buffer.evict(version, self.S)[0]

    def take(self, k: int, version: int) -> int:
        """Take the k oldest admissible groups; returns their oldest version."""
        return self.buffer.take(k, version)[0]
