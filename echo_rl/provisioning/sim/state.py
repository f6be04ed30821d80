"""The simulation's per-worker books, each with its own job: who is present and active and what
work it holds (``WorkerState``), what the active set costs over time (``Ledger``) and which
snapshot each worker has, fetches and has queued (``Snapshots``). Plain lists, touched one
element at a time in the hot loop."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import simpy

if TYPE_CHECKING:
    from echo_rl.provisioning.sim.scenario import Scenario


@dataclass
class Counters:
    delivered_groups: int = 0
    admitted_groups: int = 0
    dropped_stale_groups: int = 0  # at admission or evicted when the version moved
    lost_groups: int = 0  # in flight on a worker that left
    trained_groups: int = 0
    installs: int = 0
    leaves: int = 0
    joins: int = 0
    activations: int = 0
    releases: int = 0
    short: int = 0


class WorkerState:
    """Per worker: presence (churn), activity (provisioning), controller registration, the
    epoch that tells a stale churn event or a lost batch, and the work in its hands."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.present = [True] * n
        self.active = [False] * n
        self.registered = [False] * n
        self.leave_epoch = [0] * n
        self.busy = [0] * n  # groups being generated
        self.granted = [0] * n  # groups reserved by Work.fill for a woken worker
        self.queued = [False] * n  # in the idle queue
        self.wake: list[simpy.Event | None] = [None] * n
        self.procs: list[simpy.Process] = []

    def working(self, i: int) -> bool:
        return self.present[i] and self.active[i]

    def wake_up(self, i: int) -> None:
        ev = self.wake[i]
        if ev is not None and not ev.triggered:
            ev.succeed()


class Ledger:
    """The active set's price and capacity, and the workers' cost integrated over time (the
    learner's own price is added per step by the caller)."""

    def __init__(self, price: list[float], mu: list[float], clock: Callable[[], float]) -> None:
        self.price, self.mu, self._now = price, mu, clock
        self.price_active = 0.0
        self.mu_active = 0.0
        self.n_active = 0
        self.cost_workers = 0.0  # cumulative $ of workers up to self.cost_t
        self.cost_t = 0.0
        self.timeline: list[tuple[float, int, float, float]] = []

    def bill(self) -> None:
        now = self._now()
        self.cost_workers += self.price_active * (now - self.cost_t) / 3600.0
        self.cost_t = now

    def start(self, price_active: float, mu_active: float, n_active: int) -> None:
        """The initial active set."""
        self.bill()
        self.price_active, self.mu_active, self.n_active = price_active, mu_active, n_active
        self.mark()

    def switch(self, i: int, on: bool) -> None:
        """Worker i starts (on) or stops being billed and counted."""
        self.bill()
        sign = 1 if on else -1
        self.price_active += sign * self.price[i]
        self.mu_active += sign * self.mu[i]
        self.n_active += sign
        self.mark()

    def mark(self) -> None:
        now = self._now()
        row = (now, self.n_active, self.mu_active, self.price_active)
        if self.timeline and self.timeline[-1][0] == now:
            self.timeline[-1] = row
        else:
            self.timeline.append(row)


