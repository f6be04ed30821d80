"""One GPU, several runs: who generates next, and which models stay on the device.

A volunteer joined to several learners (``echo-worker join LINE1 LINE2``, docs/multirun.md)
runs one ``Worker`` per run in one process. Each run's generation asks ``Turns`` for the
device before it generates a grant and gives it back after; a run with nothing to generate
(its learner's staleness gate is closed, it has no grant, it waits for a version) does not
ask, so the device goes to a run that can use it instead of idling.

Among runs waiting at the same time the one furthest behind its share goes first: the least
recent device-seconds (decayed with a 5-minute time constant, so the books follow a run's
phases rather than the whole day) per unit of weight. A run's weight is the volunteer's
``--share`` (as BOINC's resource shares), times ``1 + price`` (what its learner pays), times its
learner's need: its capacity requirement over the capacity it has, sent in every heartbeat
reply. A run short of rollouts thus gets more turns than one whose learner is the bottleneck.
The need is clamped to [1/4, 4]: a learner claiming more cannot take more than 4 times its
share (tests/test_sharing.py::test_a_learner_s_claimed_need_is_clamped).

Residency: at most ``resident`` models on the device (RollMux's residency constraint). A
run that has work (a non-empty grant) and whose model is not resident evicts the least
recently used one to host memory (``park``) and brings its own back (``unpark``); the seconds
it takes are counted as switch time. A turn that ends in an empty grant moves nothing. On a
CPU the device is host memory, so parking costs nothing.

The state lives on the worker's event loop (one thread): no locks.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field

from echo_rl.worker.status import Sharing

TAU_S = 300.0  # the books' decay time constant: a few learner phases
NEED_MIN, NEED_MAX = 0.25, 4.0  # the most a learner's need can change its run's weight

Mover = Callable[[str], None]  # moves a run's model: off the device (park) or onto it (unpark)


@dataclass
class RunShare:
    """One run's claim on the device and what it received."""

    name: str
    weight: float  # the volunteer's share times the price factor (> 0)
    need: float = 1.0  # its learner's need, clamped (see the module docstring)
    recent_s: float = 0.0  # device-seconds, decayed with TAU_S: the books turns follow
    used_s: float = 0.0  # device-seconds generating for this run, all told
    turns: int = 0
    switches: int = 0  # turns that had to bring this run's model onto the device
    switch_s: float = 0.0
    waiting_since: float | None = None
    loaded: bool = False  # its model has been on the device once

    def deficit(self) -> float:
        return self.recent_s / (self.weight * self.need)


