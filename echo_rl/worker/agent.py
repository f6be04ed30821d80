"""The worker: join, keep the newest snapshot installed, generate, score, push, heartbeat.

``Worker`` wires a few parts, each with its own state and a small interface, and runs them
under one asyncio TaskGroup:

  * ``Session`` (echo_rl/worker/session.py): join and re-join, heartbeats, the learner's notices, bans;
  * ``RelayNode`` (echo_rl/worker/relaying.py): the relay serving snapshot chunks to peers, its punched
    links, the NAT probe;
  * ``Installer`` (echo_rl/worker/install.py): the snapshot feed, the model it installs into, a LoRA
    run's base;
  * ``Generation`` (echo_rl/worker/generation.py): pull work, generate, score, hand cut samples back;
  * ``Deliveries`` (echo_rl/worker/delivery.py): every batch delivered at least once, several in flight;
  * ``Lifecycle`` (echo_rl/worker/lifecycle.py): the stop, its budget, preemption notices, the owner.

Delivery is at-least-once (bounded by ``worker.max_unacked_batches``: when full, the worker
stops generating until acknowledgements come). If the learner restarts (a heartbeat
acknowledgement names a new instance, or says it does not know us) the worker joins again and
carries on with its unacknowledged batches.

Security (docs/security.md): the worker's identity is its CURVE key pair (``--identity``); it
pins the learner's key from the join line, and tells the user in words when the handshake fails
(wrong learner key, key refused, plaintext learner) instead of retrying silently. Its relay
serves only children holding a pull ticket for it. SIGTERM or SIGINT: finish the current group, try
to deliver what is pending, say ``leave``, exit 0.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import zmq.asyncio

from echo_rl.broadcast.memory import trim
from echo_rl.broadcast.relay import RelayConfig
from echo_rl.core import wire
from echo_rl.core.client import Client
from echo_rl.core.security import JoinLine, KeyPair, fingerprint
from echo_rl.worker.delivery import Deliveries
from echo_rl.worker.generation import Generation
from echo_rl.worker.install import Installer
from echo_rl.worker.lifecycle import (
    LEAVE_S,
    Activity,
    Lifecycle,
    Owner,
    in_daemon_thread,
    watch_owner,
)
from echo_rl.worker.model import LoadChoice
from echo_rl.worker.relaying import RelayNode
from echo_rl.worker.session import JoinTerms, Session, SessionHooks, WorkerError
from echo_rl.worker.sharing import DeviceSeat, Turns
from echo_rl.worker.status import InstallProgress, StatusBoard, exit_text
from echo_rl.worker.unreachable import Unreachable

if TYPE_CHECKING:
    from echo_rl.core.memplan import HostBudget

__all__ = ["SharedRun", "StatusOut", "Worker", "WorkerError", "WorkerSettings"]

log = logging.getLogger("echo.worker")
DEFAULT_SWITCH_S = sys.getswitchinterval()

BOOT_MAX_BYTES = 64 * 2**20  # frame limit before the learner's config arrives
MEMORY_EVERY = 5  # status-loop ticks between memory censuses (docs/memory.md)
# GIL switch interval (Python's default: 5 ms). While the model's libraries import on another
# thread, this loop (heartbeats, relaying, a stop) gets the GIL back within LOAD_SWITCH_S
# (echo_rl.worker.lifecycle.STOP_SWITCH_S once stopping). The default returns after the load.
LOAD_SWITCH_S = 1e-3


@dataclass(frozen=True)
class WorkerSettings:
    """The volunteer's choices (echo-worker join's flags, docs/volunteers.md). ``migrate``: on
    SIGTERM, cut the samples being generated and hand them back as prefixes
    (docs/preemption.md) instead of finishing the current groups. ``give_up_after_s``: stop
    when the learner has not answered a join this long (None: keep trying; either way, say
    what to check after 30 s). ``threads``, ``backend``, ``device``, ``host_memory_gb``: the
    model's load (echo_rl/worker/model.py ``LoadChoice``; memory budget 0: none)."""

    worker_id: str | None = None  # None: from the key (w-<fingerprint>)
    price: float = 0.0
    join_timeout_s: float = 5.0
    ledger: str | None = None
    migrate: bool = True
    give_up_after_s: float | None = None
    threads: int | None = None
    backend: str | None = None
    device: str | None = None
    host_memory_gb: float = 0.0


