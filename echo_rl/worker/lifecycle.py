"""How a worker stops and yields: the stop signal and its budget, preemption notices, the
machine's owner (docs/preemption.md), and the asyncio helpers a stop must never wait behind.

SIGTERM to exit (issue 30): the handback, the pending deliveries and the goodbye share STOP_S;
the last LEAVE_S of it is kept for the goodbye, so the process is gone within 5 s.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Literal, Protocol, TypeVar

from echo_rl.worker.status import StatusBoard, notice_path

T = TypeVar("T")
log = logging.getLogger("echo.worker")

STOP_S = 4.0
LEAVE_S = 1.0
# While the model's libraries import on another thread, stopping switches the GIL back to this
# loop within STOP_SWITCH_S (Python's default interval: 5 ms; see echo_rl.worker.agent.LOAD_SWITCH_S).
STOP_SWITCH_S = 1e-4


async def in_daemon_thread(fn: Callable[[], T]) -> T:
    """``fn()`` on a daemon thread: unlike ``asyncio.to_thread`` nobody waits for it at exit,
    so a stop during a model load of minutes leaves at once (the load dies with the process)."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[T] = loop.create_future()

    def hand_back(settle: Callable[[], None]) -> None:
        def on_loop() -> None:
            if not fut.done():
                settle()

        try:
            loop.call_soon_threadsafe(on_loop)
        except RuntimeError:
            pass  # the loop is closed: nobody waits for it any more

    def target() -> None:
        try:
            result = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting task as it is
            hand_back(partial(fut.set_exception, exc))
            return
        hand_back(partial(fut.set_result, result))

    threading.Thread(target=target, name="echo-load", daemon=True).start()
    return await fut


async def wait_next(event: asyncio.Event, timeout: float) -> None:
    """Until ``event`` is next set, or ``timeout`` seconds."""
    event.clear()
    try:
        await asyncio.wait_for(event.wait(), timeout)
    except TimeoutError:
        pass


State = Literal["idle", "generating", "installing", "leaving", "yielded"]  # wire.Heartbeat's


@dataclass
class Activity:
    """What the worker is doing now, as the heartbeat and the status file say it."""

    state: State = "idle"


class Lifecycle:
    """The stop: its reason, its budget, and the cut of what is being generated; and the yield
    to the machine's owner (no work taken until the machine is quiet again)."""

    def __init__(
        self,
        worker_id: Callable[[], str],
        migrate: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.worker_id, self.migrate, self.clock = worker_id, migrate, clock
        self.stopping = asyncio.Event()
        self.exit_reason = ""
        self.stop_at: float | None = None  # monotonic time of the stop signal
        self.loaded = False  # the model is loaded: no import holds the GIL any more
        self.cut = threading.Event()  # set: cut the samples being generated now (preemption)
        self.yielded = False  # the machine's owner needs it (docs/preemption.md)
        self.quiet = asyncio.Event()  # set when a yield ends
        self._notice_timer: asyncio.TimerHandle | None = None  # a preemption notice's stop

    def stop(self, reason: str) -> None:
        if self.stopping.is_set():
            return
        log.info("worker %s stopping: %s", self.worker_id(), reason)
        self.exit_reason = reason
        self.stop_at = self.clock()
        if not self.loaded:
            # The model's libraries may still be importing on another thread, which keeps
            # the GIL for the interpreter's switch interval (5 ms) at a time: every blocking
            # call on the way out waited that long to get it back (5 s in all, measured).
            sys.setswitchinterval(STOP_SWITCH_S)
        if self.migrate and reason.startswith(("signal", "preemption")):
            self.cut.set()  # preempted: what is being generated goes back as prefixes
        self.stopping.set()
        self.quiet.set()

    def left(self, reserve: float = 0.0) -> float:
        """Seconds left of the stop's budget (STOP_S from the signal), less ``reserve``."""
        if self.stop_at is None:
            return STOP_S - reserve
        return max(0.1, self.stop_at + STOP_S - reserve - self.clock())

    async def or_stopped(self, aw: Awaitable[T]) -> T | None:
        """``aw``'s result, or None as soon as the worker is told to stop (``aw`` is
        cancelled): a stop never waits on a silent learner or a long model load."""
        task = asyncio.ensure_future(aw)
        stop = asyncio.ensure_future(self.stopping.wait())
        try:
            await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
        if task.done():
            return task.result()
        task.cancel()
        return None

    def notice(self, status_path: Path | None, round_trip_s: float) -> None:
        """A preemption notice (``echo-worker preempt --in S``): keep generating until the
        deadline minus a margin for the handback (two round trips, at least 2 s), then stop
        as on SIGTERM. A later notice replaces an earlier one."""
        try:
            path = notice_path(status_path) if status_path else None
            deadline = float(json.loads(path.read_text())["deadline"]) if path else None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("preemption notice unreadable (%s): stopping now", exc)
            deadline = time.time()
        if deadline is None:
            deadline = time.time()
        margin = max(2.0, 2 * round_trip_s)
        delay = max(0.0, deadline - time.time() - margin)
        log.info(
            "preemption notice: the machine goes in %.1f s; handing work back in %.1f s",
            deadline - time.time(),
            delay,
        )
        if self._notice_timer is not None:
            self._notice_timer.cancel()
        self._notice_timer = asyncio.get_running_loop().call_later(
            delay, self.stop, "preemption notice"
        )


class Owner(Protocol):
    """A ``echo_rl.worker.owner`` watch: is the machine's owner using it, and since when not."""

    quiet_s: float
    period_s: float

    def busy(self) -> bool: ...
    def quiet_for(self) -> float: ...
    def describe(self) -> str: ...


async def watch_owner(
    owner: Owner, life: Lifecycle, activity: Activity, status: StatusBoard
) -> None:
    """Owner first (docs/preemption.md): when the owner's work appears, cut what is being
    generated within a token, hand it back and take no work until the machine has been
    quiet for ``owner.quiet_s``."""
    while not life.stopping.is_set():
        busy = await asyncio.to_thread(owner.busy)
        if busy and not life.yielded:
            life.yielded, life.quiet = True, asyncio.Event()
            life.cut.set()
            activity.state = "yielded"
            status.update(yielded_at=time.time())
            log.info("the owner needs this machine (%s): yielding", owner.describe())
        elif life.yielded and owner.quiet_for() >= owner.quiet_s:
            life.yielded = False
            life.cut.clear()
            activity.state = "idle"
            life.quiet.set()
            log.info("the machine has been quiet for %.0f s: generating again", owner.quiet_s)
        await asyncio.sleep(owner.period_s)  # a sampling period, not a wait for an event
