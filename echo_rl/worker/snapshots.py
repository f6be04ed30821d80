"""The worker's snapshot feed: every published version fetched, relayed and rebuilt as it comes.

The feed runs beside generation (its own task), so the chain keeps flowing while the model is
busy: each notice's payload is pulled through the relay (which serves it onward chunk by chunk)
and rebuilt into the version's full payload (``echo_rl.broadcast.versions.rebuild``): a full snapshot is
its own, a delta is applied to the previous version's full payload held here, and a worker
without that base (it joined late, a fetch failed, it fell behind) fetches the rebuilt version
from a peer that installed it (a keyframe, ``Relay.receive_keyframe``; the learner names it).
The newest rebuilt version waits in ``ready`` until the worker installs it into its model
between rollouts.

Versions are fetched oldest first, so each delta finds its base; a worker that cannot rebuild
the oldest (no base) goes straight to the newest. ``pending`` holds at most
``MAX_PENDING`` notices; past that the oldest are dropped (a worker that far behind catches up
with one keyframe instead of replaying every delta).

A relay this node left because it failed (a stall, a drop, a corrupt chunk) is avoided for
``AVOID_S``: notices the learner sent before it heard the report still name it, and each would
cost another stall. For those the feed asks the learner for another source at once, with the
reason ``avoided``, which is no new evidence against the relay (``echo_rl.broadcast.reports``). The
learner's own snapshot endpoint (``root``, ``JoinAck.learner_snapshot_endpoint``; not the
join's ``snapshot_endpoint``, which may be a peer) is never avoided: it is the source of last
resort; a learner that does not name it gets no avoidance at all.
At most ``MAX_AVOIDED`` relays are held; the oldest entry goes first.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from echo_rl.broadcast.fetch import FetchStats, SourceFailed
from echo_rl.broadcast.manifest import Manifest
from echo_rl.broadcast.relay import Relay
from echo_rl.broadcast.snapshot import SnapshotError
from echo_rl.broadcast.tickets import Source
from echo_rl.broadcast.versions import rebuild
from echo_rl.core.layout import Payload

log = logging.getLogger("echo_rl.worker.agent")

MAX_PENDING = 8
AVOID_S = 60.0  # how long a relay that failed this node is skipped in later notices
MAX_AVOIDED = 16  # relays held in that list (overflow: the entry that expires first goes)
AVOIDED = "avoided"  # a source request's reason: skipped, not a new failure
FAILURES = ("timeout", "disconnected", "corrupt", "suspect")  # reasons that leave a relay
# (version, bad source, reason, failed chunk, form) -> a new source from the learner
AskSource = Callable[[int, str, str, int, str], Awaitable[Source]]
# (version, fetch stats, rebuild seconds, took a keyframe) -> the install report is sent
Report = Callable[[int, FetchStats, float, bool], Awaitable[None]]


class SnapshotFeed:
    def __init__(
        self,
        relay: Relay,
        ask: AskSource,
        report: Report,
        on_ready: Callable[[], None] = lambda: None,
    ):
        """``on_ready``: called when a version is rebuilt and waits to be installed."""
        self.relay, self.ask, self.report, self.on_ready = relay, ask, report, on_ready
        self.pending: dict[int, tuple[Manifest, Source]] = {}  # verified (Installer.offer)
        self.rebuilt = -1  # newest version rebuilt here
        self.ready: tuple[int, Manifest, Payload] | None = None  # rebuilt, not yet installed
        self.offers = asyncio.Event()  # a notice arrived
        self._epoch = 0  # bumped by reset: a fetch of the old run gives up
        self.fetching: int | None = None  # the version being fetched now
        self.root = ""  # the learner's snapshot endpoint (never avoided), set at each join
        self.avoided: dict[str, float] = {}  # relay endpoint -> monotonic time it may be tried
        self.skipped = 0  # notices whose relay was avoided (a source asked for at once)

    def offer(self, version: int, manifest: Manifest, source: Source) -> None:
        if version <= self.rebuilt:
            return
        self.pending[version] = (manifest, source)
        for old in sorted(self.pending)[:-MAX_PENDING]:
            del self.pending[old]
        self.offers.set()

    def joined(self, root: str) -> None:
        """A join named the learner's snapshot endpoint; relays left before are tried again."""
        self.root = root
        self.avoided.clear()

    def avoid(self, endpoint: str, now: float | None = None) -> None:
        if not self.root or endpoint == self.root:  # "": a learner that does not say which
            return
        now = time.monotonic() if now is None else now
        self.avoided.pop(endpoint, None)
        self.avoided[endpoint] = now + AVOID_S
        while len(self.avoided) > MAX_AVOIDED:
            del self.avoided[min(self.avoided, key=self.avoided.__getitem__)]

    def is_avoided(self, endpoint: str, now: float | None = None) -> bool:
        until = self.avoided.get(endpoint)
        if until is None:
            return False
        if until <= (time.monotonic() if now is None else now):
            del self.avoided[endpoint]
            return False
        return True

    def reset(self) -> None:
        """Another run (or one that went back in versions): forget every version."""
        self.pending.clear()
        self.rebuilt, self.ready = -1, None
        self._epoch += 1
        self.relay.reset()

    def newest_held(self) -> int:
        """The newest version this node knows anything of: rebuilt, fetched in part, or
        offered (-1: none)."""
        return max([self.rebuilt, self.relay.store.newest_version, *self.pending])

    def progress(self) -> tuple[int, int, int] | None:
        """(version, chunks held, chunks) of the fetch under way, or None."""
        buf = self.relay.store.get(self.fetching) if self.fetching is not None else None
        return (buf.version, buf.count, buf.total) if buf is not None else None

    def take_ready(self) -> tuple[int, Manifest, Payload] | None:
        ready, self.ready = self.ready, None
        return ready

    async def run(self) -> None:
        while True:
            await self.offers.wait()
            self.offers.clear()
            while self.pending:
                version = self._next()
                manifest, source = self.pending.pop(version)
                for older in [v for v in self.pending if v < version]:
                    del self.pending[older]
                if version > self.rebuilt:
                    await self._fetch(version, manifest, source)

    def _next(self) -> int:
        """The oldest pending version, when this node can rebuild it (a full snapshot, or a
        delta whose base is held here); else the newest: a keyframe is needed either way, and
        the newest is the one the learner and the peers still hold."""
        version = min(self.pending)
        manifest = self.pending[version][0]
        if manifest.encoding == "full" or self.relay.base_for(manifest) is not None:
            return version
        return max(self.pending)

    async def _fetch(self, version: int, manifest: Manifest, source: Source) -> None:
        epoch = self._epoch
        self.fetching = version
        try:
            if self.is_avoided(source.endpoint):  # a notice sent before the learner heard
                self.skipped += 1
                log.info(
                    "snapshot v%d: %s failed here before; asking for another",
                    version,
                    source.endpoint,
                )
                source = await self._ask(version, epoch, source.endpoint, AVOIDED, -1, "payload")
            buf, stats = await self.relay.receive(
                manifest, source, self._reattacher(version, epoch, "payload")
            )
            result, decode_s, keyframe = await self._rebuild(version, manifest, buf.payload, epoch)
        except SnapshotError as err:
            log.warning("snapshot v%d not received: %s", version, err)
            return
        finally:
            self.fetching = None
        if epoch != self._epoch:
            return
        self.relay.hold_result(manifest, result)  # the next delta's base, a keyframe source
        self.rebuilt, self.ready = version, (version, manifest, result)
        self.on_ready()
        await self.report(version, stats, decode_s, keyframe)
        log.info(
            "received snapshot v%d (%s, %d bytes, %d chunks from %s%s)",
            version,
            manifest.encoding,
            manifest.payload_size,
            stats.chunks,
            " then ".join(stats.sources),
            ", then a keyframe" if keyframe else "",
        )

    async def _rebuild(
        self, version: int, manifest: Manifest, payload: Payload, epoch: int
    ) -> tuple[Payload, float, bool]:
        """The full payload, the rebuild's seconds, and whether it took a keyframe."""
        t0 = time.perf_counter()
        try:
            result = await asyncio.to_thread(
                rebuild, manifest, payload, self.relay.base_for(manifest)
            )
            delta = manifest.encoding == "delta"  # a full snapshot needs no rebuild
            return result, time.perf_counter() - t0 if delta else 0.0, False
        except SnapshotError as err:  # BaseMissing, or a result that fails its signed hashes
            log.info("snapshot v%d: %s; fetching a keyframe", version, err)
        first = await self._ask(version, epoch, "", "no_base", -1, "full")
        result, _ = await self.relay.receive_keyframe(
            manifest, first, self._reattacher(version, epoch, "full")
        )
        return result, 0.0, True

    def _reattacher(
        self, version: int, epoch: int, form: str
    ) -> Callable[[Source, SourceFailed], Awaitable[Source]]:
        async def reattach(bad: Source, fail: SourceFailed) -> Source:
            log.warning(
                "snapshot source %s failed (%s); asking the learner for another",
                bad.endpoint,
                fail.reason,
            )
            if fail.reason in FAILURES:
                self.avoid(bad.endpoint)
            return await self._ask(version, epoch, bad.endpoint, fail.reason, fail.index, form)

        return reattach

    async def _ask(
        self, version: int, epoch: int, bad: str, reason: str, chunk: int, form: str
    ) -> Source:
        if epoch != self._epoch:
            raise SnapshotError(
                f"v{version} superseded while fetching (the learner restarted into another run)"
            )
        return await self.ask(version, bad, reason, chunk, form)
