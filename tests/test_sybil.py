"""Sybils inside the documented limits (issue 31, item 5; docs/security.md, "Sybils"): joins
cost the learner O(1) and nothing per publication until a key does something useful, one host
brings new keys at its prefix's budget, and the trainer's calls into the control loop neither
starve behind a message backlog nor end the run when the loop is slow."""

import asyncio
import threading

import pytest
import zmq
from test_security import JUNK, _plane, ask, eventually, peer, zctx  # noqa: F401 (fixture)

from echo_rl.broadcast.snapshot import Snapshot, build_manifest
from echo_rl.control import listen as listen_mod
from echo_rl.control import server as server_mod
from echo_rl.control.gate import Gate
from echo_rl.core import wire
from echo_rl.core.config import SecurityConfig
from echo_rl.core.security import KeyPair

pytestmark = pytest.mark.timeout(60)


def _publish(plane, version):
    payload = bytes(range(256)) * 64
    m = build_manifest(
        run_id="t",
        version=version,
        tensors=[],
        payload=payload,
        chunk_size=4096,
        dtype="float32",
        key=plane.key,
    )
    plane.publish(Snapshot(m, payload))


def _on_loop(plane, fn):
    """Run ``fn()`` on the plane's loop (its handlers are loop-only) and return its result."""

    async def call():
        return fn()

    return plane._call(call)


@pytest.fixture
def started(small_cfg, tokenizer, tmp_path):
    planes = []

    def make(provisioning=False, **security):
        cfg = small_cfg.model_copy(deep=True)
        cfg.provisioning.enabled = provisioning
        for k, v in security.items():
            setattr(cfg.security, k, v)
        plane = _plane(cfg, tokenizer, tmp_path / f"run{len(planes)}")
        plane.start()
        planes.append(plane)
        return plane

    yield make
    for plane in planes:
        plane.shutdown("test over")


def _sybil_joins(plane, n, relay=True):
    """``n`` joins from distinct keys, handled as the loop would, each with its own reply."""

    def joins():
        return [
            plane.members.on_join(
                b"s%d" % i,
                f"{i:040d}",
                wire.Join(
                    worker_id=f"sybil{i}",
                    relay_endpoint=f"tcp://10.1.{i // 200}.{i % 200}:7000" if relay else "",
                    can_relay=relay,
                ),
            )
            for i in range(n)
        ]

    return _on_loop(plane, joins)


# ----------------------------------------------------------------------------- join cost


def test_a_join_never_replans_the_broadcast(started, monkeypatch):
    """Each join used to re-plan the whole fleet (O(n) each, O(n^2) for a flood: 22 ms a join
    at 1,000 workers here); a join now costs O(1), and the joiner pulls from the learner
    until the next publication's plan places it, as a tail."""
    plane = started(max_workers=4096, joins_per_s=1e6)
    _publish(plane, 0)
    plans = []
    real = plane.coordinator._plan
    monkeypatch.setattr(plane.coordinator, "_plan", lambda: plans.append(1) or real())
    acks = _sybil_joins(plane, 300)
    assert all(isinstance(a, wire.JoinAck) for a in acks)
    assert plans == []
    assert {a.snapshot_endpoint for a in acks} == {plane.snapshot_endpoint}
    # a pending key is planned as a tail: it asked to relay, it parents nobody
    assert all(plane.coordinator.peers[f"sybil{i}"].endpoint == "" for i in range(300))
    _publish(plane, 1)
    assert len(plans) == 1  # one plan per publication, whatever joined meanwhile


def test_idle_keys_are_pending_and_a_publication_tells_members_first(started):
    """300 keys join and idle; one worker installs the snapshot. Only the worker is a
    member (in the provisioner, a relay candidate); a publication sends at most
    ``notices_per_publication`` notices, the member's first; the rest learn the version from
    their next heartbeat reply."""
    plane = started(provisioning=True, max_workers=4096, joins_per_s=1e6, notices_per_publication=8)
    _publish(plane, 0)
    _sybil_joins(plane, 300)

    async def honest_installs():  # the honest worker joins and reports its install
        plane.members.on_join(
            b"h", "H" * 40, wire.Join(worker_id="honest", relay_endpoint="tcp://10.9.9.9:1")
        )
        await plane.parts.dispatcher.dispatch(
            b"h", "H" * 40, wire.Installed(worker_id="honest", version=0)
        )

    plane._call(honest_installs)
    members = _on_loop(
        plane, lambda: [w.worker_id for w in plane.table.workers.values() if w.member]
    )
    assert members == ["honest"]
    registered = _on_loop(plane, lambda: {w.worker_id for w in plane.members.controller.workers()})
    assert registered == {"honest"}
    assert plane.coordinator.peers["honest"].endpoint == "tcp://10.9.9.9:1"
    _publish(plane, 1)
    assert eventually(lambda: plane.stats().notices.get("sent") == 8)
    stats = plane.stats()
    assert stats.notices["deferred"] == 301 - 8 and stats.pending_workers == 300
    assert _on_loop(plane, lambda: plane.table.workers["honest"].noticed) == 1
    # a pending key's heartbeat reply offers the new version, from the plan (no re-plan)
    hb = _on_loop(
        plane,
        lambda: plane.members.on_heartbeat(
            b"s0", f"{0:040d}", wire.Heartbeat(worker_id="sybil0", version=0)
        ),
    )
    assert hb.version == 1 and hb.manifest is not None and hb.ticket


