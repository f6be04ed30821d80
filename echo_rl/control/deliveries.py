"""Work out and rollouts in: grants, trajectory batches, hand-backs, and what a failed check
does to the worker that sent them (strikes, then quarantine; docs/security.md).

Admission itself is ``echo_rl.control.intake``; hand-backs ``echo_rl.control.handbacks``; strikes
``echo_rl.control.reputation``. This object answers the three requests with them, keeps each
worker's measured throughput and tells the provisioner what each delivery was worth. Runs on
the server's loop.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from echo_rl.control.handback import PrefixLimits
from echo_rl.control.handbacks import Handbacks
from echo_rl.control.intake import NOT_COUNTED, Intake
from echo_rl.control.members import Members
from echo_rl.control.reputation import Quarantine, Reputation, Verdict
from echo_rl.control.sessions import EWMA_ALPHA, WorkerState
from echo_rl.control.staleness import Staleness
from echo_rl.control.work import WorkQueue
from echo_rl.core import wire
from echo_rl.core.ewma import ewma
from echo_rl.data import rules
from echo_rl.data.buffer import ReplayBuffer
from echo_rl.data.records import Limits, Record

log = logging.getLogger("echo.control")

STANDBY_RETRY_S, EMPTY_RETRY_S = 0.5, 0.2  # a small fleet's retry after a grant without work


@dataclass
class Deferred:
    """A reply that may leave only once ``durable`` (a buffer log future) has resolved."""

    reply: wire.Message
    durable: Future[None]


@dataclass(frozen=True)
class DeliveryLimits:
    """What a delivery or a hand-back is checked against besides the records' own limits."""

    limits: Limits
    staleness: int  # learner.staleness: versions a record may lag
    multi_turn: bool  # the adapter's episodes span turns (hand-back prefixes may be longer)
    max_bytes: int  # transport.max_message_mib, in bytes


@dataclass(frozen=True)
class DeliveryChecks:
    """What a delivery goes through: admission (``echo_rl.control.intake``), strikes
    (``echo_rl.control.reputation``), hand-backs (``echo_rl.control.handbacks``) and the credit
    a stale one earns (``echo_rl.control.staleness``)."""

    intake: Intake
    reputation: Reputation
    returns: Handbacks
    staleness: Staleness


