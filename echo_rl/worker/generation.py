"""Generation: pull work, generate and score it with the installed model, queue the batch for
delivery, or hand cut samples back (docs/preemption.md).

Nothing waits on a round trip that it need not: when a work request's round trip is over 10%
of a rollout the next request leaves while the current groups are generated, and grants grow
so that a rollout outlasts a round trip (docs/wide_area.md).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager, nullcontext
from typing import Any

from echo_rl.core import wire
from echo_rl.core.client import RequestTimeout
from echo_rl.core.ewma import Ewma
from echo_rl.core.retry import at_least
from echo_rl.worker.delivery import Deliveries
from echo_rl.worker.install import Installer
from echo_rl.worker.lifecycle import Activity, Lifecycle, wait_next
from echo_rl.worker.records import episode_fields, own_tokens, record, runs
from echo_rl.worker.scoring import Scored, generate_and_score
from echo_rl.worker.session import Session
from echo_rl.worker.sharing import DeviceSeat
from echo_rl.worker.status import StatusBoard
from echo_rl.worker.tail import Carry

log = logging.getLogger("echo.worker")


MAX_GRANT_SCALE = 8  # at most this many times worker.groups_per_request in one grant
PREFETCH_SHARE = 0.1  # prefetch work when a grant's round trip exceeds this share of a rollout


async def _nothing() -> None:
    return None


class Generation:
    """The work loop and its timings: grant round trip, rollout and per-group seconds
    (EWMAs), and the busy-time throughput the heartbeat reports."""

    def __init__(
        self,
        session: Session,
        installer: Installer,
        deliveries: Deliveries,
        *,
        life: Lifecycle,
        activity: Activity,
        status: StatusBoard,
        seat: DeviceSeat | None = None,
    ):
        """``seat``: this run's turns on the device (echo_rl/worker/sharing.py; None: the
        device is this run's alone)."""
        self.session, self.installer, self.deliveries = session, installer, deliveries
        self.held = installer.held
        self.life, self.activity, self.status = life, activity, status
        self.generating: list[str] = []  # group ids being generated now
        # groups cut in their tail, for the next rollout (echo_rl/worker/tail.py)
        self.carry = Carry()
        self.completed = 0  # samples of the groups the last rollout completed
        # Seconds of a work request's round trip. Averaged from a prior of 0, not from the
        # first sample: one slow first request (the learner warming up) must not switch
        # prefetching and big grants on.
        self.rtt_avg = Ewma(0.2, prior=0.0)
        self.rollout_avg = Ewma(0.2)  # seconds of generating and scoring one grant
        self.group_avg = Ewma(0.2)  # seconds of generating and scoring one group
        self._prefetching = False
        self.rate_avg = Ewma(0.3)  # samples per busy second, recent
        self.busy_s = 0.0  # cumulative busy time and output, for an unbiased average rate
        self.busy_samples = 0
        self.device_turn: Callable[[], AbstractAsyncContextManager[Any]] = (
            nullcontext if seat is None else seat.turn
        )
        self.retry_after_s = 0.0  # the last empty grant's hint: when to ask again
        self.device_ready: Callable[[], Awaitable[None]] = (
            _nothing if seat is None else seat.bring_on
        )

    @property
    def grant_rtt(self) -> float:
        return self.rtt_avg.get()

    @property
    def rollout_s(self) -> float:
        return self.rollout_avg.get()

    @property
    def group_s(self) -> float:
        return self.group_avg.get()

    @property
    def throughput(self) -> float:
        return self.rate_avg.get()

    async def run(self) -> None:
        async with asyncio.TaskGroup() as tg:
            prefetch: asyncio.Task[list[wire.Group]] | None = None
            while not self.life.stopping.is_set():
                if self.life.yielded:  # the owner's turn: no leases, no generation
                    if self.carry.groups:  # nor groups cut in their tail: another goes on
                        await self.return_carry()
                    await self.life.quiet.wait()
                    continue
                await self.installer.ensure_installed()
                if self.held.version < 0:
                    await wait_next(self.installer.new_snapshot, 1.0)
                    continue
                if len(self.deliveries) >= self.session.view["worker"]["max_unacked_batches"]:
                    await self.deliveries.wait_acked(0.5)  # back-pressure: deliver first
                    continue
                # Leased groups never wait for another run (echo_rl/worker/sharing.py)
                async with self.device_turn():
                    t0 = time.monotonic()
                    grant = await (prefetch or self.request_work())  # the carry listed held
                    groups, prefetch = self.carry.take() + grant, None
                    if groups:
                        await self.device_ready()  # this run's model onto the device
                        if self.prefetch_pays():  # the next grant's round trip overlaps this one
                            prefetch = tg.create_task(self.request_work())
                        if await self.rollout(groups):
                            # Busy-time throughput: one grant, generate, score cycle (what
                            # the worker can do; idle waits and installs are outside it).
                            # Samples of the groups it completed: a carried group counts
                            # once, when it is delivered.
                            self.measure(self.completed, time.monotonic() - t0)
                if not groups:
                    await wait_next(self.installer.new_snapshot, at_least(self.retry_after_s))
            if prefetch is not None:
                prefetch.cancel()  # its groups come back to the learner with our leave
        if self.carry.groups:  # stopping with groups cut in their tail: another goes on
            await self.return_carry()

    def prefetch_pays(self) -> bool:
        """Ask for the next groups before these are done only when a grant's round trip is a
        noticeable share (over 10%) of a rollout, i.e. on a long link or with a fast model.
        On a LAN it would only lease groups earlier and hold them longer, for no gain."""
        pays = self.grant_rtt > PREFETCH_SHARE * self.rollout_s
        if pays != self._prefetching:
            self._prefetching = pays
            log.info(
                "%s work: a grant's round trip is %.1f ms, a rollout %.1f ms",
                "prefetching" if pays else "no longer prefetching",
                1000 * self.grant_rtt,
                1000 * self.rollout_s,
            )
        return pays

    def grant_size(self) -> int:
        """``worker.groups_per_request``, times as many as it takes for one rollout to last a
        grant's round trip (at most 8 times): with a prefetched grant arriving while the
        current one is generated, the worker then never waits on the link."""
        base = int(self.session.view["worker"]["groups_per_request"])
        if self.group_s <= 0:
            return base
        return base * max(
            1, min(MAX_GRANT_SCALE, math.ceil(self.grant_rtt / (base * self.group_s)))
        )

    async def request_work(self) -> list[wire.Group]:
        self.retry_after_s = 0.0
        req = wire.WorkRequest(
            worker_id=self.session.worker_id,
            max_groups=max(1, self.grant_size() - len(self.carry.groups)),
            holding=self.generating + self.deliveries.holding() + self.carry.ids(),
        )
        try:
            sent = time.monotonic()
            grant = await self.session.client.request(req, self.session.timeout)
            self.rtt_avg.update(time.monotonic() - sent)
        except RequestTimeout:
            return []
        if isinstance(grant, wire.Error) and grant.reason == "banned":
            raise self.session.banned(grant.detail)
        if isinstance(grant, wire.Error):
            log.info("work request refused (%s); re-joining", grant.reason)
            await self.session.join()
            return []
        assert isinstance(grant, wire.WorkGrant)
        self.retry_after_s = grant.retry_after_s  # waited out by run(), the device freed
        return grant.groups

    async def generate(self, groups: list[wire.Group]) -> tuple[Scored, float]:
        """Generate and score ``groups`` off the loop, listed as held meanwhile; and the
        seconds it took."""
        self.activity.state = "generating"
        self.generating = [g.group_id for g in groups]
        try:
            async with self.device_turn():  # shared with other runs (echo_rl/worker/sharing.py)
                t0 = time.monotonic()  # generation time, not the wait for the device
                samples = await asyncio.to_thread(self.generate_and_score, groups)
                gen_s = time.monotonic() - t0
        finally:
            self.generating = []
        self.activity.state = "yielded" if self.life.yielded else "idle"
        yielded_at = self.status.doc.yielded_at
        if self.life.yielded and yielded_at is not None:  # how long the cut took
            self.status.update(yield_stop_s=round(time.time() - yielded_at, 3))
        return samples, gen_s

    async def rollout(self, groups: list[wire.Group]) -> bool:
        """Generate, score and queue the groups for delivery; False if they were handed back.
        A long-tail cut (``worker.tail_cut``) delivers the groups that ended and carries the
        others into the next rollout (echo_rl/worker/tail.py)."""
        version = self.held.version
        samples, gen_s = await self.generate(groups)
        unfinished = [any(not getattr(s, "finished", True) for s, _ in g) for g in samples]
        if any(unfinished) and (self.life.cut.is_set() or self.life.yielded):
            await self.hand_back(groups, samples, version)  # cut short: another worker goes on
            return False
        self.time_rollout(gen_s, len(groups))
        done = [k for k, u in enumerate(unfinished) if not u]
        if len(done) < len(groups):  # cut in its tail: continued in the next rollout
            tail = [k for k, u in enumerate(unfinished) if u]
            self.carry.keep(
                [groups[k] for k in tail], [[s for s, _ in samples[k]] for k in tail], version
            )
            self.status.update(tail_groups=(self.status.doc.tail_groups or 0) + len(tail))
            self._sent(own_tokens([samples[k] for k in tail]))  # kept, not thrown away
        if done:
            self.queue([groups[k] for k in done], [samples[k] for k in done], version, gen_s)
        self.completed = sum(groups[k].n for k in done)
        return True

    def time_rollout(self, gen_s: float, groups: int) -> None:
        self.rollout_avg.update(gen_s)
        self.group_avg.update(gen_s / groups)

    def queue(self, groups: list[wire.Group], samples: Scored, version: int, gen_s: float) -> None:
        """The groups' records, generated under ``version``, as one batch for delivery."""
        wid = self.session.worker_id
        # an episode's stats and cut, to a learner that admits them (an older one refuses
        # unknown fields, and a refused record would count against this worker)
        shown = self.session.view.get("episode_stats") is True
        adapter = self.held.adapter
        assert adapter is not None  # groups were generated: a model and its adapter are held
        records = [
            {
                **record(g, i, s, r, wid, gen_s, version),
                **(
                    episode_fields(s, adapter)
                    if shown and getattr(s, "loss_mask", None) is not None
                    else {}
                ),
            }
            for g, group_samples in zip(groups, samples)
            for i, (s, r) in enumerate(group_samples)
        ]
        batch = wire.Trajectories(
            worker_id=wid,
            batch_id=uuid.uuid4().hex,
            count=len(records),
            payload=wire.pack_records(records),
        )
        self.status.generated(len(groups), len(records))
        self._sent(own_tokens(samples))
        self.deliveries.add(
            batch,
            [g.group_id for g in groups],
            [[g.group_id, i] for g, gs in zip(groups, samples) for i in range(len(gs))],
        )

    def _sent(self, tokens: int) -> None:
        """Own sampled tokens that left in a batch or a handback (the drill's accounting:
        sampled minus sent is what this worker threw away); written at once, since a
        preempted worker may be killed before the next periodic write."""
        if self.held.backend is not None:
            self.status.update(
                tokens_sent=(self.status.doc.tokens_sent or 0) + tokens,
                tokens_sampled=self.held.backend.tokens_sampled,
            )
            self.status.flush(force=True)

    async def hand_back(self, groups: list[wire.Group], samples: Scored, version: int) -> None:
        """Give the groups back with what was generated of each sample (docs/preemption.md).
        Whole groups only: finished samples go back as prefixes too, so the worker that
        continues the group delivers all of it (a group is delivered whole, by one worker)."""
        prefixes: dict[str, list[wire.Prefix]] = {}
        for g, group_samples in zip(groups, samples):
            prefixes[g.group_id] = [
                wire.Prefix(
                    sample_idx=i,
                    ids=s.completion_ids,
                    logprobs=s.logprobs,
                    versions=runs(s, version),
                    turns=list(getattr(s, "turns", [])),
                )
                for i, (s, _) in enumerate(group_samples)
                if s.completion_ids
            ]
        msg = wire.Handback(
            worker_id=self.session.worker_id,
            reason="yielded" if self.life.yielded else "preempted",
            groups=[g.group_id for g in groups],
            prefixes=prefixes,
        )
        self._sent(own_tokens(samples))
        kept = sum(len(p) for p in prefixes.values())
        tokens = sum(len(p.ids) for ps in prefixes.values() for p in ps)
        try:
            ack = await self.session.client.request(msg, min(2.0, self.session.timeout))
        except RequestTimeout:
            log.warning(
                "handback of %d groups unanswered: their leases expire instead", len(groups)
            )
            return
        if isinstance(ack, wire.HandbackAck):
            log.info(
                "handed back %d groups, %d of %d prefixes (%d tokens) kept%s",
                ack.groups,
                ack.prefixes,
                kept,
                tokens,
                f"; refused {ack.refused}" if ack.refused else "",
            )
            self.status.update(
                handed_back_tokens=(self.status.doc.handed_back_tokens or 0) + tokens
            )

    async def return_carry(self) -> None:
        msg = self.carry.handback(
            self.session.worker_id, "yielded" if self.life.yielded else "preempted"
        )
        try:
            await self.session.client.request(msg, min(2.0, self.session.timeout))
        except RequestTimeout:
            log.warning("handback of %d carried groups unanswered", len(msg.groups))

    def generate_and_score(self, groups: list[wire.Group]) -> Scored:
        """Samples and rewards per group (``echo_rl.worker.scoring``); the drills' liars override it."""
        backend, adapter = self.held.backend, self.held.adapter
        assert backend is not None and adapter is not None
        return generate_and_score(
            backend, adapter, self.session.view["worker"], self.life.cut, groups
        )

    def measure(self, count: int, seconds: float) -> None:
        self.busy_s += seconds
        self.busy_samples += count
        rate = count / max(seconds, 1e-3)
        self.rate_avg.update(rate)