# ----------------------------------------------------------------------------- the loop


class _Backlog:
    """A ROUTER with ``n`` junk messages already queued: each receive completes at once, as
    pyzmq's does when a message is waiting (an ``await`` then does not suspend)."""

    def __init__(self, n, call):
        self.left, self.served, self.call = n, 0, call
        self.done = asyncio.Event()

    async def recv_multipart(self, copy=False):
        if self.left == 0:
            self.done.set()
            await asyncio.Event().wait()  # nothing more: wait forever (cancelled)
        if self.served == 1:  # the trainer's call arrives while the backlog is served
            asyncio.get_running_loop().call_soon(self.call)
        self.left -= 1
        self.served += 1
        return [zmq.Frame(b"peer"), zmq.Frame(JUNK)]

    async def send_multipart(self, frames, flags=0):
        return None


def test_a_message_backlog_does_not_starve_the_trainers_calls(small_cfg, tokenizer, tmp_path):
    """1,000 queued messages: the trainer's call (publish, stats) used to run after all of
    them (the serve loop never suspended while messages were waiting; with 1,000 Sybil joins
    at 22 ms each that is the 30 s the snapshot publisher timed out after). It now runs after
    at most SERVE_BURST cheap ones (or SERVE_SLICE_S of dear ones)."""
    plane = _plane(small_cfg, tokenizer, tmp_path)

    async def main():
        ran_at = []
        backlog = _Backlog(1000, lambda: ran_at.append(backlog.served))
        plane.parts.socket.sock = backlog
        serving = asyncio.create_task(plane.parts.socket.serve(backlog, plane.parts.dispatcher))
        await backlog.done.wait()
        serving.cancel()
        return ran_at[0], backlog.served

    ran_at, served = asyncio.run(main())
    assert served == 1000 and ran_at <= listen_mod.SERVE_BURST + 2


def test_a_slow_loop_delays_publish_and_stats_but_never_ends_the_run(started, monkeypatch):
    """The loop held (as by a long handler): publish and stats used to raise after 30 s and
    end the learner, telling the workers "run complete". Now each goes on (counted), and the
    version is stored when the loop gets to it."""
    plane = started()
    monkeypatch.setattr(server_mod, "LOOP_WAIT_S", 0.2)
    first = plane.stats()
    hold, held = threading.Event(), threading.Event()
    plane._loop.call_soon_threadsafe(lambda: (held.set(), hold.wait(30)))
    assert held.wait(10)
    _publish(plane, 0)  # does not raise
    stats = plane.stats()  # does not raise: the last statistics
    assert stats.slow == {"publish_slow": 1, "stats_slow": 1}
    assert stats.sessions == first.sessions
    hold.set()
    assert eventually(lambda: plane.stats().slow and plane.store.latest() is not None)
    assert plane.store.latest().version == 0


# ----------------------------------------------------------------------------- one host


def test_newcomers_are_budgeted_per_ip_prefix(tmp_path):
    gate = Gate(SecurityConfig(newcomers_per_s_per_prefix=1e-6, newcomer_burst=3), tmp_path)
    assert [gate.newcomer(f"203.0.113.{i}") for i in range(4)] == ["", "", "", "rate_limited"]
    assert gate.newcomer("203.0.114.1") == ""  # another /24
    assert gate.prefix("2001:db8:1:2::1") == gate.prefix("2001:db8:1:ffff::9") == "2001:db8:1::/48"
    assert gate.refused == {"newcomer_limited": 1}


def test_one_host_brings_keys_at_its_budget_and_joined_keys_reconnect(started, zctx):
    """Past its prefix's burst, a fresh key from the same host gets no session (refused at the
    handshake, try later); a key that already joined reconnects from there freely."""
    plane = started(newcomers_per_s_per_prefix=1e-6, newcomer_burst=2)
    keys = [KeyPair.generate() for _ in range(3)]
    for i in (0, 1):
        assert isinstance(
            ask(peer(plane, zctx, keys[i]), wire.Join(worker_id=f"w{i}")), wire.JoinAck
        )
    late = peer(plane, zctx, keys[2], timeout_ms=1000)
    late.send(wire.encode(wire.Join(worker_id="w2")))
    with pytest.raises(zmq.Again):
        late.recv()
    assert plane.stats().join_refused.get("newcomer_limited", 0) >= 1
    again = peer(plane, zctx, keys[0])  # a new connection of a joined key
    assert isinstance(ask(again, wire.Heartbeat(worker_id="w0", version=-1)), wire.HeartbeatAck)
    assert plane.stats().sessions == 2
