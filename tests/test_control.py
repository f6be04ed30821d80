"""The learner's control plane on real loopback sockets, driven by a hand-written client."""

import asyncio
import math
import random
from dataclasses import replace

import msgpack
import pytest
import zmq
import zmq.asyncio

from echo_rl.broadcast.fetch import fetch_snapshot
from echo_rl.broadcast.snapshot import RunKey, Snapshot, SnapshotError, build_manifest
from echo_rl.broadcast.tickets import Source
from echo_rl.control.parts import Inputs
from echo_rl.control.server import LearnerServer
from echo_rl.control.work import WorkQueue
from echo_rl.core import wire
from echo_rl.core.security import KeyPair, curve_client
from echo_rl.data.adapter import load_adapter
from echo_rl.data.buffer import ReplayBuffer
from echo_rl.data.records import Limits


def control_plane(cfg, tokenizer, options=None, **work_kw) -> LearnerServer:
    """A control plane (not started) for the toy-add task on ``cfg``: with ``options``, the
    adapter's; ``work_kw``, more of the work queue's (affinity)."""
    lc = cfg.learner
    adapter = load_adapter("toy-add", options or {}, tokenizer)
    buffer = ReplayBuffer(lc.staleness, cfg.buffer.capacity_groups, lc.group_size)
    work = WorkQueue(
        adapter.prompts(random.Random(0)),
        group_size=lc.group_size,
        max_outstanding=8,
        lease_timeout_s=30,
        prefix="t",
        **work_kw,
    )
    return LearnerServer(
        cfg,
        Inputs(
            run_id="t",
            key=RunKey.generate(),
            buffer=buffer,
            work=work,
            limits=Limits(24, cfg.worker.max_new_tokens, lc.group_size),
        ),
    )


@pytest.fixture
def plane(small_cfg, tokenizer):
    cp = control_plane(small_cfg, tokenizer)
    cp.start()
    yield cp
    cp.shutdown("test over")


