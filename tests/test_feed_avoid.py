"""A relay that failed a worker is skipped in the notices the learner sent before it heard the
report (issue 52, item 4: a black hole's child lost a second stall to those notices).

The feed runs for real (echo_rl/worker/snapshots.py ``SnapshotFeed``) over a stand-in relay that fails
every fetch from the hole the way ``fetch_into`` does (it calls the feed's reattach with a
``timeout``), and a stand-in learner that grants another source.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from echo_rl.broadcast.fetch import FetchStats, SourceFailed
from echo_rl.broadcast.snapshot import RunKey, build_manifest
from echo_rl.broadcast.store import SnapshotBuffer, SnapshotStore
from echo_rl.broadcast.tickets import Source
from echo_rl.core import wire
from echo_rl.worker.snapshots import AVOID_S, AVOIDED, MAX_AVOIDED, SnapshotFeed

pytestmark = pytest.mark.timeout(30)

ROOT, HOLE, PEER = "tcp://127.0.0.1:5556", "tcp://127.0.0.1:7001", "tcp://127.0.0.1:7002"
KEY = RunKey.generate()


def manifest(version: int):
    payload = np.random.default_rng(version).bytes(4096)
    return build_manifest(
        run_id="t",
        version=version,
        tensors=[],
        payload=payload,
        chunk_size=1024,
        dtype="uint8",
        key=KEY,
    ), payload


class StandInRelay:
    """What the feed uses of ``echo_rl.broadcast.relay.Relay``: fetches from ``failing`` stall."""

    def __init__(self, failing: set[str]):
        self.failing = failing
        self.store = SnapshotStore()
        self.fetched: list[tuple[int, str]] = []  # (version, endpoint) in the order tried
        self.payloads: dict[int, bytes] = {}

    async def receive(self, m, source, reattach):
        src = source
        while True:
            self.fetched.append((m.version, src.endpoint))
            if src.endpoint not in self.failing:
                break
            src = await reattach(src, SourceFailed("timeout", f"no chunk from {src.endpoint}"))
        return SnapshotBuffer(m, self.payloads[m.version]), FetchStats(sources=[src.endpoint])

    def base_for(self, m):
        return None

    def hold_result(self, m, result):
        pass

    def reset(self):
        pass


async def feed_versions(failing: set[str], notices: list[tuple[int, str]]):
    relay = StandInRelay(failing)
    asked: list[tuple[int, str, str]] = []
    installed = asyncio.Queue()

    async def ask(version, bad, reason, chunk, form):
        asked.append((version, bad, reason))
        return Source(PEER if bad != PEER else ROOT)

    async def report(version, stats, decode_s, keyframe):
        installed.put_nowait(version)

    feed = SnapshotFeed(relay, ask, report)  # type: ignore[arg-type]
    feed.joined(ROOT)
    async with asyncio.TaskGroup() as tg:
        task = tg.create_task(feed.run())
        for version, endpoint in notices:
            m, payload = manifest(version)
            relay.payloads[version] = payload
            feed.offer(version, m, Source(endpoint))
            assert await asyncio.wait_for(installed.get(), 10) == version
        task.cancel()
    return feed, relay, asked


def test_notices_naming_a_relay_that_stalled_here_go_elsewhere_at_once():
    feed, relay, asked = asyncio.run(
        feed_versions({HOLE}, [(1, HOLE), (2, HOLE), (3, HOLE), (4, PEER)])
    )
    # The hole is fetched from once: v1 stalls there and is reported as a timeout; v2 and v3,
    # noticed with the hole as their source, are asked elsewhere before any fetch.
    assert [ep for _, ep in relay.fetched].count(HOLE) == 1
    assert relay.fetched == [(1, HOLE), (1, PEER), (2, PEER), (3, PEER), (4, PEER)]
    assert asked == [(1, HOLE, "timeout"), (2, HOLE, AVOIDED), (3, HOLE, AVOIDED)]
    assert feed.skipped == 2


def test_the_learners_own_endpoint_is_never_avoided():
    _, relay, asked = asyncio.run(feed_versions({ROOT}, [(1, ROOT), (2, ROOT)]))
    # The root failed v1 (a loaded learner): v2's notice still fetches from it first.
    assert relay.fetched == [(1, ROOT), (1, PEER), (2, ROOT), (2, PEER)]
    assert [reason for *_, reason in asked] == ["timeout", "timeout"]


def test_avoiding_ends_after_its_time_and_the_list_is_bounded():
    feed = SnapshotFeed(StandInRelay(set()), None, None)  # type: ignore[arg-type]
    feed.joined(ROOT)
    feed.avoid(HOLE, now=100.0)
    assert feed.is_avoided(HOLE, now=100.0 + AVOID_S - 1)
    assert not feed.is_avoided(HOLE, now=100.0 + AVOID_S)
    assert HOLE not in feed.avoided  # an expired entry is dropped when read
    for i in range(MAX_AVOIDED + 5):
        feed.avoid(f"tcp://10.0.0.{i}:1", now=float(i))
    assert len(feed.avoided) == MAX_AVOIDED
    assert "tcp://10.0.0.0:1" not in feed.avoided  # the first to expire went first
    feed.joined(ROOT)  # a new join: every relay may be tried again
    assert feed.avoided == {}
    feed.joined("")  # a learner that does not name its own endpoint: nothing is avoided
    feed.avoid(HOLE, now=0.0)
    assert not feed.is_avoided(HOLE, now=0.0)


def test_the_avoided_reason_is_part_of_the_wire_and_a_made_up_one_is_not():
    msg = wire.SourceRequest(worker_id="w", version=1, bad_source=HOLE, reason=AVOIDED)
    assert wire.decode(wire.encode(msg), 1 << 16).reason == AVOIDED
    forged = wire.encode(msg).replace(b"avoided", b"zzzzzzz")
    with pytest.raises(wire.WireError):
        wire.decode(forged, 1 << 16)
