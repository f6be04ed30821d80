"""The worker's session with the learner: join (and re-join after a learner restart),
heartbeats, the notices the learner pushes, bans and the goodbye.

The session owns who this worker is to the learner (its id, the learner's instance, the run,
the run's key, the learner's view of the config); what a join or a notice means for the rest
of the worker (a snapshot to fetch, a relay to tune, a punch to open) goes out through
``SessionHooks``. Security (docs/security.md): the learner's key is pinned from the join line,
and a handshake that fails for a reason retrying cannot fix ends the worker, saying why.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from echo_rl.broadcast.tickets import Source
from echo_rl.core import wire
from echo_rl.core.client import Client, RequestTimeout
from echo_rl.core.errors import EchoError
from echo_rl.core.retry import Backoff
from echo_rl.core.security import JoinLine
from echo_rl.worker.lifecycle import Lifecycle
from echo_rl.worker.status import StatusBoard
from echo_rl.worker.unreachable import Unreachable

log = logging.getLogger("echo.worker")

MIN_HEARTBEAT_S = 0.1  # the shortest heartbeat period a learner may ask for (docs/scale.md)
JOIN_RETRY_REASONS = {"rate_limited", "learner_full"}
JOIN_BACKOFF_S, JOIN_BACKOFF_MAX_S = 2.0, 30.0  # a busy learner's refusals: first wait, cap


class WorkerError(EchoError, RuntimeError):
    default_reason = "worker"


@dataclass(frozen=True)
class RelayOffer:
    """What the join says of this worker's relay: where peers reach it, and its link."""

    endpoint: str
    down_mbit: float
    up_mbit: float


@dataclass
class SessionHooks:
    """What the session tells the rest of the worker."""

    # (ack, the learner restarted, another run than before): reset, tune, fetch what it names
    joined: Callable[[wire.JoinAck, bool, bool], None]
    # a version to fetch, its manifest's map as it arrived (verified by the Installer)
    offer: Callable[[int, dict[str, Any], Source], None]
    punch: Callable[[wire.Punch], object]  # a peer asks for a punched link
    beat: Callable[[str], wire.Heartbeat]  # this worker's heartbeat, for its current id
    # the learner's need for capacity, from each heartbeat reply (echo_rl/worker/sharing.py)
    need: Callable[[float], None] = lambda need: None


@dataclass(frozen=True)
class JoinTerms:
    """What this worker joins with: its id (the learner may keep an earlier one for its key),
    its price, its relay, and how long a join waits for the learner's answer."""

    worker_id: str
    price: float
    relay: RelayOffer
    join_timeout_s: float


