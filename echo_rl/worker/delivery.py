"""Delivery of trajectory batches: at least once, several in flight, none waiting on another.

Every batch stays in ``unacked`` until the learner acknowledges it and is resent otherwise;
generation stops while ``worker.max_unacked_batches`` are unacknowledged (back-pressure).
Batches are delivered by their own tasks, several at once, while the worker generates the next
groups: on a long link a worker that waited for each acknowledgement would spend more time
waiting than generating (docs/wide_area.md).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol

from echo_rl.core import wire
from echo_rl.core.client import RequestTimeout
from echo_rl.core.retry import Backoff
from echo_rl.worker.lifecycle import wait_next

log = logging.getLogger("echo.worker")

# Refusals of a batch that say nothing about the batch itself: keep it and send it again.
RETRY_REASONS = {"not_joined", "rate_limited", "internal_error"}
RESEND_S, RESEND_MAX_S = 0.5, 8.0  # after such a refusal: first back-off, and its cap


class Requests(Protocol):
    """The learner, as deliveries see it: a request with a timeout (``echo_rl.core.client.Client``)."""

    async def request(self, msg: wire.Message, timeout: float) -> wire.Message: ...


class Deliveries:
    """The unacknowledged batches and the deliveries that carry them.

    ``ledger``: a JSONL file of what the learner acknowledged storing, per batch (None: none).
    ``banned``: turns a ban's detail into the error that ends the worker."""

    def __init__(
        self,
        client: Requests,
        timeout: Callable[[], float],
        banned: Callable[[str], Exception],
        ledger: str | None = None,
    ):
        self.client, self.timeout, self.banned, self.ledger = client, timeout, banned, ledger
        self.unacked: OrderedDict[str, wire.Trajectories] = OrderedDict()
        self.groups_of: dict[str, list[str]] = {}  # batch id -> its group ids (while unacked)
        self._keys: dict[str, list[list[str | int]]] = {}  # batch id -> its records' [group, index]
        self._delivering: set[str] = set()  # batch ids with a delivery in flight
        self.to_deliver = asyncio.Event()  # a batch needs a delivery started
        self.acked = asyncio.Event()  # a batch left ``unacked``
        self.delivered = 0  # records acknowledged
        self.refused = Backoff(RESEND_S, RESEND_MAX_S)  # refusals in a row: the next resend

    def __len__(self) -> int:
        return len(self.unacked)

    def add(
        self, batch: wire.Trajectories, group_ids: list[str], keys: list[list[str | int]]
    ) -> None:
        """Queue a batch for delivery; ``keys`` name its records for the ledger."""
        self.unacked[batch.batch_id] = batch
        self.groups_of[batch.batch_id] = group_ids
        if self.ledger:
            self._keys[batch.batch_id] = keys
        self.to_deliver.set()

    def holding(self) -> list[str]:
        """Group ids in batches not yet acknowledged (a work request lists them as held)."""
        return [g for batch_id in self.unacked for g in self.groups_of.get(batch_id, ())]

    async def wait_acked(self, timeout: float) -> None:
        await wait_next(self.acked, timeout)

    async def run(self) -> None:
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
        self.groups_of.pop(batch.batch_id, None)
        self.acked.set()
        if isinstance(reply, wire.Error):
            # The learner judged the batch itself bad: resending the same bytes cannot help.
            log.error(
                "learner rejected batch %s: %s: %s", batch.batch_id, reply.reason, reply.detail
            )
            return
        assert isinstance(reply, wire.Ack)
        if reply.rejected:
            words = "; ".join(
                f"{r}: {wire.REFUSAL_WORDS[r]}" for r in reply.rejected if r in wire.REFUSAL_WORDS
            )
            log.warning(
                "batch %s: learner rejected records %s%s",
                batch.batch_id,
                reply.rejected,
                f" ({words})" if words else "",
            )
        self._record_ack(batch.batch_id, reply)
        self.delivered += batch.count

    async def _attempt(self, batch: wire.Trajectories) -> wire.Message | None:
        """One delivery; None when the batch must be sent again (no reply, or a refusal that
        says nothing about the batch: not joined yet after a learner restart, sent too fast)."""
        try:
            reply = await self.client.request(batch, self.timeout())
        except RequestTimeout as err:  # ConnectionLost included: the reply, if any, is gone
            log.info("batch %s not acknowledged yet (%s); will resend", batch.batch_id, err)
            return None
        if isinstance(reply, wire.Error) and reply.reason == "banned":
            raise self.banned(reply.detail)
        if isinstance(reply, wire.Error) and reply.reason in RETRY_REASONS:
            log.info("batch %s not taken yet (%s); will resend", batch.batch_id, reply.reason)
            await asyncio.sleep(self.refused.next())  # back-off with jitter, not an event
            return None
        self.refused.reset()
        answer: wire.Message = reply
        return answer

    def _record_ack(self, batch_id: str, ack: wire.Ack) -> None:
        keys = self._keys.pop(batch_id, None)
        if not self.ledger or keys is None:
            return
        bad = set(ack.rejected_idx)
        stored = [k for i, k in enumerate(keys) if i not in bad]
        with open(self.ledger, "a") as f:
            f.write(
                json.dumps({"batch_id": batch_id, "stored": stored, "rejected": ack.rejected})
                + "\n"
            )

    async def drain(self, timeout: float) -> None:
        """Wait, at most ``timeout`` seconds, until every batch is acknowledged (the
        deliveries task keeps retrying meanwhile): a learner going away must not hold us."""
        try:
            async with asyncio.timeout(timeout):
                while self.unacked:
                    self.acked.clear()
                    await self.acked.wait()
        except TimeoutError:
            pass
        if self.unacked:
            log.warning("leaving with %d unacknowledged batch(es)", len(self.unacked))