def connect(plane, ctx, endpoint=None, keys=None):
    """A DEALER speaking CURVE to the plane, with its own key pair (its identity)."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.RCVTIMEO, 10_000)
    sock.setsockopt(zmq.LINGER, 0)
    curve_client(sock, keys or KeyPair.generate(), plane.public_key)
    sock.connect(endpoint or plane.endpoint)
    return sock


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


@pytest.fixture
def keys():
    return KeyPair.generate()


@pytest.fixture
def client(plane, ctx, keys):
    return connect(plane, ctx, keys=keys)


def ask(sock, frame):
    """Send, and return the reply (a joined key also gets unsolicited snapshot notices, and a
    quarantined one its final books, a farewell, before the refusal)."""
    sock.send(frame if isinstance(frame, bytes) else wire.encode(frame))
    unsolicited = (wire.SnapshotNotice, wire.Shutdown) + (
        () if isinstance(frame, wire.Leave) else (wire.Farewell,)
    )
    reply = wire.decode(sock.recv(), 1 << 24)
    while isinstance(reply, unsolicited):
        reply = wire.decode(sock.recv(), 1 << 24)
    return reply


def records(group, *, version=0, **patch):
    out = []
    for i in range(group.n):
        r = {
            "group_id": group.group_id,
            "sample_idx": i,
            "prompt_ids": group.prompt_ids,
            "completion_ids": [11, 1],
            "logprobs": [-1.0, -0.5],
            "reward": float(i % 2),
            "version": version,
            "worker_id": "w1",
            "gen_s": 0.01,
        }
        r.update(patch)
        out.append(r)
    return out


def batch(recs, bid="b1"):
    return wire.Trajectories(
        worker_id="w1", batch_id=bid, count=len(recs), payload=wire.pack_records(recs)
    )


def test_junk_is_rejected_and_counted_while_serving_continues(plane, client):
    junk = [
        (b"\x00\xffgarbage", "malformed"),
        (b"x" * (2 * 2**20), "oversize"),  # over the 1 MiB limit, under the socket hard cap
        (msgpack.packb({"v": 42, "type": "join", "worker_id": "w"}), "wrong_version"),
        (msgpack.packb({"v": wire.WIRE_VERSION, "type": "launch_missiles"}), "unknown_type"),
        (wire.WorkRequest(worker_id="stranger", max_groups=1), "not_joined"),
    ]
    for frame, reason in junk:
        reply = ask(client, frame)
        assert isinstance(reply, wire.Error) and reply.reason == reason
    ack = ask(client, wire.Join(worker_id="w1", price=0.35))
    assert isinstance(ack, wire.JoinAck) and len(ack.public_key) == 32
    assert ack.config["group_size"] == 4
    rejected = plane.stats().rejected
    assert {r: rejected[r] for _, r in junk} == {r: 1 for _, r in junk}


def test_trajectories_validated_admitted_once(plane, client):
    ask(client, wire.Join(worker_id="w1"))
    grant = ask(client, wire.WorkRequest(worker_id="w1", max_groups=4))
    g0, g1, g2, g3 = grant.groups
    recs = (
        records(g0)
        + records(g1, completion_ids=[11, 99])  # token id outside the vocabulary
        + records(g2, reward=math.nan)  # NaN reward
        + records(g3, version=5)  # from the future
        + [dict(records(g0)[0], group_id="forged")]
    )  # never handed out
    ack = ask(client, batch(recs))
    assert isinstance(ack, wire.Ack)
    assert ack.accepted == 4 and ack.duplicates == 0
    assert ack.rejected == {
        "out_of_vocab": 4,
        "non_finite_reward": 4,
        "future_version": 4,
        "unknown_group": 1,
    }
    again = ask(client, batch(records(g0), bid="b1-resend"))  # at-least-once delivery
    assert again.accepted == 0 and again.duplicates == 4
    assert plane.buffer.depth().ready_groups == 1
    mismatch = ask(client, batch(records(g1, prompt_ids=[4, 4, 4]), bid="b2"))
    assert mismatch.rejected == {"prompt_mismatch": 4}
    bad_payload = ask(
        client, wire.Trajectories(worker_id="w1", batch_id="b3", count=1, payload=b"zz")
    )
    assert isinstance(bad_payload, wire.Error) and bad_payload.ref == "b3"
    assert plane.buffer.depth().ready_groups == 1  # nothing admitted was lost


def test_one_grant_carries_at_most_a_fair_share_of_the_outstanding_bound(plane, client):
    """Two workers and a bound of 8 groups: a worker asking for 8 (a long link) gets 4, and
    the other still finds work."""
    other = connect(plane, client.context)
    ask(client, wire.Join(worker_id="w1"))
    ask(other, wire.Join(worker_id="w2"))
    assert len(ask(client, wire.WorkRequest(worker_id="w1", max_groups=8)).groups) == 4
    assert len(ask(other, wire.WorkRequest(worker_id="w2", max_groups=8)).groups) == 4


def test_leave_hands_groups_out_again(plane, client):
    ask(client, wire.Join(worker_id="w1"))
    first = ask(client, wire.WorkRequest(worker_id="w1", max_groups=2)).groups
    assert isinstance(ask(client, wire.Leave(worker_id="w1")), wire.Farewell)
    ask(client, wire.Join(worker_id="w2"))
    again = ask(client, wire.WorkRequest(worker_id="w2", max_groups=2)).groups
    assert [g.group_id for g in again] == [g.group_id for g in first]


def test_snapshot_chunks_served_and_verified(plane, client, keys):
    ask(client, wire.Join(worker_id="w1"))  # the learner serves chunks to joined keys only
    payload = bytes(range(256)) * 1000
    m = build_manifest(
        run_id="t",
        version=0,
        tensors=[],
        payload=payload,
        chunk_size=4096,
        dtype="float32",
        key=plane.key,
    )
    plane.publish(Snapshot(m, payload))

    async def fetch(manifest):
        ctx = zmq.asyncio.Context()
        try:
            return await fetch_snapshot(
                ctx,
                manifest,
                Source(plane.snapshot_endpoint, plane.public_key),
                window=4,
                timeout_s=10,
                max_bytes=1 << 20,
                keys=keys,
            )
        finally:
            ctx.term()

    assert bytes(asyncio.run(fetch(m))) == payload
    assert plane.stats().learner_bytes_sent == len(payload)
    forged = replace(m, chunk_hashes=(b"\0" * 32, *m.chunk_hashes[1:]))
    with pytest.raises(SnapshotError, match="corrupt"):
        asyncio.run(fetch(forged))


def test_chunk_server_survives_requesters_that_vanish(plane, ctx):
    payload = bytes(200_000)
    m = build_manifest(
        run_id="t",
        version=0,
        tensors=[],
        payload=payload,
        chunk_size=1000,
        dtype="float32",
        key=plane.key,
    )
    plane.publish(Snapshot(m, payload))
    for n in range(5):  # ask for every chunk, then close without reading a single reply
        k = KeyPair.generate()
        ask(connect(plane, ctx, keys=k), wire.Join(worker_id=f"gone{n}"))
        s = connect(plane, ctx, plane.snapshot_endpoint, keys=k)
        for i in range(200):
            s.send(wire.encode(wire.ChunkRequest(version=0, index=i, rid=i + 1)))
        s.close(linger=-1)
    k = KeyPair.generate()
    ask(connect(plane, ctx, keys=k), wire.Join(worker_id="live"))
    live = connect(plane, ctx, plane.snapshot_endpoint, keys=k)
    live.send(wire.encode(wire.ChunkRequest(version=0, index=3, rid=99)))
    header, data = live.recv_multipart()
    assert wire.decode(header, 1 << 20).rid == 99 and len(data) == 1000
    assert plane.stats().sessions == 6  # the control plane is alive too


def test_keyframes_from_the_learner_and_refusals_for_versions_gone(plane, client, keys):
    """A worker without a delta's base asks where to fetch the version in full: with no peer
    holding it, the learner serves the rebuilt payload itself (form "full", checked against the
    signed result hashes); a version no longer held is refused at once, for either form."""
    from echo_rl.broadcast.relay import Relay, RelayConfig
    from echo_rl.broadcast.versions import VersionEncoder

    ask(client, wire.Join(worker_id="w1"))
    enc = VersionEncoder(run_id="t", key=plane.key, chunk_size=4096, dtype="uint8")
    tensors = [{"name": "w", "dtype": "uint8", "shape": [50_000], "offset": 0, "nbytes": 50_000}]
    base = bytes(range(250)) * 200
    new = bytearray(base)
    new[123] ^= 1
    for version, full in enumerate((base, bytes(new))):
        pub = enc.build(version, tensors, full)
        plane.publish(Snapshot(pub.manifest, pub.payload, pub.result))
    assert pub.manifest.encoding == "delta"
    grant = ask(
        client,
        wire.SourceRequest(worker_id="w1", version=1, bad_source="", reason="no_base", form="full"),
    )
    assert isinstance(grant, wire.SourceGrant) and grant.source == plane.snapshot_endpoint

    async def fetch():
        ctx = zmq.asyncio.Context()
        relay = Relay(ctx, RelayConfig(serve=False), keys=keys)
        try:
            return await relay.receive_keyframe(
                pub.manifest, Source(grant.source, grant.source_key, grant.ticket), None
            )
        finally:
            relay.close()
            ctx.term()

    result, _ = asyncio.run(fetch())
    assert bytes(result) == bytes(new)
    for form in ("payload", "full"):
        gone = ask(
            client,
            wire.SourceRequest(
                worker_id="w1", version=99, bad_source="x", reason="refused", form=form
            ),
        )
        assert isinstance(gone, wire.Error) and gone.reason == "unknown_version"


def test_a_slow_disk_delays_only_the_acknowledgement_not_the_loop(
    small_cfg, tokenizer, tmp_path, ctx, keys
):
    """Group commit: the batch's records go to the write-ahead log's writer thread; the loop
    answers a heartbeat sent after the batch while the fsync is still sleeping, and the batch
    is acknowledged only once its records are on disk (and readable back from the log)."""
    from echo_rl.data.durable import read_log
    from labs.doubles import SlowDiskLog

    lc = small_cfg.learner
    adapter = load_adapter("toy-add", {}, tokenizer)
    log = SlowDiskLog(tmp_path / "buffer.log", fsync=True, delay_s=1.0)
    cp = LearnerServer(
        small_cfg,
        Inputs(
            run_id="t",
            key=RunKey.generate(),
            buffer=ReplayBuffer(lc.staleness, small_cfg.buffer.capacity_groups, lc.group_size),
            work=WorkQueue(
                adapter.prompts(random.Random(0)),
                group_size=lc.group_size,
                max_outstanding=8,
                lease_timeout_s=30,
                prefix="t",
            ),
            limits=Limits(24, small_cfg.worker.max_new_tokens, lc.group_size),
            buffer_log=log,
        ),
    )
    cp.start()
    try:
        client = connect(cp, ctx, keys=keys)
        ask(client, wire.Join(worker_id="w1"))
        group = ask(client, wire.WorkRequest(worker_id="w1", max_groups=1)).groups[0]
        commits = log.commits
        client.send(wire.encode(batch(records(group))))
        client.send(wire.encode(wire.Heartbeat(worker_id="w1", version=0)))
        order = []
        while len(order) < 2:
            msg = wire.decode(client.recv(), 1 << 24)
            if isinstance(msg, (wire.HeartbeatAck, wire.Ack)):
                order.append(type(msg).__name__)
                if isinstance(msg, wire.Ack):
                    assert msg.accepted == 4 and log.commits > commits  # durable first
        assert order == ["HeartbeatAck", "Ack"]
        assert {r.group_id for r in read_log(tmp_path / "buffer.log")[0]} == {group.group_id}
    finally:
        cp.shutdown("test over")
        log.close()


def test_group_commit_makes_many_appends_durable_in_few_fsyncs(tmp_path):
    import threading

    from echo_rl.data.durable import read_log
    from echo_rl.data.records import Record
    from labs.doubles import SlowDiskLog

    log = SlowDiskLog(tmp_path / "buffer.log", fsync=True, delay_s=0.05)
    futures, lock = [], threading.Lock()

    def append(k: int) -> None:
        for j in range(10):
            rec = Record(
                group_id=f"g{k}-{j}",
                sample_idx=0,
                prompt_ids=[3, 4],
                completion_ids=[11, 1],
                logprobs=[-1.0, -0.5],
                reward=1.0,
                version=0,
                worker_id="w1",
                gen_s=0.01,
            )
            f = log.admitted([rec])
            with lock:
                futures.append(f)

    threads = [threading.Thread(target=append, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for f in futures:
        f.result(timeout=30)
    log.close()
    assert len(futures) == 80 and log.commits < 40  # grouped: far fewer fsyncs than appends
    assert len({r.group_id for r in read_log(tmp_path / "buffer.log")[0]}) == 80


def test_a_cancelled_waiter_does_not_kill_the_log_writer(tmp_path):
    """An acknowledgement task cancelled at shutdown cancels its durable future; the writer used
    to die setting it, and the learner's own next append then waited forever (a hung exit)."""
    from echo_rl.data.durable import read_log
    from echo_rl.data.records import Record
    from labs.doubles import SlowDiskLog

    def rec(g: str) -> Record:
        return Record(
            group_id=g,
            sample_idx=0,
            prompt_ids=[3, 4],
            completion_ids=[11, 1],
            logprobs=[-1.0, -0.5],
            reward=1.0,
            version=0,
            worker_id="w1",
            gen_s=0.01,
        )

    log = SlowDiskLog(tmp_path / "buffer.log", fsync=True, delay_s=0.2)
    first = log.admitted([rec("g1")])  # the writer is now inside a 0.2 s fsync with it
    assert first.cancel()
    second = log.admitted([rec("g2")])
    second.result(timeout=10)  # the writer lives on
    log.consumed(1, ["g2"]).result(timeout=10)
    log.close()
    assert {r.group_id for r in read_log(tmp_path / "buffer.log")[0]} == {"g1", "g2"}


