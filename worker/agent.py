"""The worker: join, keep the newest snapshot installed, generate, score, push, heartbeat.

Delivery is at-least-once: every trajectory batch stays in ``unacked`` until the learner
acknowledges it and is resent otherwise (bounded by ``worker.max_unacked_batches``: when full,
the worker stops generating until acknowledgements come). Nothing waits on a round trip that
it need not: batches are delivered by their own tasks, several at once, while the worker
generates the next groups; when a round trip is over 10% of a rollout the next work request
leaves while the current groups are generated, and grants grow so that a rollout outlasts a
round trip. On a long link a worker that waited for each grant and each acknowledgement would
spend more time waiting than generating (docs/wide_area.md). If the learner restarts (a
heartbeat acknowledgement names a new instance, or says it does not know us) the worker joins again and
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
import json
import logging
import math
import signal
import sys
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from broadcast.fetch import FetchStats
from broadcast.memory import trim
from broadcast.nat.links import Tunnels
from broadcast.nat.reflect import NatError, pick_punch_port, probe_all, punch_port_free
from broadcast.relay import Relay, RelayConfig, RelayPortTaken
from broadcast.snapshot import SnapshotError
from broadcast.tickets import Source
from dataplane.adapter import Adapter, load_adapter
from dataplane.answers import check_answer_tokens
from echo import wire
from echo.config import LoraConfig, ModelConfig
from echo.lora import base_problem
from echo.models import ModelError
from worker.backends import Backend, Sample, make_backend
from worker.base import BaseResult, mismatch, obtain_base, refuse
from worker.snapshots import SnapshotFeed
from worker.status import InstallProgress, StatusBoard
from worker.unreachable import Unreachable
from echo.client import Client, RequestTimeout
from echo.security import JoinLine, KeyPair, fingerprint

log = logging.getLogger("echo.worker")
DEFAULT_SWITCH_S = sys.getswitchinterval()

BOOT_MAX_BYTES = 64 * 2**20  # frame limit before the learner's config arrives
MAX_GRANT_SCALE = 8  # at most this many times worker.groups_per_request in one grant
PREFETCH_SHARE = 0.1  # prefetch work when a grant's round trip exceeds this share of a rollout
# SIGTERM to exit (issue 30): the handback, the pending deliveries and the goodbye share
# STOP_S; the last LEAVE_S of it is kept for the goodbye, so the process is gone within 5 s.
STOP_S = 4.0
LEAVE_S = 1.0
MIN_HEARTBEAT_S = 0.1
MEMORY_EVERY = 5  # status-loop ticks between memory censuses (docs/memory.md)  # the shortest heartbeat period a learner may ask for (docs/scale.md)
# GIL switch intervals (Python's default: 5 ms). While the model's libraries import on another
# thread, this loop (heartbeats, relaying, a stop) gets the GIL back within LOAD_SWITCH_S;
# once stopping during the load, within STOP_SWITCH_S. The default returns after the load.
LOAD_SWITCH_S = 1e-3
STOP_SWITCH_S = 1e-4
# Refusals of a batch that say nothing about the batch itself: keep it and send it again.
RETRY_REASONS = {"not_joined", "rate_limited", "internal_error"}
JOIN_RETRY_REASONS = {"rate_limited", "learner_full"}


_NAT_MEANING = {
    "reachable": ": other workers connect to this one directly",
    "punchable": ": this worker relays through punched links",
    "none": ": the NAT maps each destination apart (symmetric); this worker stays a chain tail",
}


async def in_daemon_thread(fn: Callable[[], Any]) -> Any:
    """``fn()`` on a daemon thread: unlike ``asyncio.to_thread`` nobody waits for it at exit,
    so a stop during a model load of minutes leaves at once (the load dies with the process)."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[Any] = loop.create_future()

    def settle(result: Any, exc: BaseException | None) -> None:
        if not fut.done():
            fut.set_exception(exc) if exc is not None else fut.set_result(result)

    def target() -> None:
        try:
            result, exc = fn(), None
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting task as it is
            result, exc = None, e
        try:
            loop.call_soon_threadsafe(settle, result, exc)
        except RuntimeError:
            pass  # the loop is closed: nobody waits for it any more

    threading.Thread(target=target, name="echo-load", daemon=True).start()
    return await fut


async def _wait_next(event: asyncio.Event, timeout: float) -> None:
    """Until ``event`` is next set, or ``timeout`` seconds."""
    event.clear()
    try:
        await asyncio.wait_for(event.wait(), timeout)
    except TimeoutError:
        pass


def _runs(s: Sample, version: int) -> list[list[int]]:
    """Per-token versions of a sample as ``[version, count]`` runs: the prefix's (another
    worker's tokens, for a continued sample), then this worker's own tokens."""
    runs = [list(r) for r in getattr(s, "prefix_versions", [])]  # episodes have no prefix
    own = len(s.completion_ids) - getattr(s, "prefix_len", 0)
    if own > 0:
        if runs and runs[-1][0] == version:
            runs[-1][1] += own
        else:
            runs.append([version, own])
    return runs


def _versions(s: Sample, version: int) -> dict[str, Any]:
    """The record's ``version`` (its oldest token's: the staleness rule judges that one) and,
    when they differ, the per-token ``versions``."""
    runs = _runs(s, version)
    if len(runs) <= 1:
        return {"version": runs[0][0] if runs else version}
    return {"version": min(v for v, _ in runs), "versions": runs}


def _prefix(g: wire.Group, i: int) -> wire.Prefix | None:
    return next((p for p in g.prefixes if p.sample_idx == i), None)


def _cut_episodes(groups: list[wire.Group], decisions: dict[int, list[Any]]
                  ) -> list[list[tuple[Sample, float]]]:
    """Episodes cut between decisions, as unfinished samples: each one's decisions so far
    (replayed ones first, with the versions they came with), and their lengths."""
    out, k = [], 0
    for g in groups:
        row = []
        for i in range(g.n):
            made = decisions.get(k + i, [])
            old = _prefix(g, i)
            s = Sample([t for ids, _ in made for t in ids], [x for _, lps in made for x in lps],
                       prefix_len=len(old.ids) if old else 0,
                       prefix_versions=[list(r) for r in old.versions] if old else [],
                       finished=False, turns=[len(ids) for ids, _ in made])
            row.append((s, 0.0))
        out.append(row)
        k += g.n
    return out