@dataclass(frozen=True)
class StatusOut:
    """Where the worker's status goes (docs/volunteers.md): the board (and its file), and the
    view called with it every second (a live view or a plain line; None: none)."""

    board: StatusBoard
    show: Callable[[StatusBoard], None] | None = None


@dataclass(frozen=True)
class SharedRun:
    """This worker as one of several runs in one process (echo_rl/worker/multirun.py): its
    seat at the device's arbiter (echo_rl/worker/sharing.py), and the memory budget the
    process's runs share (echo_rl/core/memplan.py). Their owner then takes the signals."""

    seat: DeviceSeat
    host_budget: HostBudget | None = None


class Worker:
    # Builds the generation part (called with Generation's arguments): a drill's worker that
    # lies or cherry-picks (benchmarks/) brings its own subclass.
    make_generation: Callable[..., Generation] = Generation

    def __init__(
        self,
        endpoint: str | JoinLine,
        settings: WorkerSettings = WorkerSettings(),
        *,
        relay: RelayConfig | None = None,
        keys: KeyPair | None = None,
        owner: Owner | None = None,
        status: StatusOut | None = None,
        shared: SharedRun | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        """``status``: where the worker's status goes (default: kept in memory only).
        ``owner``: an ``echo_rl.worker.owner`` watch: yield the machine whenever its owner's
        work appears. ``shared``: this run's place beside others in the process (None: alone).
        ``clock``: what ``settings.give_up_after_s`` is counted on."""
        self.line = endpoint if isinstance(endpoint, JoinLine) else JoinLine(endpoint, None)
        self.endpoint = self.line.endpoint
        # Identity is the key pair; without CURVE (an --insecure learner) the id is all there is.
        self.keys = (keys or KeyPair.generate()) if self.line.server_key is not None else None
        default_id = (
            f"w-{fingerprint(self.keys.public)[:8]}" if self.keys else f"w-{uuid.uuid4().hex[:8]}"
        )
        self.settings = settings
        self.worker_id = settings.worker_id or default_id
        self.relay_cfg = relay or RelayConfig()
        # Alone, the worker keeps Turns of its own: the same device-time books (idle fraction)
        # whether it serves one run or several.
        self.shared = shared is not None
        self.turns = shared.seat.turns if shared is not None else Turns()
        self.run_name = (shared.seat.name if shared is not None else "") or "run"
        if not self.shared:
            self.turns.add(self.run_name)
        self.choice = LoadChoice(
            settings.threads,
            settings.backend,
            settings.device,
            settings.host_memory_gb,
            spill=bool(self.relay_cfg.spill_dir),
            shared=shared.host_budget if shared is not None else None,
            run=self.run_name if shared is not None else "",
        )
        self.unreachable = Unreachable(self.endpoint, settings.give_up_after_s, clock=clock)
        self.status = (
            status.board
            if status is not None
            else StatusBoard(self.worker_id, self.endpoint, settings.price, None)
        )
        self.status.update(worker_id=self.worker_id)
        self.show = status.show if status is not None else None
        self.owner = owner
        self.activity = Activity()
        # Who this worker is to the learner now: the status board holds the id a join
        # settled (a key's session may keep an earlier id; Session._accept writes it there).
        self.life = Lifecycle(lambda: self.status.doc.worker_id or self.worker_id, settings.migrate)
        self.progress = InstallProgress()  # the first install's phases, shown to the volunteer
        self._side_tasks: set[asyncio.Future[None]] = set()
        # The parts, built by _assemble once run() has the sockets they talk through.
        self.client: Client
        self.node: RelayNode
        self.session: Session
        self.installer: Installer
        self.deliveries: Deliveries
        self.generation: Generation
        self._work_task: asyncio.Task[None] | None = None  # generation, once the model is loaded

    # ------------------------------------------------------------------ wiring

    def _assemble(self, client: Client, node: RelayNode) -> None:
        """The parts, each given what it needs and nothing more."""
        self.client, self.node = client, node
        hooks = SessionHooks(
            joined=self._joined,
            offer=lambda *a: self.installer.offer(*a),
            punch=node.tunnels.open,
            beat=self._beat,
            need=lambda need: self.turns.set_need(self.run_name, need),
        )
        self.session = Session(
            client,
            self.line,
            JoinTerms(
                self.worker_id, self.settings.price, node.offer(), self.settings.join_timeout_s
            ),
            status=self.status,
            unreachable=self.unreachable,
            life=self.life,
            hooks=hooks,
        )
        seat = DeviceSeat(self.turns, self.run_name)
        self.installer = Installer(
            self.session,
            node.relay,
            status=self.status,
            activity=self.activity,
            progress=self.progress,
            choice=self.choice,
            seat=seat,
        )
        self.deliveries = Deliveries(
            client, lambda: self.session.timeout, self.session.banned, self.settings.ledger
        )
        self.generation = self.make_generation(
            self.session,
            self.installer,
            self.deliveries,
            life=self.life,
            activity=self.activity,
            status=self.status,
            seat=seat,
        )

    def _joined(self, ack: wire.JoinAck, restarted: bool, new_run: bool) -> None:
        self.installer.joined(ack, restarted, new_run)
        self.node.tune(ack.config)
        self.progress.joined()
        if ack.reflectors:  # beside the model load and the first fetch, not before them
            self._spawn(
                self.node.probe_nat(
                    self.client, self.session.worker_id, ack.reflectors, self.session.timeout
                )
            )

    def _beat(self, worker_id: str) -> wire.Heartbeat:
        g = self.generation
        return wire.Heartbeat(
            worker_id=worker_id,
            version=self.installer.held.version,
            throughput=g.throughput,
            state=self.activity.state,
            busy_s=g.busy_s,
            busy_samples=g.busy_samples,
            base=self.node.relay.holds_base,
            runs=len(self.turns.runs),
            resident=self.turns.on_device(self.run_name),
        )

    # ------------------------------------------------------------------ lifecycle

    async def run(self) -> str:
        sys.setswitchinterval(LOAD_SWITCH_S)  # until the model is loaded (see LOAD_SWITCH_S)
        ctx = zmq.asyncio.Context()
        client = Client(
            ctx, self.endpoint, BOOT_MAX_BYTES, keys=self.keys, server_key=self.line.server_key
        )
        try:
            node = RelayNode(
                ctx, self.relay_cfg, keys=self.keys, run_key=lambda: self.session.public_key
            )
        except WorkerError:
            client.close()
            ctx.term()
            raise
        self._assemble(client, node)
        if not self.shared:  # else the runs' owner (echo_rl/worker/multirun.py) takes the signals
            self.take_signals()
        failure = "error"
        try:
            await self._run_parts()
        except (Exception, BaseExceptionGroup) as exc:
            failure = exit_text(exc)  # written once: a reader never sees a bare "error" first
            raise
        finally:
            if self.shared:
                self.turns.forget(self.run_name)
            sys.setswitchinterval(DEFAULT_SWITCH_S)
            _final_status(self.status, self.installer, self.life.exit_reason or failure)
            node.close()
            client.close()
            ctx.term()
        return self.life.exit_reason

    def take_signals(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.life.stop, f"signal {sig.name}")
        loop.add_signal_handler(
            signal.SIGUSR1,
            lambda: self.life.notice(  # echo-worker preempt
                self.status.path, self.generation.grant_rtt
            ),
        )

    async def _run_parts(self) -> None:
        async with asyncio.TaskGroup() as tg:
            tasks = [
                tg.create_task(self.client.receive_forever()),
                tg.create_task(self.node.relay.serve_forever()),
                tg.create_task(self.node.tunnels.serve_forever()),
                tg.create_task(self._status_loop()),
            ]
            if await self.session.join():
                # Heartbeats start before the (slow) model load so the learner keeps us.
                tasks += [
                    tg.create_task(self.session.heartbeats()),
                    tg.create_task(self.session.notices()),
                    tg.create_task(self.deliveries.run()),
                    tg.create_task(self.installer.feed.run()),
                ]
                if await self._start_work(tg, tasks):
                    await self._finish_work()
                await self._drain()
            for t in tasks + list(self._side_tasks):
                t.cancel()

    async def _start_work(self, tg: asyncio.TaskGroup, tasks: list[asyncio.Task[None]]) -> bool:
        """Load the model (unless told to stop meanwhile), then generate until told to stop."""
        await self.life.or_stopped(self.installer.obtain_base())
        if self.life.stopping.is_set():
            return False
        # The model lands on the device: loaded within a turn, so another run's model makes
        # room first (at most --resident on it; echo_rl/worker/sharing.py).
        async with self.turns.turn(self.run_name):
            await self.turns.bring_on(self.run_name)
            loaded = await self.life.or_stopped(in_daemon_thread(self.installer.load))
        if loaded is None:
            return False
        self.installer.held.backend, self.installer.held.adapter = loaded
        self.life.loaded = True
        trim()  # the load's transient copies (a bf16 file read into float32) go back
        sys.setswitchinterval(DEFAULT_SWITCH_S)
        self.progress.loaded()
        # The model and its libraries live as long as the process: out of the
        # collector's full passes, which would stall heartbeats and relaying. No collection
        # first: it found ~200 unreachable objects among ~390,000 and held the event loop and
        # the first install for 0.3-1 s.
        gc.freeze()
        self._work_task = tg.create_task(self.generation.run())
        if self.owner is not None:
            tasks.append(
                tg.create_task(watch_owner(self.owner, self.life, self.activity, self.status))
            )
        await self.life.stopping.wait()
        return True

    async def _finish_work(self) -> None:
        """Told to stop: cut what is being generated and hand it back (or, with --no-migrate,
        finish the current groups: up to a minute)."""
        work = self._work_task
        assert work is not None  # _start_work started it before saying so
        if self.activity.state != "generating":
            work.cancel()  # waiting on the learner: nothing to finish
        await asyncio.wait([work], timeout=self.life.left(LEAVE_S) if self.life.migrate else 60)
        if not self.life.migrate:  # the groups it finished get the whole budget to be delivered
            self.life.stop_at = time.monotonic()

    async def _drain(self) -> None:
        if self.life.exit_reason.startswith("learner shut down"):
            return  # the run is over: nobody left to deliver to or say goodbye to
        await self.deliveries.drain(self.life.left(LEAVE_S))
        await self.session.leave(min(self.life.left(), self.session.timeout))

    def _spawn(self, coro: Awaitable[None]) -> None:
        """A side job (a NAT probe) that nothing waits for; cancelled at exit."""
        task = asyncio.ensure_future(coro)
        self._side_tasks.add(task)
        task.add_done_callback(self._side_done)

    def _side_done(self, task: asyncio.Future[None]) -> None:
        self._side_tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:  # said, not left unretrieved
            log.error("%s", task.exception(), exc_info=task.exception())

    async def _status_loop(self) -> None:
        """Once a second: the status view and file follow what the worker does."""
        ticks = 0
        while True:
            self._look(ticks)
            ticks += 1
            if self.show is not None:
                self.show(self.status)
            self.status.flush()
            await asyncio.sleep(1.0)  # a display period, not a wait for an event

    def _look(self, ticks: int) -> None:
        """The status's fields that follow the parts: activity, tokens, install, memory."""
        doc, held = self.status.doc, self.installer.held
        if doc.activity != self.activity.state:
            self.status.update(activity=self.activity.state)
        if held.backend is not None and doc.tokens_sampled != held.backend.tokens_sampled:
            self.status.update(tokens_sampled=held.backend.tokens_sampled)
        if held.version < 0:
            phase = self.progress.phase(self.installer.feed.progress())
            if phase != doc.install_phase:
                self.status.update(install_phase=phase)
        if self.run_name in self.turns.runs:
            self.status.update(sharing=self.turns.sharing(self.run_name))
        if ticks % MEMORY_EVERY == 0:
            self.status.update(memory=self.node.memory(getattr(held.backend, "model", None)))


def _final_status(status: StatusBoard, installer: Installer, why: str) -> None:
    backend = installer.held.backend
    tokens = {"tokens_sampled": backend.tokens_sampled} if backend else {}
    status.update(activity="stopped", exit=why, **tokens)
    status.flush(force=True)