@dataclass
class Turns:
    """The device's arbiter (see the module docstring). ``park``/``unpark`` move a model; the
    defaults do nothing (one run, or a CPU)."""

    resident: int = 1
    park: Mover = lambda run: None
    unpark: Mover = lambda run: None
    clock: Callable[[], float] = time.monotonic
    runs: dict[str, RunShare] = field(default_factory=dict)
    _on_device: OrderedDict[str, None] = field(default_factory=OrderedDict)
    _holder: str | None = None
    _changed: asyncio.Event = field(default_factory=asyncio.Event)
    _started: float | None = None
    _idle_s: float = 0.0
    _idle_from: float | None = None
    _booked: float | None = None  # when the recent books were last decayed

    def __post_init__(self) -> None:
        if self.resident < 1:
            raise ValueError(
                f"resident models = {self.resident}: at least 1 (--resident, docs/multirun.md)"
            )

    def parks(self) -> bool:
        """Whether models will move between the device and host memory: more runs than
        device slots. A backend that must prepare for it (vLLM's sleep mode) asks at load."""
        return len(self.runs) > self.resident

    def add(self, name: str, share: float = 1.0, price: float = 0.0) -> RunShare:
        if not share > 0:
            raise ValueError(f"run {name!r}: share {share:g} must be > 0 (--share)")
        # A paid run's share grows with its price (USD/h): a run paying 1 $/h counts double.
        run = RunShare(name, share * (1.0 + max(price, 0.0)))
        self.runs[name] = run
        return run

    @asynccontextmanager
    async def turn(self, name: str) -> AsyncIterator[None]:
        """Hold the device for ``name`` while the body runs (generate and score a grant)."""
        if self._holder == name:  # the run's own nested turn (an install, a rollout)
            yield
            return
        run = self.runs[name]
        run.waiting_since = self.clock()
        try:
            while not self._is_next(run):
                self._changed.clear()
                await self._changed.wait()
        finally:
            run.waiting_since = None
            self._changed.set()  # a waiter cancelled here may have been the next one
        self._take(run)
        t0 = self.clock()
        try:
            yield
        finally:
            self._charge(run, self.clock() - t0)
            self._give_back()

    def _is_next(self, run: RunShare) -> bool:
        if self._holder is not None:
            return False
        waiting = [r for r in self.runs.values() if r.waiting_since is not None]
        # Furthest behind its share first; among equals, whoever waited longest.
        first = min(waiting, key=lambda r: (r.deficit(), r.waiting_since or 0.0))
        return first is run

    def _take(self, run: RunShare) -> None:
        now = self.clock()
        if self._started is None:
            self._started = now
        if self._idle_from is not None:
            self._idle_s += now - self._idle_from
            self._idle_from = None
        self._holder = run.name

    async def bring_on(self, name: str) -> None:
        """During ``name``'s turn: its model onto the device, the least recently used making
        room. Called once a grant has work (or before a load), not at every turn: a turn that
        ends in an empty grant moves no model."""
        assert self._holder == name, f"bring_on({name!r}) outside its turn"
        run = self.runs[name]
        if name in self._on_device:
            self._on_device.move_to_end(name)
            return
        t0 = self.clock()
        # Off the loop: moving a model takes a while, and heartbeats go on meanwhile. Nothing
        # else touches these models now: installs take a turn too (echo_rl/worker/install.py).
        while len(self._on_device) >= self.resident:
            evicted, _ = self._on_device.popitem(last=False)
            await asyncio.to_thread(self.park, evicted)
        await asyncio.to_thread(self.unpark, name)
        self._on_device[name] = None
        if run.loaded:  # a first load is not a switch
            run.switches += 1
            run.switch_s += self.clock() - t0
        run.loaded = True

    def _charge(self, run: RunShare, seconds: float) -> None:
        """Every run's recent books decay by the same factor, so the order among them is
        what their recent turns make it."""
        now = self.clock()
        fade = math.exp(-(now - self._booked) / TAU_S) if self._booked is not None else 1.0
        self._booked = now
        for r in self.runs.values():
            r.recent_s *= fade
        run.recent_s += seconds
        run.used_s += seconds
        run.turns += 1

    def set_need(self, name: str, need: float) -> None:
        """Its learner's need (a heartbeat reply), clamped: a hostile learner's claim is
        worth at most NEED_MAX times its share."""
        run = self.runs.get(name)
        if run is not None and math.isfinite(need):
            run.need = min(NEED_MAX, max(NEED_MIN, need))

    def _give_back(self) -> None:
        self._holder = None
        self._idle_from = self.clock()
        self._changed.set()

    def forget(self, name: str) -> None:
        """A run that ended (its learner stopped, it banned us): it waits for nothing more."""
        self.runs.pop(name, None)
        self._on_device.pop(name, None)
        self._changed.set()

    def on_device(self, name: str) -> bool:
        return name in self._on_device

    def idle_fraction(self) -> float:
        """Share of the time since the first turn with no run on the device."""
        if self._started is None:
            return 1.0
        now = self.clock()
        idle = self._idle_s + (now - self._idle_from if self._idle_from is not None else 0.0)
        return idle / max(now - self._started, 1e-9)

    def sharing(self, name: str) -> Sharing:
        """``name``'s part, for its status file."""
        run = self.runs[name]
        return Sharing(
            runs=len(self.runs),
            share=round(self.shares()[name], 4),
            device_s=round(run.used_s, 3),
            switches=run.switches,
            idle_fraction=round(self.idle_fraction(), 4),
        )

    def shares(self) -> dict[str, float]:
        """Each run's fraction of the device-seconds used so far."""
        total = sum(r.used_s for r in self.runs.values())
        return {n: (r.used_s / total if total else 0.0) for n, r in self.runs.items()}


@dataclass(frozen=True)
class DeviceSeat:
    """One run's place at the device's ``Turns``, given to the parts that take turns on it
    (generation, installs, the model's load) when they are built."""

    turns: Turns
    name: str

    def turn(self) -> AbstractAsyncContextManager[None]:
        return self.turns.turn(self.name)

    def bring_on(self) -> Awaitable[None]:
        return self.turns.bring_on(self.name)

    def parks(self) -> bool:
        return self.turns.parks()