class Deliveries:
    def __init__(
        self,
        *,
        members: Members,
        checks: DeliveryChecks,
        buffer: ReplayBuffer,
        work: WorkQueue,
        limits: DeliveryLimits,
        rejected: Counter[str],
        push_ident: Callable[[bytes, wire.Message, str], None],
    ):
        """The session table, the gate and the accounts are the members' own."""
        self.members = members
        self.table, self.gate, self.accounts = members.table, members.gate, members.accounts
        self.intake = checks.intake
        self.reputation = checks.reputation
        self.returns = checks.returns
        self.staleness = checks.staleness
        self.buffer = buffer
        self.work = work
        self.limits = limits
        self.rejected = rejected  # the server's refusal counts, by reason (shared)
        self.push_ident = push_ident  # a message to a connection now (a quarantined farewell)

    # ------------------------------------------------------------------ work out

    def on_work_request(self, ident: bytes, key: str, msg: wire.WorkRequest) -> wire.Message:
        m = self.members
        m.promote(self.table.joined(ident, key, msg.worker_id), "asked for work")
        if not m.is_active(msg.worker_id):  # standby: relay, don't roll out
            return wire.WorkGrant(groups=[], retry_after_s=self.poll_after(STANDBY_RETRY_S))
        if m.controller is not None:
            m.controller.ready(msg.worker_id)
        probation = m.controller is not None and m.controller.on_probation(msg.worker_id)
        capped = self.returns.capped(msg.worker_id)  # past its share of hand-backs
        ask = 1 if probation or capped else min(msg.max_groups, self.fair_share())
        aff = self.work.affinity  # docs/scheduling.md, "Affinity": long tasks to fast workers
        rank = aff.rank(msg.worker_id) if aff is not None else None
        groups = self.work.grant(
            msg.worker_id, ask, self.buffer.depth().ready_groups, msg.holding, key=key, rank=rank
        )
        self.accounts.granted(msg.worker_id, len(groups))
        return wire.WorkGrant(
            groups=groups, retry_after_s=0.0 if groups else self.poll_after(EMPTY_RETRY_S)
        )

    def poll_after(self, base: float) -> float:
        """When a worker that got no work may ask again: ``base``, or fleet size over
        transport.heartbeats_per_s once that is longer (docs/scale.md): a thousand idle workers
        asking five times a second cost the loop more than all their heartbeats."""
        return self.table.fleet_interval(base)

    def fair_share(self) -> int:
        """Groups one grant may carry: the outstanding bound split over the active workers.
        Workers on long links ask for large grants (echo_rl/worker/agent.py); without this one of
        them could lease most of the bound and leave the others idle (echo_rl/data/rules.py)."""
        return rules.fair_share(self.work.max_outstanding, self.members.active_count())

    def on_handback(self, ident: bytes, key: str, msg: wire.Handback) -> wire.Message:
        """Leases given back before the worker stops generating (docs/preemption.md): only
        the holder's own; their prefixes are checked, counted and bounded, and may wait for a
        recomputation before anyone continues them (``echo_rl.control.handbacks``)."""
        self.table.joined(ident, key, msg.worker_id)
        lim, dl = self.limits.limits, self.limits
        prefix = PrefixLimits(
            lim.vocab_size, lim.max_new_tokens, lim.min_logprob, dl.staleness, dl.multi_turn
        )
        return self.returns.receive(msg.worker_id, key, msg, self.buffer.version, prefix)

    # ------------------------------------------------------------------ rollouts in

    def on_trajectories(
        self, ident: bytes, key: str, msg: wire.Trajectories
    ) -> wire.Message | Deferred:
        w = self.table.joined(ident, key, msg.worker_id)
        try:
            raw = wire.unpack_records(msg.payload, self.limits.max_bytes)
        except wire.WireError as err:
            self.rejected[err.reason] += 1
            self.accounts.delivered(w.worker_id, 0, 0, {err.reason: 1}, {err.reason: err.detail})
            log.warning(
                "rejected trajectory batch %s from %s: %s", msg.batch_id, msg.worker_id, err
            )
            return wire.Error(reason=err.reason, detail=err.detail, ref=msg.batch_id)
        # (echo_rl.core.wire refuses a bool count; were one let through, True == 1 must not pass here)
        if type(msg.count) is not int or msg.count != len(raw):
            self.rejected["count_mismatch"] += 1
            self.accounts.delivered(w.worker_id, 0, 0, {"count_mismatch": 1})
            log.warning(
                "rejected trajectory batch %s from %s: count %r for %d records",
                msg.batch_id,
                msg.worker_id,
                msg.count,
                len(raw),
            )
            return wire.Error(
                reason="count_mismatch",
                ref=msg.batch_id,
                detail=f"count {msg.count!r} but {len(raw)} records: send count=len(records)",
            )
        out = self.intake.batch(msg.worker_id, key, raw)
        if out.quarantine is not None:  # a check of this batch was the sender's last strike
            self.quarantine(out.quarantine)
        self.accounts.delivered(
            w.worker_id, len(out.accepted), out.duplicates, out.rejected, out.details
        )
        if out.rejected:
            self.rejected.update({k: v for k, v in out.rejected.items() if k not in NOT_COUNTED})
            log.warning(
                "batch %s from %s: rejected %s %s",
                msg.batch_id,
                msg.worker_id,
                dict(out.rejected),
                out.details or "",
            )
        if msg.worker_id in self.reputation.quarantined:
            self.farewell(msg.worker_id, ident)  # its books are complete only now
            why = self.reputation.quarantined[msg.worker_id]
            raise wire.WireError(
                "banned",
                f"this worker was quarantined ({why}): its "
                f"deliveries failed the learner's checks (docs/security.md)",
            )
        self._credit(w, out.accepted)
        ack = wire.Ack(
            batch_id=msg.batch_id,
            accepted=len(out.accepted),
            duplicates=out.duplicates,
            rejected=dict(out.rejected),
            rejected_idx=out.rejected_idx,
        )
        if out.durable is not None:
            # Sent when the write-ahead log has it on disk; a future that already failed must
            # still go through the server's ack queue, which answers with an error, never an ack.
            return Deferred(ack, out.durable)
        return ack

    def _credit(self, w: WorkerState, accepted: list[Record]) -> None:
        """An admitted batch: the worker's measured rate, and what it was worth to the
        provisioner (stale trajectories earn less, learner.staleness; refused ones nothing)."""
        if accepted:
            self.measure(w, len(accepted))
            if self.work.affinity is not None:
                self.work.affinity.admitted(w.worker_id, accepted)
        credit = self.staleness.admitted(w.worker_id, accepted, self.buffer.version)
        controller = self.members.controller
        if controller is not None:
            # Busy time of the batch (every record of a batch carries the same gen_s): the
            # controller then measures capacity, not how much work it was handed. A device
            # shared with other runs is counted at what it delivers here per wall second
            # (docs/multirun.md): the capacity this run receives, not the device's.
            busy = None if w.runs > 1 else max((r.gen_s for r in accepted), default=None)
            controller.observe(
                w.worker_id, len(accepted), busy_s=busy, credit=min(credit, len(accepted))
            )

    @staticmethod
    def measure(w: WorkerState, accepted: int) -> None:
        now = time.monotonic()
        rate = accepted / max(now - w.last_batch_at, 1e-3)
        w.measured_throughput = ewma(
            w.measured_throughput if w.admitted else None, rate, EWMA_ALPHA
        )
        w.admitted += accepted
        w.last_batch_at = now

    # ------------------------------------------------------------------ strikes and quarantine

    def record(self, verdict: Verdict) -> None:
        """On the loop: the strike first (a forged prefix's author answers for it), then a
        held hand-back goes out with or without its prefixes (echo_rl.control.handbacks)."""
        q = self.reputation.record(verdict)
        if q is not None:
            self.quarantine(q)
        self.returns.verdict(verdict)

    def quarantine(self, q: Quarantine) -> None:
        """The worker's key is banned, its unconsumed records leave the buffer, its leases go
        to others. Runs on the loop, once the reputation has sentenced it."""
        worker_id, key, reason = q.worker_id, q.key, q.reason
        self.gate.ban(key, f"quarantined: {reason}")
        w = self.table.workers.get(worker_id)
        if w is not None:
            self.members.refresh_book(w)
        self.accounts.close(worker_id, "quarantined", f"quarantined: {reason}")
        if w is not None:
            self.farewell(worker_id, w.ident)
        removed = self.buffer.remove_worker(worker_id)
        log.error("quarantine of %s: %d buffered record(s) removed", worker_id, len(removed))
        self.returns.forget(worker_id)  # its held hand-backs go out without its prefixes
        self.members.forget(worker_id, "quarantined")

    def farewell(self, worker_id: str, ident: bytes) -> None:
        """A quarantined worker's final books, sent before the refusal that stops it (its
        key is banned: nothing it sends is answered any more)."""
        account = self.accounts.account(worker_id)
        if account is not None:
            self.push_ident(ident, wire.Farewell(account=account), worker_id)