class Session:
    def __init__(
        self,
        client: Client,
        line: JoinLine,
        terms: JoinTerms,
        *,
        status: StatusBoard,
        unreachable: Unreachable,
        life: Lifecycle,
        hooks: SessionHooks,
    ):
        self.client, self.line, self.worker_id, self.price = (
            client,
            line,
            terms.worker_id,
            terms.price,
        )
        self.join_timeout_s, self.relay, self.status = terms.join_timeout_s, terms.relay, status
        self.unreachable, self.life, self.hooks = unreachable, life, hooks
        self.instance_id = ""
        self.busy = Backoff(JOIN_BACKOFF_S, JOIN_BACKOFF_MAX_S)  # refusals in a row
        self.run_id = ""
        self.public_key = b""
        self.view: dict[str, Any] = {}  # the learner's config, as the worker needs it

    @property
    def timeout(self) -> float:
        return float(self.view.get("transport", {}).get("request_timeout_s", self.join_timeout_s))

    def check_handshake(self) -> None:
        """A handshake that failed for a reason retrying cannot fix ends the worker, saying why."""
        if self.client.handshake_error and not self.client.retryable:
            raise WorkerError(self.client.handshake_error)
        if self.client.handshake_error:
            log.warning("%s", self.client.handshake_error)

    async def join(self) -> wire.JoinAck | None:
        """Join (or re-join) the learner; retry until it answers, we are told to stop, or
        --give-up-after passes (saying what to check while it does not answer)."""
        while not self.life.stopping.is_set():
            self.unreachable.trying()
            try:
                ack = await self.life.or_stopped(
                    self.client.request(self._hello(), self.join_timeout_s)
                )
                if ack is None:
                    return None  # told to stop while waiting
            except RequestTimeout:
                self._unanswered()
                continue
            self.unreachable.answered()
            self.status.update(problem=None)
            if isinstance(ack, wire.Error) and ack.reason in JOIN_RETRY_REASONS:
                log.warning("learner busy (%s): %s; retrying", ack.reason, ack.detail)
                await self.life.or_stopped(asyncio.sleep(self.busy.next()))  # cut short by a stop
                continue
            if isinstance(ack, wire.Error) and ack.reason == "banned":
                raise self.banned(ack.detail)  # the status says so, as on any other refusal
            if isinstance(ack, wire.Error):
                raise WorkerError(f"learner refused join: {ack.reason}: {ack.detail}")
            assert isinstance(ack, wire.JoinAck)
            self._accept(ack)
            return ack
        return None

    def _hello(self) -> wire.Join:
        return wire.Join(
            worker_id=self.worker_id,
            price=self.price,
            relay_endpoint=self.relay.endpoint,
            can_relay=bool(self.relay.endpoint),
            down_mbit=self.relay.down_mbit,
            up_mbit=self.relay.up_mbit,
            token=self.line.token,
        )

    def _unanswered(self) -> None:
        self.check_handshake()
        if gave_up := self.unreachable.given_up():
            raise WorkerError(gave_up) from None
        if hint := self.unreachable.silent():
            log.warning("%s", hint)
            self.status.update(problem=hint)
        else:
            log.info("no answer from learner at %s yet; retrying", self.client.endpoint)

    def _accept(self, ack: wire.JoinAck) -> None:
        self.busy.reset()
        restarted = bool(self.instance_id) and ack.instance_id != self.instance_id
        if restarted:
            log.info(
                "learner restarted (instance %s -> %s); re-joined",
                self.instance_id,
                ack.instance_id,
            )
        new_run = ack.run_id != self.run_id
        self.run_id = ack.run_id
        self.instance_id, self.public_key, self.view = ack.instance_id, ack.public_key, ack.config
        if ack.worker_id and ack.worker_id != self.worker_id:
            self.worker_id = ack.worker_id  # this key's session already has an id: keep it
        self.status.update(worker_id=self.worker_id, run_id=ack.run_id)
        self.client.max_bytes = int(self.view["transport"]["max_message_mib"] * 2**20)
        self.hooks.joined(ack, restarted, new_run)
        log.info("worker %s joined run %s (snapshot v%d)", self.worker_id, ack.run_id, ack.version)

    async def heartbeats(self) -> None:
        period = float(self.view["worker"]["heartbeat_s"])
        timeout = float(self.view["transport"]["heartbeat_timeout_s"])
        while not self.life.stopping.is_set():
            await asyncio.sleep(period)  # a period, not a wait for an event
            try:
                ack = await self.client.request(self.hooks.beat(self.worker_id), timeout)
            except RequestTimeout:
                self.check_handshake()
                log.warning("learner silent for %.1fs; will re-join when it is back", timeout)
                continue
            if isinstance(ack, wire.Error) and ack.reason == "banned":
                raise self.banned(ack.detail)
            if not isinstance(ack, wire.HeartbeatAck):
                continue
            self.status.account(ack.account)
            self.hooks.need(ack.need)
            # The period the learner asks for now (docs/scale.md: longer in a large fleet,
            # shorter again as it shrinks, when the learner also expects beats sooner).
            period = max(MIN_HEARTBEAT_S, ack.heartbeat_s) if ack.heartbeat_s else period
            if not ack.known or ack.instance_id != self.instance_id:
                await self.join()
            elif ack.manifest is not None:
                self.hooks.offer(
                    ack.version, ack.manifest, Source(ack.source, ack.source_key, ack.ticket)
                )

    async def notices(self) -> None:
        while True:
            msg = await self.client.notices.get()
            if isinstance(msg, wire.Punch):
                self.hooks.punch(msg)
            elif isinstance(msg, wire.SnapshotNotice):
                self.hooks.offer(
                    msg.version, msg.manifest, Source(msg.source, msg.source_key, msg.ticket)
                )
            elif isinstance(msg, wire.Farewell):  # quarantined: the final books come first
                self.status.account(msg.account)
            elif isinstance(msg, wire.Shutdown):
                self.status.account(msg.account)
                self.life.stop(f"learner shut down: {msg.reason}")

    def banned(self, detail: str) -> WorkerError:
        """The learner refuses this key from now on: the status says so, with its reason. A
        quarantine's final books arrive just before the refusal (a farewell notice), and one
        still queued is applied here, so the status shows the learner's last figures."""
        while not self.client.notices.empty():
            msg = self.client.notices.get_nowait()
            if isinstance(msg, wire.Farewell):
                self.status.account(msg.account)
        account = self.status.doc.account
        if account is None or account.state != "quarantined":  # no farewell: the refusal's words
            told = account or wire.Account(state="quarantined")
            self.status.update(
                account=told.model_copy(
                    update={"state": "quarantined", "message": detail, "message_age_s": 0.0}
                )
            )
        return WorkerError(f"the learner banned this worker's key: {detail}")

    async def leave(self, timeout: float) -> None:
        """Say goodbye; the final account comes back (a learner that does not answer costs
        ``timeout``)."""
        try:
            reply = await self.client.request(wire.Leave(worker_id=self.worker_id), timeout)
        except RequestTimeout:
            return
        if isinstance(reply, wire.Farewell):
            self.status.account(reply.account)