class Snapshots:
    """Per worker: the installed version, the one it fetches (arrival, then install after
    ``reload`` s) and one published meanwhile, queued behind it (echo_rl/worker/agent.py fetches one
    snapshot at a time); and the relay chains of the latest publication."""

    def __init__(
        self,
        n: int,
        reload: float,
        gdd: bool,
        clock: Callable[[], float],
        counters: Counters,
        pull_s: Callable[[int], float],
    ) -> None:
        self.reload, self.gdd, self._now, self.counters = reload, gdd, clock, counters
        self._pull_s = pull_s
        self.latest = 0  # newest published snapshot
        self.inst_ver = [-1] * n
        self.pend_ver = [-1] * n
        self.pend_arrival = [0.0] * n
        self.pend_install = [0.0] * n
        self.nxt_ver = [-1] * n  # published while the worker still fetches pend_ver
        self.nxt_arrival = [0.0] * n
        self.chain_of = np.full(n, -1, dtype=np.int64)
        self.chain_pos = np.full(n, -1, dtype=np.int64)
        self.cur_chains: list[np.ndarray] = []

    def install_wait(self, i: int) -> float:
        """0 if worker i may start generating now, else how long to wait for its pending
        snapshot. Applies every install that is due first (a worker installs what it has
        downloaded even while it has no work, as echo_rl/worker/agent.py does in its loop)."""
        now = self._now()
        while self.pend_ver[i] > self.inst_ver[i] and now >= self.pend_install[i] - 1e-9:
            self._installed(i)
        if self.pend_ver[i] > self.inst_ver[i]:
            if not self.gdd or self.inst_ver[i] < 0 or now >= self.pend_arrival[i] - 1e-9:
                return self.pend_install[i] - now
            return 0.0
        if self.inst_ver[i] < 0:
            return math.inf  # nothing to install and nothing pending: not provisioned yet
        return 0.0

    def _installed(self, i: int) -> None:
        """The pending snapshot is installed; a newer one queued behind it becomes pending
        (its bytes may have arrived meanwhile; loading waits for this install)."""
        done = self.pend_install[i]
        self.inst_ver[i] = self.pend_ver[i]
        self.counters.installs += 1
        if self.nxt_ver[i] > self.inst_ver[i]:
            self.pend_ver[i] = self.nxt_ver[i]
            self.pend_arrival[i] = max(self.nxt_arrival[i], done)
            self.pend_install[i] = self.pend_arrival[i] + self.reload
        else:
            self.pend_ver[i] = -1
        self.nxt_ver[i] = -1

    def offer(self, i: int, v: int, arrival: float) -> None:
        """Snapshot v reaches worker i at ``arrival``. A worker still fetching an older one
        finishes that first."""
        now = self._now()
        while self.pend_ver[i] > self.inst_ver[i] and now >= self.pend_install[i] - 1e-9:
            self._installed(i)
        if self.pend_ver[i] > self.inst_ver[i]:
            self.nxt_ver[i], self.nxt_arrival[i] = v, arrival
        else:
            self.pend_ver[i], self.pend_arrival[i] = v, arrival
            self.pend_install[i] = arrival + self.reload

    def pull_latest(self, i: int) -> None:
        """Activation or return: fetch the current snapshot from a peer unless it has it."""
        if max(self.inst_ver[i], self.pend_ver[i], self.nxt_ver[i]) >= self.latest:
            return
        self.nxt_ver[i] = -1
        self.pend_ver[i] = -1  # a fresh pull fetches the newest directly
        self.offer(i, self.latest, self._now() + self._pull_s(i))

    def set_chains(self, chains: list[np.ndarray]) -> None:
        self.chain_of[:] = -1
        self.chain_pos[:] = -1
        self.cur_chains = chains
        for c, ch in enumerate(chains):
            self.chain_of[ch] = c
            self.chain_pos[ch] = np.arange(len(ch))

    def reattach_children(self, i: int, delay: float) -> None:
        """Relay i left: its chain children re-attach upstream and resume after ``delay``
        (nothing restarts)."""
        now = self._now()
        c = int(self.chain_of[i])
        if c < 0:
            return
        for j in self.cur_chains[c][int(self.chain_pos[i]) + 1 :].tolist():
            if self.pend_ver[j] == self.latest and self.pend_arrival[j] > now:
                self.pend_arrival[j] += delay
                self.pend_install[j] += delay
            elif self.nxt_ver[j] == self.latest and self.nxt_arrival[j] > now:
                self.nxt_arrival[j] += delay
        self.chain_of[i] = -1


@dataclass(frozen=True)
class Shared:
    """What every part of one simulated run works on: the event loop, the scenario, the run's
    random stream and the books above (``echo_rl.provisioning.sim.core.Sim`` builds them once and
    hands them to the provisioner, the work and the churn)."""

    env: simpy.Environment
    sc: Scenario
    rng: np.random.Generator
    ws: WorkerState
    snaps: Snapshots
    ledger: Ledger
    counters: Counters