def _episode_versions(s: Any, prefix: wire.Prefix | None, version: int) -> dict[str, Any]:
    """A multi-turn record's versions: the policy's tokens (mask 1) in order are the
    decisions, replayed ones with the prefix's versions, then this worker's; an environment
    token takes the version of the decision before it (the first one's, before any)."""
    if prefix is None:
        return {"version": version}
    trained = [v for v, c in prefix.versions for _ in range(c)]
    per_token, k = [], 0
    for m in s.loss_mask:
        if m:
            per_token.append(trained[k] if k < len(trained) else version)
            k += 1
        else:
            per_token.append(None)
    first = next((v for v in per_token if v is not None), version)
    runs: list[list[int]] = []
    last = first
    for v in per_token:
        last = last if v is None else v
        if runs and runs[-1][0] == last:
            runs[-1][1] += 1
        else:
            runs.append([last, 1])
    return {"version": min(v for v, _ in runs), "versions": runs} if len(runs) > 1 \
        else {"version": runs[0][0]}


class WorkerError(RuntimeError):
    pass


class Worker:
    def __init__(self, endpoint: str | JoinLine, *, worker_id: str | None = None, price: float = 0.0,
                 threads: int | None = None, join_timeout_s: float = 5.0,
                 ledger: str | None = None, relay: RelayConfig | None = None,
                 keys: KeyPair | None = None, backend: str | None = None,
                 device: str | None = None, status: StatusBoard | None = None,
                 show: Any = None, migrate: bool = True, owner: Any = None,
                 give_up_after_s: float | None = None, clock: Any = time.monotonic,
                 host_memory_gb: float = 0.0):
        """``status``: where the worker's status goes (docs/volunteers.md; default: kept in
        memory only); ``show``: called with it every second (a live view or a plain line).
        ``migrate``: on SIGTERM, cut the samples being generated and hand them back as
        prefixes (docs/preemption.md) instead of finishing the current groups; ``owner``: an
        ``worker.owner`` watch: yield the machine whenever its owner's work appears.
        ``give_up_after_s``: stop when the learner has not answered a join this long (None:
        keep trying; either way, say what to check after 30 s). ``host_memory_gb``: the
        volunteer's memory budget (0: none; echo/memplan.py)."""
        self.host_memory_gb = host_memory_gb
        self.version_bytes = (0, "bfloat16")  # the run's full version: size and dtype, at join
        self.line = endpoint if isinstance(endpoint, JoinLine) else JoinLine(endpoint, None)
        self.endpoint = self.line.endpoint
        # Identity is the key pair; without CURVE (an --insecure learner) the id is all there is.
        self.keys = (keys or KeyPair.generate()) if self.line.server_key is not None else None
        default_id = f"w-{fingerprint(self.keys.public)[:8]}" if self.keys else f"w-{uuid.uuid4().hex[:8]}"
        self.worker_id = worker_id or default_id
        self.price = price
        self.threads = threads
        # The volunteer's own choice of generation backend and device, over the learner's view:
        # the hardware is theirs (echo-worker join --backend vllm --device cuda:1).
        self.backend_name, self.device = backend, device
        self.join_timeout_s = join_timeout_s
        self.unreachable = Unreachable(self.endpoint, give_up_after_s, clock=clock)
        self.ledger = ledger  # JSONL of what the learner acknowledged storing, per batch
        self._batch_keys: dict[str, list[list[Any]]] = {}
        self.view: dict[str, Any] = {}
        self.instance_id = ""
        self.run_id = ""
        self.public_key = b""
        self.backend: Backend | None = None
        self.adapter: Adapter | None = None
        self.installed_version = -1
        self.nat = "unknown"  # the learner's verdict on our NAT (docs/nat.md)
        self.unacked: OrderedDict[str, wire.Trajectories] = OrderedDict()
        self._groups_of: dict[str, list[str]] = {}  # batch id -> its group ids (while unacked)
        self._generating: list[str] = []  # group ids being generated now
        self._delivering: set[str] = set()  # batch ids with a delivery in flight
        self.to_deliver = asyncio.Event()  # a batch needs a delivery started
        self.acked = asyncio.Event()  # a batch left ``unacked``
        self._grant_rtt = 0.0  # EWMA seconds of a work request's round trip
        self._rollout_s = 0.0  # EWMA seconds of generating and scoring one grant
        self._prefetching = False
        self._group_s = 0.0  # EWMA seconds of generating and scoring one group
        self.throughput = 0.0
        self.busy_s = 0.0  # cumulative busy time and output, for an unbiased average rate
        self.busy_samples = 0
        self.delivered = 0
        self.state = "idle"
        self.exit_reason = ""
        self.stopping = asyncio.Event()
        self.new_snapshot = asyncio.Event()
        self.relay_cfg = relay or RelayConfig()
        self.feed: SnapshotFeed | None = None  # made with the relay, in run()
        self.status = status or StatusBoard(self.worker_id, self.endpoint, price, None)
        self.status.update(worker_id=self.worker_id)
        self.show = show
        self.migrate = migrate
        self.owner = owner
        self.cut = threading.Event()  # set: cut the samples being generated now (preemption)
        self.yielded = False  # the machine's owner needs it (docs/preemption.md)
        self.quiet = asyncio.Event()  # set when a yield ends
        self._notice_timer: asyncio.TimerHandle | None = None  # a preemption notice's stop
        self._stop_at: float | None = None  # monotonic time of the stop signal
        self._work_task: asyncio.Task[None] | None = None
        self._side_tasks: set[asyncio.Future[Any]] = set()
        self.progress = InstallProgress()  # the first install's phases, shown to the volunteer
        self.base_manifest: dict[str, Any] | None = None  # a LoRA run's base (worker.base)
        self.base: BaseResult | None = None  # where this worker's base model came from

    # ------------------------------------------------------------------ lifecycle

    async def run(self) -> str:
        sys.setswitchinterval(LOAD_SWITCH_S)  # until the model is loaded (see LOAD_SWITCH_S)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop, f"signal {sig.name}")
        loop.add_signal_handler(signal.SIGUSR1, self._notice)  # echo-worker preempt --in S
        self.ctx = zmq.asyncio.Context()
        self.client = Client(self.ctx, self.endpoint, BOOT_MAX_BYTES, keys=self.keys,
                             server_key=self.line.server_key)
        try:
            self.relay = Relay(self.ctx, self.relay_cfg, keys=self.keys,
                               run_key=lambda: self.public_key)
        except RelayPortTaken as exc:
            self.client.close()
            self.ctx.term()
            raise WorkerError(str(exc)) from None
        host = self.relay_cfg.punch_host or self.relay_cfg.bind_host
        punch = self.relay_cfg.punch_port
        if punch and not punch_port_free(host, punch):
            self.relay.close()
            self.client.close()
            self.ctx.term()
            raise WorkerError(f"punch port {punch} on {host} is in use (a second worker on this "
                              f"machine?): give each worker its own --relay-port and "
                              f"--punch-port, or 0 to let the OS pick (docs/ports.md)")
        self.tunnels = Tunnels(host, punch or pick_punch_port(host), endpoint=self.relay.endpoint)
        self.relay.resolve = self.tunnels.resolve
        self.feed = SnapshotFeed(self.relay, self._ask_source, self._report_install)
        self.feed.on_ready = self._snapshot_ready
        try:
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(self.client.receive_forever()),
                         tg.create_task(self.relay.serve_forever()),
                         tg.create_task(self.tunnels.serve_forever()),
                         tg.create_task(self._status_loop())]
                if await self._join():
                    # Heartbeats start before the (slow) model load so the learner keeps us.
                    tasks += [tg.create_task(self._heartbeats()), tg.create_task(self._notices()),
                              tg.create_task(self._deliveries()), tg.create_task(self.feed.run())]
                    if await self._start_work(tg, tasks):
                        await self._finish_work()
                    await self._drain()
                for t in tasks + list(self._side_tasks):
                    t.cancel()
        finally:
            sys.setswitchinterval(DEFAULT_SWITCH_S)
            self.status.update(activity="stopped", exit=self.exit_reason or "error",
                           **({"tokens_sampled": self.backend.tokens_sampled} if self.backend else {}))
            self.status.flush(force=True)
            self.relay.close()
            self.client.close()
            self.ctx.term()
        return self.exit_reason

    def _snapshot_ready(self) -> None:
        self.progress.received()
        self.new_snapshot.set()

    async def _start_work(self, tg: asyncio.TaskGroup, tasks: list[asyncio.Task[Any]]) -> bool:
        """Load the model (unless told to stop meanwhile), then generate until told to stop."""
        await self._or_stopped(self._obtain_base())
        if self.stopping.is_set():
            return False
        loaded = await self._or_stopped(in_daemon_thread(self._load))
        if loaded is None:
            return False
        self.backend, self.adapter = loaded
        trim()  # the load's transient copies (a bf16 file read into float32) go back
        sys.setswitchinterval(DEFAULT_SWITCH_S)
        self.progress.loaded()
        # The model and its libraries live as long as the process: out of the
        # collector's full passes, which would stall heartbeats and relaying. No collection
        # first: it found ~200 unreachable objects among ~390,000 and held the event loop and
        # the first install for 0.3-1 s.
        gc.freeze()
        self._work_task = tg.create_task(self._work())
        if self.owner is not None:
            tasks.append(tg.create_task(self._watch_owner()))
        await self.stopping.wait()
        return True

    async def _finish_work(self) -> None:
        """Told to stop: cut what is being generated and hand it back (or, with --no-migrate,
        finish the current groups: up to a minute)."""
        work = self._work_task
        if self.state != "generating":
            work.cancel()  # waiting on the learner: nothing to finish
        await asyncio.wait([work], timeout=self._stop_left(LEAVE_S) if self.migrate else 60)
        if not self.migrate:  # the groups it finished get the whole budget to be delivered
            self._stop_at = time.monotonic()

    async def _or_stopped(self, aw: Awaitable[Any]) -> Any:
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

    def _stop_left(self, reserve: float = 0.0) -> float:
        """Seconds left of the stop's budget (STOP_S from the signal), less ``reserve``."""
        if self._stop_at is None:
            return STOP_S - reserve
        return max(0.1, self._stop_at + STOP_S - reserve - time.monotonic())

    def _spawn(self, coro: Awaitable[Any]) -> None:
        """A side job (a NAT probe) that nothing waits for; cancelled at exit."""
        task = asyncio.ensure_future(coro)
        self._side_tasks.add(task)
        task.add_done_callback(self._side_done)

    def _side_done(self, task: asyncio.Future[Any]) -> None:
        self._side_tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:  # said, not left unretrieved
            log.error("%s", task.exception(), exc_info=task.exception())

    async def _status_loop(self) -> None:
        """Once a second: the status view and file follow what the worker does."""
        ticks = 0
        while True:
            if self.status.doc["activity"] != self.state:
                self.status.update(activity=self.state)
            if self.backend is not None and self.status.doc.get("tokens_sampled") != self.backend.tokens_sampled:
                self.status.update(tokens_sampled=self.backend.tokens_sampled)
            if self.installed_version < 0 and self.feed is not None:
                phase = self.progress.phase(self.feed.progress())
                if phase != self.status.doc.get("install_phase"):
                    self.status.update(install_phase=phase)
            ticks += 1
            if ticks % MEMORY_EVERY == 1:
                self.status.update(memory=self._memory())
            if self.show is not None:
                self.show(self.status)
            self.status.flush()
            await asyncio.sleep(1.0)  # a display period, not a wait for an event

    def _memory(self) -> dict[str, int]:
        """Where this worker's memory goes (docs/memory.md): its resident set, the model, and
        the snapshot payloads it holds (relay store, full versions, base model)."""
        from echo.memstat import payload_bytes, resident, tensor_bytes

        model = getattr(self.backend, "model", None)
        stores = [getattr(self.relay, name, None) for name in ("store", "results", "bases")]
        held = payload_bytes(b.payload for st in stores if st is not None for b in st.buffers())
        return {**resident(), "model": tensor_bytes(model.parameters()) if model is not None else 0,
                "payloads_ram": held["ram"], "payloads_spilled": held["spilled"]}

    def _check_handshake(self) -> None:
        """A handshake that failed for a reason retrying cannot fix ends the worker, saying why."""
        if self.client.handshake_error and not self.client.retryable:
            raise WorkerError(self.client.handshake_error)
        if self.client.handshake_error:
            log.warning("%s", self.client.handshake_error)

    def _notice(self) -> None:
        """A preemption notice (``echo-worker preempt --in S``): keep generating until the
        deadline minus a margin for the handback (two round trips, at least 2 s), then stop
        as on SIGTERM. A later notice replaces an earlier one."""
        from worker.status import notice_path

        try:
            path = notice_path(self.status.path) if self.status.path else None
            deadline = float(json.loads(path.read_text())["deadline"]) if path else None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("preemption notice unreadable (%s): stopping now", exc)
            deadline = time.time()
        if deadline is None:
            deadline = time.time()
        margin = max(2.0, 2 * self._grant_rtt)
        delay = max(0.0, deadline - time.time() - margin)
        log.info("preemption notice: the machine goes in %.1f s; handing work back in %.1f s",
                 deadline - time.time(), delay)
        if self._notice_timer is not None:
            self._notice_timer.cancel()
        self._notice_timer = asyncio.get_running_loop().call_later(
            delay, self._stop, "preemption notice")

    def _stop(self, reason: str) -> None:
        if not self.stopping.is_set():
            log.info("worker %s stopping: %s", self.worker_id, reason)
            self.exit_reason = reason
            self._stop_at = time.monotonic()
            if self.backend is None:
                # The model's libraries may still be importing on another thread, which keeps
                # the GIL for the interpreter's switch interval (5 ms) at a time: every blocking
                # call on the way out waited that long to get it back (5 s in all, measured).
                sys.setswitchinterval(STOP_SWITCH_S)
            if self.migrate and reason.startswith(("signal", "preemption")):
                self.cut.set()  # preempted: what is being generated goes back as prefixes
            self.stopping.set()
            self.quiet.set()

    @property
    def _timeout(self) -> float:
        return float(self.view.get("transport", {}).get("request_timeout_s", self.join_timeout_s))

    async def _join(self) -> bool:
        """Join (or re-join) the learner; retry until it answers, we are told to stop, or
        --give-up-after passes (saying what to check while it does not answer)."""
        while not self.stopping.is_set():
            self.unreachable.trying()
            try:
                ack = await self._or_stopped(self.client.request(wire.Join(
                    worker_id=self.worker_id, price=self.price, relay_endpoint=self.relay.endpoint,
                    can_relay=bool(self.relay.endpoint), down_mbit=self.relay_cfg.down_mbit,
                    up_mbit=self.relay_cfg.up_mbit, token=self.line.token), self.join_timeout_s))
                if ack is None:
                    return False  # told to stop while waiting
            except RequestTimeout:
                self._check_handshake()
                if gave_up := self.unreachable.given_up():
                    raise WorkerError(gave_up) from None
                if hint := self.unreachable.silent():
                    log.warning("%s", hint)
                    self.status.update(problem=hint)
                else:
                    log.info("no answer from learner at %s yet; retrying", self.endpoint)
                continue
            self.unreachable.answered()
            self.status.update(problem=None)
            if isinstance(ack, wire.Error) and ack.reason in JOIN_RETRY_REASONS:
                log.warning("learner busy (%s): %s; retrying", ack.reason, ack.detail)
                await self._or_stopped(asyncio.sleep(2.0))  # a back-off, cut short by a stop
                continue
            if isinstance(ack, wire.Error) and ack.reason == "banned":
                raise self._banned(ack.detail)  # the status says so, as on any other refusal
            if isinstance(ack, wire.Error):
                raise WorkerError(f"learner refused join: {ack.reason}: {ack.detail}")
            assert isinstance(ack, wire.JoinAck)
            await self._on_join_ack(ack)
            self.progress.joined()
            if ack.reflectors:  # beside the model load and the first fetch, not before them
                self._spawn(self._probe_nat(ack.reflectors))
            return True
        return False

    async def _on_join_ack(self, ack: wire.JoinAck) -> None:
        restarted = bool(self.instance_id) and ack.instance_id != self.instance_id
        if restarted:
            log.info("learner restarted (instance %s -> %s); re-joined", self.instance_id, ack.instance_id)
        # A learner resumed after a crash (--resume) publishes again from its checkpoint's
        # step: versions from ack.version on may hold other bytes than the crashed instance's.
        republished = restarted and max(self.installed_version, self.feed.newest_held()) >= ack.version
        if ack.run_id != self.run_id or ack.version < self.installed_version or republished:
            # Another run, or one that went back in versions: what we hold is not its policy,
            # and what our relay holds must not be served under that run's version numbers.
            self.installed_version = -1
            self.feed.reset()
        self.run_id = ack.run_id
        self.instance_id, self.public_key, self.view = ack.instance_id, ack.public_key, ack.config
        self.base_manifest = ack.base_manifest
        self.version_bytes = (int(ack.manifest["result_size"]), str(ack.manifest["dtype"])) \
            if ack.manifest is not None else (0, "bfloat16")  # for the memory plan
        self.feed.public_key = ack.public_key
        if ack.worker_id and ack.worker_id != self.worker_id:
            self.worker_id = ack.worker_id  # this key's session already has an id: keep it
        self.status.update(worker_id=self.worker_id, run_id=ack.run_id)
        self.client.max_bytes = int(self.view["transport"]["max_message_mib"] * 2**20)
        bc = self.view["broadcast"]
        self.relay.cfg.window, self.relay.cfg.timeout_s = bc["window"], bc["timeout_s"]
        sec = self.view.get("security", {})
        self.relay.cfg.max_parked_per_peer = sec.get("max_parked_per_peer", 64)
        if self.relay.server is not None:  # the relay's server already exists: tune it
            self.relay.server.max_parked_per_peer = self.relay.cfg.max_parked_per_peer
            self.relay.server.max_parked_total = sec.get("max_parked_total", 4096)
        if ack.manifest is not None:
            self._offer(ack.version, ack.manifest, Source(ack.snapshot_endpoint, ack.snapshot_key, ack.ticket))
        log.info("worker %s joined run %s (snapshot v%d)", self.worker_id, ack.run_id, ack.version)

    def _fit_memory(self, model_name: str, dtype: str, device: str, lora: bool) -> str:
        """worker.dtype, resolved and fitted to --host-memory-gb (echo/memplan.py: over budget
        an ``auto`` dtype becomes bfloat16); says what serving this run needs."""
        from echo.memplan import MemoryBudgetError, WorkerPlan, fit_worker, folder_params
        from echo.models import bf16_compute, resolve_device

        where = resolve_device(device, "worker.device")
        chosen = dtype if dtype != "auto" else ("bfloat16" if bf16_compute(where) else "float32")
        size, payload_dtype = self.version_bytes
        if not size:  # joined before the first version: the run's broadcast dtype
            payload_dtype = self.view.get("broadcast", {}).get("dtype", payload_dtype)
        elem = 4 if payload_dtype == "float32" else 2
        params = folder_params(model_name) if Path(model_name).is_dir() else 0
        params = params or (0 if lora else size // elem)  # a LoRA payload is the adapter only
        size = size or (0 if lora else params * elem)
        plan = WorkerPlan(params, 4 if chosen == "float32" else 2, size,
                          spill=bool(self.relay_cfg.spill_dir), model_on_host=where.type == "cpu")
        try:
            fitted = fit_worker(plan, self.host_memory_gb, dtype_fixed=dtype != "auto")
        except MemoryBudgetError as err:
            raise WorkerError(str(err)) from None
        budget = f" (--host-memory-gb {self.host_memory_gb:g})" if self.host_memory_gb else ""
        log.info("memory: serving this run needs %s%s", fitted.describe(), budget)
        if fitted.dtype_bytes < plan.dtype_bytes:
            log.warning("memory: generating in bfloat16 instead of %s to fit --host-memory-gb %g",
                        chosen, self.host_memory_gb)
            return "bfloat16"
        return chosen

    def _load(self) -> tuple[Backend, Adapter]:
        threads = self.threads or self.view["worker"]["torch_threads"]
        wv = self.view["worker"]
        name = self.backend_name or wv["backend"]
        extra = ({"gpu_memory_utilization": wv.get("vllm_gpu_memory", 0.5)} if name == "vllm"
                 else {"dtype": wv.get("dtype", "auto")})
        lora = LoraConfig(**self.view.get("lora", {}))
        if lora.enabled:  # versions are adapters: the backend holds the base and an adapter
            if name != "transformers":
                raise WorkerError(f"this run trains a LoRA adapter (learner.lora.enabled) and the "
                                  f"{name} backend does not apply adapters yet: join with "
                                  f"--backend transformers")
            extra["lora"] = lora
        model = dict(self.view["model"])
        if self.base is not None and self.base.folder is not None:
            model["name"] = str(self.base.folder)  # the base model from the cache or a fetch
        device = self.device or wv.get("device", "auto")
        if "dtype" in extra:
            extra["dtype"] = self._fit_memory(model["name"], extra["dtype"], device, lora.enabled)
        backend = make_backend(name, model_cfg=ModelConfig(**model), threads=threads,
                               device=device, **extra)
        if self.base is not None and self.base_manifest is not None:
            problem = mismatch(self.base_manifest, backend.base_hash, self.base)
            if problem:
                raise WorkerError(problem)
        adapter = load_adapter(self.view["adapter"]["name"], self.view["adapter"]["options"],
                               backend.tokenizer, check_prompts=False)  # prompts are the learner's
        # the adapter's answer set, from the run's config as the learner builds it
        backend.restrict_answers(check_answer_tokens(adapter.answer_tokens, backend.vocab_size,
                                                     wv["max_new_tokens"],
                                                     backend.tokenizer.eos_token_id))
        return backend, adapter

    async def _obtain_base(self) -> None:
        """A LoRA run on a model folder: the base model from the cache, this machine's
        model.name, or fetched from a peer or the learner (worker.base)."""
        m = self.base_manifest
        if m is None or not self.view.get("lora", {}).get("enabled"):
            return
        try:
            self.base = await obtain_base(m, public_key=self.public_key, run_id=self.run_id,
                                          model_name=self.view["model"]["name"],
                                          relay=self.relay, ask=self._ask_source)
        except (SnapshotError, OSError) as err:  # OSError: the cache's disk
            raise WorkerError(refuse(err)) from None
        log.info("%s", self.base.line(m))
        self.status.update(base_model=m["base_model"], base_origin=self.base.origin,
                           base_fetched_bytes=self.base.fetched_bytes)

    # ------------------------------------------------------------------ control traffic

    async def _heartbeats(self) -> None:
        period = float(self.view["worker"]["heartbeat_s"])
        timeout = float(self.view["transport"]["heartbeat_timeout_s"])
        while not self.stopping.is_set():
            await asyncio.sleep(period)  # a period, not a wait for an event
            hb = wire.Heartbeat(worker_id=self.worker_id, version=self.installed_version,
                                throughput=self.throughput, state=self.state,
                                busy_s=self.busy_s, busy_samples=self.busy_samples,
                                base=self.relay.holds_base)
            try:
                ack = await self.client.request(hb, timeout)
            except RequestTimeout:
                self._check_handshake()
                log.warning("learner silent for %.1fs; will re-join when it is back", timeout)
                continue
            if isinstance(ack, wire.Error) and ack.reason == "banned":
                raise self._banned(ack.detail)
            if not isinstance(ack, wire.HeartbeatAck):
                continue
            self.status.account(ack.account)
            # The period the learner asks for now (docs/scale.md: longer in a large fleet,
            # shorter again as it shrinks, when the learner also expects beats sooner).
            period = max(MIN_HEARTBEAT_S, ack.heartbeat_s) if ack.heartbeat_s else period
            if not ack.known or ack.instance_id != self.instance_id:
                await self._join()
            elif ack.manifest is not None:
                self._offer(ack.version, ack.manifest, Source(ack.source, ack.source_key, ack.ticket))

    async def _probe_nat(self, reflectors: list[str]) -> None:
        """Probe the learner's reflector from the punch port and have the learner classify
        this worker's NAT (docs/nat.md). A failure leaves this worker a tail, nothing worse."""
        port = int(self.relay.endpoint.rpartition(":")[2]) if self.relay.endpoint else 0
        try:
            nonces = await probe_all(reflectors, self.tunnels.host, self.tunnels.port, port)
            status = await self.client.request(wire.NatReport(worker_id=self.worker_id,
                                                              nonces=nonces), self._timeout)
        except (NatError, RequestTimeout) as err:
            log.warning("NAT probe failed (%s): this worker will not relay", err)
            return
        if isinstance(status, wire.NatStatus):
            self.nat = status.nat
            log.info("NAT: %s (punch port seen as %s)%s", status.nat, status.address,
                     _NAT_MEANING.get(status.nat, ""))
        else:
            log.warning("NAT report refused: %s", getattr(status, "detail", status))

    async def _notices(self) -> None:
        while True:
            msg = await self.client.notices.get()
            if isinstance(msg, wire.Punch):
                self.tunnels.open(msg)
            elif isinstance(msg, wire.SnapshotNotice):
                self._offer(msg.version, msg.manifest, Source(msg.source, msg.source_key, msg.ticket))
            elif isinstance(msg, wire.Farewell):  # quarantined: the final books come first
                self.status.account(msg.account)
            elif isinstance(msg, wire.Shutdown):
                self.status.account(msg.account)
                self._stop(f"learner shut down: {msg.reason}")

    def _offer(self, version: int, manifest: dict[str, Any], source: Source) -> None:
        if version > self.installed_version:
            self.feed.offer(version, manifest, source)

    # ------------------------------------------------------------------ snapshots

    async def _ensure_installed(self) -> None:
        """Between rollouts: load the newest version the feed rebuilt into the model."""
        ready = self.feed.take_ready()
        if ready is None or ready[0] <= self.installed_version:
            return
        version, manifest, result = ready
        self._check_base(manifest)  # a WorkerError: out of the try, it ends the worker
        self.state = "installing"
        try:
            assert self.backend is not None
            t0 = time.monotonic()
            await asyncio.to_thread(self.backend.install, manifest["tensors"], result, version)
            self.installed_version = version
            self.status.update(installed_version=version, installed_at=time.time(),
                               install_s=round(time.monotonic() - t0, 3))
            trim()  # the install's transient copies go back to the kernel (docs/memory.md)
            self._first_install()
            log.info("installed snapshot v%d", version)
        except ModelError as err:
            log.warning("snapshot v%d not installed: %s", version, err)
        except (RuntimeError, ValueError) as err:
            # A verified snapshot that still fails to load (a torch error on a tensor the
            # manifest describes): this version is skipped, the worker keeps serving.
            log.exception("snapshot v%d could not be installed: %s", version, err)
        finally:
            self.state = "idle"

    def _check_base(self, manifest: dict[str, Any]) -> None:
        """A LoRA version applies to the base model it names, and to no other: a worker holding
        another base could only generate from a model nobody trained (fatal, with the fix)."""
        assert self.backend is not None
        problem = base_problem(manifest, self.backend.base_hash, self.view["model"]["name"])
        if problem:
            raise WorkerError(problem)

    def _first_install(self) -> None:
        first = self.progress.installed()
        if first is not None:
            self.status.update(first_install=first, install_phase=None)
            self.status.flush(force=True)
            log.info("first install %.1f s after joining (%.1f s after start): model loaded "
                     "after %.1f s, snapshot received after %.1f s", first["since_join_s"],
                     first["since_start_s"], first["model_s"], first["snapshot_s"])

    async def _report_install(self, version: int, stats: FetchStats, decode_s: float,
                              keyframe: bool) -> None:
        """The version is here, verified and rebuilt, with what this worker measured: the
        learner times the broadcast and plans on measured rates (broadcast.link_meter)."""
        await self.client.send(wire.Installed(worker_id=self.worker_id, version=version,
                                              decode_s=decode_s, keyframe=keyframe,
                                              **self.relay.measured(version, stats)))

    async def _ask_source(self, version: int, bad_source: str, reason: str, chunk: int,
                          form: str) -> Source:
        """A snapshot source failed (or this worker needs a keyframe): ask the learner."""
        try:
            grant = await self.client.request(wire.SourceRequest(
                worker_id=self.worker_id, version=version, bad_source=bad_source,
                reason=reason, chunk=chunk, form=form), self._timeout)
        except RequestTimeout:
            raise SnapshotError("learner did not answer a source request") from None
        if not isinstance(grant, wire.SourceGrant):
            raise SnapshotError(f"source request refused: {grant}")
        return Source(grant.source, grant.source_key, grant.ticket)

    # ------------------------------------------------------------------ rollouts

    async def _work(self) -> None:
        async with asyncio.TaskGroup() as tg:
            prefetch: asyncio.Task[list[wire.Group]] | None = None
            while not self.stopping.is_set():
                if self.yielded:  # the owner's turn: no leases, no generation
                    await self.quiet.wait()
                    continue
                await self._ensure_installed()
                if self.installed_version < 0:
                    await self._wait_snapshot(1.0)
                    continue
                if len(self.unacked) >= self.view["worker"]["max_unacked_batches"]:
                    await self._wait_acked(0.5)  # back-pressure: deliver before generating more
                    continue
                t0 = time.monotonic()
                groups = await (prefetch or self._request_work())
                prefetch = None
                if groups:
                    if self._prefetch_pays():  # the next grant's round trip overlaps this rollout
                        prefetch = tg.create_task(self._request_work())
                    if await self._rollout(groups):
                        # Busy-time throughput: one wait-for-grant, generate, score cycle. It
                        # measures what this worker can do, not how much work it was given
                        # (idle waits and snapshot installs are outside the cycle).
                        self._measure(sum(g.n for g in groups), time.monotonic() - t0)
            if prefetch is not None:
                prefetch.cancel()  # its groups come back to the learner with our leave

    def _prefetch_pays(self) -> bool:
        """Ask for the next groups before these are done only when a grant's round trip is a
        noticeable share (over 10%) of a rollout, i.e. on a long link or with a fast model.
        On a LAN it would only lease groups earlier and hold them longer, for no gain."""
        pays = self._grant_rtt > PREFETCH_SHARE * self._rollout_s
        if pays != self._prefetching:
            self._prefetching = pays
            log.info("%s work: a grant's round trip is %.1f ms, a rollout %.1f ms",
                     "prefetching" if pays else "no longer prefetching", 1000 * self._grant_rtt,
                     1000 * self._rollout_s)
        return pays

    def _grant_size(self) -> int:
        """``worker.groups_per_request``, times as many as it takes for one rollout to last a
        grant's round trip (at most 8 times): with a prefetched grant arriving while the
        current one is generated, the worker then never waits on the link."""
        base = int(self.view["worker"]["groups_per_request"])
        if self._group_s <= 0:
            return base
        return base * max(1, min(MAX_GRANT_SCALE, math.ceil(self._grant_rtt / (base * self._group_s))))

    async def _wait_acked(self, timeout: float) -> None:
        await _wait_next(self.acked, timeout)

    async def _wait_snapshot(self, timeout: float) -> None:
        await _wait_next(self.new_snapshot, timeout)

    async def _request_work(self) -> list[wire.Group]:
        holding = self._generating + [g for batch_id in self.unacked for g in self._groups_of.get(batch_id, ())]
        req = wire.WorkRequest(worker_id=self.worker_id, max_groups=self._grant_size(), holding=holding)
        try:
            sent = time.monotonic()
            grant = await self.client.request(req, self._timeout)
            self._grant_rtt = 0.8 * self._grant_rtt + 0.2 * (time.monotonic() - sent)
        except RequestTimeout:
            return []
        if isinstance(grant, wire.Error) and grant.reason == "banned":
            raise self._banned(grant.detail)
        if isinstance(grant, wire.Error):
            log.info("work request refused (%s); re-joining", grant.reason)
            await self._join()
            return []
        assert isinstance(grant, wire.WorkGrant)
        if not grant.groups:
            await self._wait_snapshot(grant.retry_after_s)
        return grant.groups

    async def _rollout(self, groups: list[wire.Group]) -> bool:
        """Generate, score and queue the groups for delivery; False if they were handed back."""
        version = self.installed_version
        self.state = "generating"
        self._generating = [g.group_id for g in groups]
        t0 = time.monotonic()
        try:
            samples = await asyncio.to_thread(self._generate_and_score, groups)
        finally:
            self._generating = []
        gen_s = time.monotonic() - t0
        self.state = "yielded" if self.yielded else "idle"
        if self.yielded and "yielded_at" in self.status.doc:  # how long the cut took
            self.status.update(yield_stop_s=round(time.time() - self.status.doc["yielded_at"], 3))
        if any(not getattr(s, "finished", True) for g in samples for s, _ in g):
            await self._hand_back(groups, samples, version)  # cut short: another worker goes on
            return False
        self._rollout_s = 0.8 * self._rollout_s + 0.2 * gen_s if self._rollout_s else gen_s
        per_group = gen_s / len(groups)
        self._group_s = 0.8 * self._group_s + 0.2 * per_group if self._group_s else per_group
        records = [
            {"group_id": g.group_id, "sample_idx": i, "prompt_ids": g.prompt_ids,
             "completion_ids": s.completion_ids, "logprobs": s.logprobs, "reward": r,
             "worker_id": self.worker_id, "gen_s": gen_s,
             **(_episode_versions(s, _prefix(g, i), version) if getattr(s, "loss_mask", None)
                else _versions(s, version)),
             **({"loss_mask": s.loss_mask} if getattr(s, "loss_mask", None) is not None else {})}
            for g, group_samples in zip(groups, samples)
            for i, (s, r) in enumerate(group_samples)
        ]
        batch = wire.Trajectories(worker_id=self.worker_id, batch_id=uuid.uuid4().hex,
                                  count=len(records), payload=wire.pack_records(records))
        self.unacked[batch.batch_id] = batch
        self._groups_of[batch.batch_id] = [g.group_id for g in groups]
        self.status.generated(len(groups), len(records))
        self._sent(sum(len(s.completion_ids) - getattr(s, "prefix_len", 0)
                       for g in samples for s, _ in g))
        if self.ledger:
            self._batch_keys[batch.batch_id] = [[r["group_id"], r["sample_idx"]] for r in records]
        self.to_deliver.set()
        return True

    def _sent(self, tokens: int) -> None:
        """Own sampled tokens that left in a batch or a handback (the drill's accounting:
        sampled minus sent is what this worker threw away); written at once, since a
        preempted worker may be killed before the next periodic write."""
        if self.backend is not None:
            self.status.update(tokens_sent=int(self.status.doc.get("tokens_sent", 0)) + tokens,
                               tokens_sampled=self.backend.tokens_sampled)
            self.status.flush(force=True)

    async def _hand_back(self, groups: list[wire.Group], samples: Any, version: int) -> None:
        """Give the groups back with what was generated of each sample (docs/preemption.md).
        Whole groups only: finished samples go back as prefixes too, so the worker that
        continues the group delivers all of it (a group is delivered whole, by one worker)."""
        prefixes: dict[str, list[wire.Prefix]] = {}
        for g, group_samples in zip(groups, samples):
            prefixes[g.group_id] = [
                wire.Prefix(sample_idx=i, ids=s.completion_ids, logprobs=s.logprobs,
                            versions=_runs(s, version), turns=list(getattr(s, "turns", [])))
                for i, (s, _) in enumerate(group_samples) if s.completion_ids]
        msg = wire.Handback(worker_id=self.worker_id,
                            reason="yielded" if self.yielded else "preempted",
                            groups=[g.group_id for g in groups], prefixes=prefixes)
        self._sent(sum(len(s.completion_ids) - getattr(s, "prefix_len", 0)
                       for g in samples for s, _ in g))
        kept = sum(len(p) for p in prefixes.values())
        tokens = sum(len(p.ids) for ps in prefixes.values() for p in ps)
        try:
            ack = await self.client.request(msg, min(2.0, self._timeout))
        except RequestTimeout:
            log.warning("handback of %d groups unanswered: their leases expire instead", len(groups))
            return
        if isinstance(ack, wire.HandbackAck):
            log.info("handed back %d groups, %d of %d prefixes (%d tokens) kept%s", ack.groups,
                     ack.prefixes, kept, tokens, f"; refused {ack.refused}" if ack.refused else "")
            self.status.update(handed_back_tokens=int(self.status.doc.get("handed_back_tokens", 0))
                               + tokens)

    def _generate_and_score(self, groups: list[wire.Group]) -> list[list[tuple[Sample, float]]]:
        """Samples and rewards per group. Cut short (preempted, yielded): unfinished samples;
        a multi-turn rollout is cut between two decisions, and its episodes' decisions so far
        become the prefixes, replayed in the environment by the worker that continues."""
        assert self.backend is not None and self.adapter is not None
        wv = self.view["worker"]
        if getattr(self.adapter, "multi_turn", False):
            # Episodes: one generation per decision, played by the adapter's environment.
            from dataplane.episodes import Cut, backend_generate_fn
            gen = backend_generate_fn(self.backend, wv["max_new_tokens"], wv["temperature"],
                                      groups[0].seed, stop=self.cut)
            try:
                out = self.adapter.rollout(groups, gen)
            except Cut as cut:
                return _cut_episodes(groups, cut.decisions)
            return [[(s, float(s.reward)) for s in samples] for samples in out]
        out = self.backend.generate(groups, wv["max_new_tokens"], wv["temperature"], stop=self.cut)
        tok = self.backend.tokenizer
        if any(not s.finished for g in out for s in g):
            return [[(s, 0.0) for s in g] for g in out]  # handed back: the continuer scores
        return [[(s, float(self.adapter.reward(g.task, s.completion_ids,
                                               tok.decode(s.completion_ids, skip_special_tokens=True))))
                 for s in samples] for g, samples in zip(groups, out)]

    async def _deliveries(self) -> None:
        """Keeps one delivery in flight for every unacknowledged batch (at most
        ``worker.max_unacked_batches``), starting a new attempt as soon as one fails."""
        async with asyncio.TaskGroup() as tg:
            while True:
                self.to_deliver.clear()
                for batch_id, batch in list(self.unacked.items()):
                    if batch_id not in self._delivering:
                        self._delivering.add(batch_id)
                        tg.create_task(self._deliver(batch))
                await self.to_deliver.wait()

    async def _deliver(self, batch: wire.Trajectories) -> None:
        try:
            reply = await self._attempt(batch)
        finally:
            self._delivering.discard(batch.batch_id)
            self.to_deliver.set()  # a failed attempt is retried at once (queued till reconnect)
        if reply is None or self.unacked.pop(batch.batch_id, None) is None:
            return  # not delivered yet, or an earlier copy's acknowledgement came first
        self._groups_of.pop(batch.batch_id, None)
        self.acked.set()
        if isinstance(reply, wire.Error):
            # The learner judged the batch itself bad: resending the same bytes cannot help.
            log.error("learner rejected batch %s: %s: %s", batch.batch_id, reply.reason, reply.detail)
            return
        assert isinstance(reply, wire.Ack)
        if reply.rejected:
            words = "; ".join(f"{r}: {wire.REFUSAL_WORDS[r]}" for r in reply.rejected
                              if r in wire.REFUSAL_WORDS)
            log.warning("batch %s: learner rejected records %s%s", batch.batch_id, reply.rejected,
                        f" ({words})" if words else "")
        self._record_ack(batch.batch_id, reply)
        self.delivered += batch.count

    async def _attempt(self, batch: wire.Trajectories) -> wire.Message | None:
        """One delivery; None when the batch must be sent again (no reply, or a refusal that
        says nothing about the batch: not joined yet after a learner restart, sent too fast)."""
        try:
            reply = await self.client.request(batch, self._timeout)
        except RequestTimeout as err:  # ConnectionLost included: the reply, if any, is gone
            log.info("batch %s not acknowledged yet (%s); will resend", batch.batch_id, err)
            return None
        if isinstance(reply, wire.Error) and reply.reason == "banned":
            raise self._banned(reply.detail)
        if isinstance(reply, wire.Error) and reply.reason in RETRY_REASONS:
            log.info("batch %s not taken yet (%s); will resend", batch.batch_id, reply.reason)
            await asyncio.sleep(0.5)  # back-off before the retry, not a wait for an event
            return None
        return reply

    def _record_ack(self, batch_id: str, ack: wire.Ack) -> None:
        keys = self._batch_keys.pop(batch_id, None)
        if not self.ledger or keys is None:
            return
        bad = set(ack.rejected_idx)
        stored = [k for i, k in enumerate(keys) if i not in bad]
        with open(self.ledger, "a") as f:
            f.write(json.dumps({"batch_id": batch_id, "stored": stored,
                                "rejected": ack.rejected}) + "\n")

    async def _drain(self) -> None:
        if self.exit_reason.startswith("learner shut down"):
            return  # the run is over: nobody left to deliver to or say goodbye to
        try:  # bounded: a learner that is going away too must not hold us hostage
            async with asyncio.timeout(self._stop_left(LEAVE_S)):
                while self.unacked:  # the deliveries task keeps retrying meanwhile
                    self.acked.clear()
                    await self.acked.wait()
        except TimeoutError:
            pass
        if self.unacked:
            log.warning("leaving with %d unacknowledged batch(es)", len(self.unacked))
        try:  # the final account comes back; a learner that does not answer costs LEAVE_S
            reply = await self.client.request(wire.Leave(worker_id=self.worker_id),
                                              min(self._stop_left(), self._timeout))
        except RequestTimeout:
            return
        if isinstance(reply, wire.Farewell):
            self.status.account(reply.account)

    def _banned(self, detail: str) -> WorkerError:
        """The learner refuses this key from now on: the status says so, with its reason. A
        quarantine's final books arrive just before the refusal (a farewell notice), and one
        still queued is applied here, so the status shows the learner's last figures."""
        while not self.client.notices.empty():
            msg = self.client.notices.get_nowait()
            if isinstance(msg, wire.Farewell):
                self.status.account(msg.account)
        account = dict(self.status.doc.get("account") or {})
        if account.get("state") != "quarantined":  # no farewell: the refusal's words
            self.status.update(account={**account, "state": "quarantined", "message": detail,
                                        "message_age_s": 0.0})
        return WorkerError(f"the learner banned this worker's key: {detail}")

    async def _watch_owner(self) -> None:
        """Owner first (docs/preemption.md): when the owner's work appears, cut what is being
        generated within a token, hand it back and take no work until the machine has been
        quiet for ``owner.quiet_s``."""
        assert self.owner is not None
        while not self.stopping.is_set():
            busy = await asyncio.to_thread(self.owner.busy)
            if busy and not self.yielded:
                self.yielded, self.quiet = True, asyncio.Event()
                self.cut.set()
                self.state = "yielded"
                self.status.update(yielded_at=time.time())
                log.info("the owner needs this machine (%s): yielding", self.owner.describe())
            elif self.yielded and self.owner.quiet_for() >= self.owner.quiet_s:
                self.yielded = False
                self.cut.clear()
                self.state = "idle"
                self.quiet.set()
                log.info("the machine has been quiet for %.0f s: generating again", self.owner.quiet_s)
            await asyncio.sleep(self.owner.period_s)  # a sampling period, not a wait for an event

    def _measure(self, count: int, seconds: float) -> None:
        self.busy_s += seconds
        self.busy_samples += count
        rate = count / max(seconds, 1e-3)
        self.throughput = rate if self.throughput == 0 else 0.3 * rate + 0.7 * self.throughput