def test_a_checkpoint_reads_the_leases_on_the_loop_that_grants_them(plane, client):
    """The trainer's checkpoint takes the work queue's leases through the control loop: read
    from the trainer's thread, a grant meanwhile changed the dict under it and ended a run."""
    import threading

    ask(client, wire.Join(worker_id="w1", price=0.1))
    grant = ask(client, wire.WorkRequest(worker_id="w1", max_groups=1))
    assert isinstance(grant, wire.WorkGrant) and grant.groups
    seen: list[str] = []
    real = plane.work.state
    plane.work.state = lambda: seen.append(threading.current_thread().name) or real()
    rng = random.Random(7)
    work, rng_state = plane.work_state(rng)
    assert seen == [plane._thread.name] and seen[0] != threading.current_thread().name
    assert [g["group_id"] for g in work["issued"]] == [g.group_id for g in grant.groups]
    assert rng_state == random.Random(7).getstate()


def test_a_large_fleet_is_told_a_longer_heartbeat_period_and_given_longer_to_beat(
    small_cfg, tokenizer, ctx
):
    """transport.heartbeats_per_s bounds the fleet's heartbeats (docs/scale.md): past it, each
    worker is told period = fleet size / budget, at join and in every heartbeat reply, and is
    removed only after as many missed beats as before."""
    small_cfg.worker.heartbeat_s, small_cfg.transport.heartbeats_per_s = 0.5, 1.0
    cp = control_plane(small_cfg, tokenizer)
    cp.start()
    try:
        first, second, third = (connect(cp, ctx) for _ in range(3))
        assert (
            ask(first, wire.Join(worker_id="w1", price=0.1)).config["worker"]["heartbeat_s"] == 1.0
        )
        ask(second, wire.Join(worker_id="w2", price=0.1))
        assert ask(second, wire.Heartbeat(worker_id="w2", version=0)).heartbeat_s == 2.0
        joined = ask(third, wire.Join(worker_id="w3", price=0.1))
        assert joined.config["worker"]["heartbeat_s"] == 3.0  # three workers, one beat a second
        assert ask(first, wire.Heartbeat(worker_id="w1", version=0)).heartbeat_s == 3.0
        w1 = cp.table.workers["w1"]
        # five missed beats, as at the configured period: 5.0 s at 0.5 s, 30 s at 3 s
        assert cp.table.timeout(w1) == small_cfg.transport.heartbeat_timeout_s * 6
        small_cfg.transport.heartbeats_per_s = 0  # off: the configured period, whatever the size
        assert ask(first, wire.Heartbeat(worker_id="w1", version=0)).heartbeat_s == 0.5
        assert cp.table.timeout(w1) == small_cfg.transport.heartbeat_timeout_s
    finally:
        cp.shutdown("test over")


def test_a_heartbeat_s_sharing_fields_out_of_bounds_are_refused_and_counted(plane, client):
    """A stranger's heartbeat claiming its device serves 0, a billion or "two" runs: refused
    by the decoder (counted), the session and the server go on; a valid one is kept and
    answered with the run's need (docs/multirun.md)."""
    ack = ask(client, wire.Join(worker_id="w1", price=0.35))
    assert isinstance(ack, wire.JoinAck)
    beat = wire.Heartbeat(worker_id="w1", version=-1).model_dump(mode="json")
    bad = [{"runs": 0}, {"runs": 10**9}, {"runs": "two"}, {"resident": {"x": 1}}]
    before = sum(plane.stats().rejected.values())
    for patch in bad:
        frame = msgpack.packb({"v": wire.WIRE_VERSION, "type": "heartbeat", **beat, **patch})
        reply = ask(client, frame)
        assert isinstance(reply, wire.Error), (patch, reply)
    assert sum(plane.stats().rejected.values()) == before + len(bad)
    reply = ask(client, wire.Heartbeat(worker_id="w1", version=-1, runs=2, resident=False))
    assert isinstance(reply, wire.HeartbeatAck) and 0 <= reply.need <= 1000
