"""The worker's parts, each run alone against in-memory doubles (issue 34): the session
(join, notices, bans), deliveries (at least once, the ledger), generation (a rollout queued or
handed back, grant sizing), the installer (what a join resets, an install) and the lifecycle
(the stop and its budget, the owner's yield)."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
from worker_doubles import VIEW, ScriptedClient, make_generation, make_session, scripted_backend

from echo_rl.broadcast.snapshot import RunKey, build_manifest
from echo_rl.broadcast.tickets import Source
from echo_rl.core import wire
from echo_rl.core.client import RequestTimeout
from echo_rl.worker.backends import Sample
from echo_rl.worker.delivery import Deliveries
from echo_rl.worker.install import Installer, check_base
from echo_rl.worker.lifecycle import STOP_S, Activity, Lifecycle, watch_owner
from echo_rl.worker.model import LoadChoice
from echo_rl.worker.session import SessionHooks, WorkerError
from echo_rl.worker.status import InstallProgress, StatusBoard

KEY = RunKey.from_bytes(bytes(32))
MANIFEST = build_manifest(
    run_id="r1", version=5, tensors=[], payload=bytes(40), chunk_size=16, dtype="bfloat16", key=KEY
)


def _ack(**kw) -> wire.JoinAck:
    fields = dict(
        run_id="r1",
        instance_id="i1",
        public_key=KEY.public_bytes,
        version=-1,
        config=VIEW,
        snapshot_endpoint="",
    )
    return wire.JoinAck(**{**fields, **kw})


# ------------------------------------------------------------------ session


def test_session_retries_a_busy_learner_then_joins_and_says_what_changed(monkeypatch):
    monkeypatch.setattr("echo_rl.worker.session.JOIN_BACKOFF_S", 0.001)
    answers = iter(
        [
            wire.Error(reason="rate_limited", detail="slow down"),
            _ack(worker_id="w-kept"),
            _ack(instance_id="i2"),
        ]
    )
    joins = []
    hooks = SessionHooks(
        joined=lambda ack, restarted, new_run: joins.append((restarted, new_run)),
        offer=lambda *a: None,
        punch=lambda m: None,
        beat=lambda w: None,
    )
    client = ScriptedClient(lambda msg: next(answers))
    s = make_session(client, hooks=hooks)

    async def go():
        await s.join()
        assert s.busy.attempts == 0  # the refusal's back-off starts again from its base
        await s.join()  # the learner restarted: a new instance, the same run

    asyncio.run(go())
    assert joins == [(False, True), (True, False)]
    assert s.worker_id == "w-kept" and s.run_id == "r1" and s.instance_id == "i2"
    assert client.max_bytes == 8 * 2**20 and s.status.doc.run_id == "r1"
    assert all(isinstance(m, wire.Join) for m in client.sent) and len(client.sent) == 3


def test_a_ban_on_join_ends_the_worker_and_the_status_says_quarantined():
    s = make_session(
        ScriptedClient(lambda msg: wire.Error(reason="banned", detail="by the operator"))
    )
    with pytest.raises(WorkerError, match="banned this worker's key: by the operator"):
        asyncio.run(s.join())
    assert s.status.doc.account.state == "quarantined"


def test_notices_offer_snapshots_and_a_shutdown_stops():
    offered = []
    hooks = SessionHooks(
        joined=lambda *a: None,
        offer=lambda v, m, src: offered.append((v, src.endpoint)),
        punch=lambda m: None,
        beat=lambda w: None,
    )
    s = make_session(ScriptedClient(lambda msg: None), hooks=hooks)

    async def go():
        s.client.notices.put_nowait(wire.SnapshotNotice(version=4, manifest={}, source="tcp://p:1"))
        s.client.notices.put_nowait(wire.Shutdown(reason="done"))
        task = asyncio.create_task(s.notices())
        await asyncio.wait_for(s.life.stopping.wait(), 5)
        task.cancel()

    asyncio.run(go())
    assert offered == [(4, "tcp://p:1")] and s.life.exit_reason == "learner shut down: done"


# ------------------------------------------------------------------ deliveries


def _batch(batch_id: str, count: int = 2) -> wire.Trajectories:
    return wire.Trajectories(worker_id="w0", batch_id=batch_id, count=count, payload=b"x")


def test_a_batch_is_resent_until_acknowledged_and_the_ledger_keeps_what_was_stored(tmp_path):
    replies = iter(
        [
            RequestTimeout("lost"),
            wire.Ack(
                batch_id="b1", accepted=1, duplicates=0, rejected={"stale": 1}, rejected_idx=[1]
            ),
        ]
    )
    client = ScriptedClient(lambda msg: next(replies))
    d = Deliveries(
        client, lambda: 1.0, lambda detail: WorkerError(detail), str(tmp_path / "ledger")
    )
    d.add(_batch("b1"), ["g0"], [["g0", 0], ["g0", 1]])
    assert d.holding() == ["g0"] and len(d) == 1

    async def go():
        task = asyncio.create_task(d.run())
        await d.drain(5.0)
        task.cancel()

    asyncio.run(go())
    assert len(d) == 0 and d.holding() == [] and d.delivered == 2 and len(client.sent) == 2
    line = json.loads((tmp_path / "ledger").read_text())
    assert line == {"batch_id": "b1", "stored": [["g0", 0]], "rejected": {"stale": 1}}


def test_a_ban_met_by_a_delivery_ends_it():
    d = Deliveries(
        ScriptedClient(lambda msg: wire.Error(reason="banned", detail="no")),
        lambda: 1.0,
        lambda detail: WorkerError(f"banned: {detail}"),
    )
    with pytest.raises(WorkerError, match="banned: no"):
        asyncio.run(d._attempt(_batch("b1")))


def test_a_refused_delivery_backs_off_with_jitter_and_starts_again_after_a_reply(monkeypatch):
    """A learner that answers "rate_limited" to a crowd: each resend waits longer (jittered,
    echo_rl.core.retry), and the first real reply resets the back-off."""
    import echo_rl.worker.delivery as delivery

    slept: list[float] = []

    async def no_wait(s: float) -> None:
        slept.append(s)

    monkeypatch.setattr(delivery.asyncio, "sleep", no_wait)
    replies = iter([wire.Error(reason="rate_limited", detail="slow down")] * 3 + [None])
    d = Deliveries(
        ScriptedClient(
            lambda msg: next(replies) or wire.Ack(batch_id="b1", accepted=2, duplicates=0)
        ),
        lambda: 1.0,
        lambda detail: WorkerError(detail),
    )
    for _ in range(3):
        assert asyncio.run(d._attempt(_batch("b1"))) is None
    assert len(slept) == 3
    assert all(p / 2 <= s <= p for s, p in zip(slept, (0.5, 1.0, 2.0), strict=True))
    assert d.refused.attempts == 3
    assert isinstance(asyncio.run(d._attempt(_batch("b1"))), wire.Ack)
    assert d.refused.attempts == 0


# ------------------------------------------------------------------ generation

ADAPTER = SimpleNamespace(reward=lambda task, ids, text: float(len(ids)))
GROUPS = [wire.Group(group_id=f"g{i}", prompt_ids=[1, 2], n=2, seed=i) for i in range(2)]


def test_a_rollout_queues_one_batch_with_the_installed_version():
    g = make_generation(ScriptedClient(lambda msg: None), scripted_backend([[5, 2], [7]]), ADAPTER)
    assert asyncio.run(g.rollout(GROUPS)) is True
    (batch,) = g.deliveries.unacked.values()
    records = wire.unpack_records(batch.payload, 2**20)
    assert [(r["group_id"], r["sample_idx"], r["reward"], r["version"]) for r in records] == [
        ("g0", 0, 2.0, 3),
        ("g0", 1, 1.0, 3),
        ("g1", 0, 2.0, 3),
        ("g1", 1, 1.0, 3),
    ]
    assert g.deliveries.holding() == ["g0", "g1"] and g.generating == []
    assert g.status.doc.groups_generated == 2 and g.activity.state == "idle"
    assert g.rollout_s > 0 and g.group_s == pytest.approx(g.rollout_s / 2)


def test_cut_samples_go_back_as_prefixes_and_nothing_is_queued():
    client = ScriptedClient(lambda msg: wire.HandbackAck(groups=2, prefixes=4))
    backend = scripted_backend([[5, 2]])
    backend.generate = lambda groups, n, t, stop=None: [
        [Sample([5], [-0.5], finished=False) for _ in range(g.n)] for g in groups
    ]
    g = make_generation(client, backend, ADAPTER)
    g.life.cut.set()  # preempted while generating
    assert asyncio.run(g.rollout(GROUPS)) is False
    (msg,) = client.sent
    assert (
        isinstance(msg, wire.Handback) and msg.groups == ["g0", "g1"] and msg.reason == "preempted"
    )
    assert [p.versions for p in msg.prefixes["g0"]] == [[[3, 1]], [[3, 1]]]
    assert len(g.deliveries) == 0 and g.status.doc.handed_back_tokens == 4


def test_a_tail_cut_delivers_the_groups_that_ended_and_carries_the_others():
    """Long-tail cut (docs/scheduling.md): no preemption, one group still running: the ended
    group is queued for delivery, the other is carried (leased, listed as held) into the next
    rollout with what it holds as prefixes, and continued there to its end."""
    client = ScriptedClient(lambda msg: wire.WorkGrant(groups=[]))
    backend = scripted_backend([[5, 2]])
    calls = []

    def generate(groups, n, t, stop=None, tail=0.0):
        calls.append((tail, [g.group_id for g in groups], [len(g.prefixes) for g in groups]))
        if len(calls) == 1:
            return [
                [Sample([5, 2], [-0.5, -0.1]), Sample([5, 2], [-0.4, -0.2])],
                [Sample([5, 2], [-0.5, -0.1]), Sample([5, 5], [-0.3, -0.3], finished=False)],
            ]
        return [
            [
                Sample([5, 2], [-0.5, -0.1], prefix_len=2),
                Sample([5, 5, 2], [-0.3] * 3, prefix_len=2),
            ]
        ]

    backend.generate = generate
    g = make_generation(client, backend, ADAPTER)
    view = g.session.view  # shared with other tests: changed in a copy
    g.session.view = {**view, "worker": {**view["worker"], "tail_cut": 0.5}}
    assert asyncio.run(g.rollout(GROUPS)) is True
    assert client.sent == [] and g.deliveries.holding() == ["g0"]
    assert g.carry.ids() == ["g1"] and g.status.doc.tail_groups == 1
    assert [p.ids for p in g.carry.groups[0].prefixes] == [[5, 2], [5, 5]]
    asyncio.run(g.request_work())  # the carried group is listed as held: not re-granted
    assert client.sent[-1].holding == ["g0", "g1"]
    assert asyncio.run(g.rollout(g.carry.take())) is True
    assert calls[1] == (0.5, ["g1"], [2]) and g.deliveries.holding() == ["g0", "g1"]


def test_grants_grow_until_a_rollout_outlasts_the_round_trip():
    g = make_generation(ScriptedClient(lambda msg: None))
    assert g.grant_size() == 2  # nothing measured yet
    g.rtt_avg.value, g.group_avg.value = 1.0, 0.1  # a round trip of five grants' generation
    assert g.grant_size() == 2 * 5 and g.prefetch_pays() is True
    g.rtt_avg.value = 100.0
    assert g.grant_size() == 2 * 8  # at most MAX_GRANT_SCALE


def test_a_refused_work_request_rejoins_and_a_ban_ends_the_worker():
    answers = {"work": wire.Error(reason="not_joined", detail=""), "join": _ack()}
    client = ScriptedClient(lambda m: answers["join" if isinstance(m, wire.Join) else "work"])
    g = make_generation(client)
    assert asyncio.run(g.request_work()) == []
    assert [type(m).__name__ for m in client.sent] == ["WorkRequest", "Join"]
    answers["work"] = wire.Error(reason="banned", detail="no")
    with pytest.raises(WorkerError, match="banned"):
        asyncio.run(g.request_work())


# ------------------------------------------------------------------ installer


class _Relay:
    def __init__(self):
        self.resets, self.store = 0, SimpleNamespace(newest_version=-1, get=lambda v: None)

    def reset(self):
        self.resets += 1


def _installer() -> tuple[Installer, _Relay]:
    relay = _Relay()
    session = make_session(ScriptedClient(lambda m: None))
    inst = Installer(
        session,
        relay,
        status=session.status,
        activity=Activity(),  # type: ignore[arg-type]
        progress=InstallProgress(),
        choice=LoadChoice(),
    )
    session.public_key = KEY.public_bytes  # as the join that precedes ``joined`` sets it
    return inst, relay


def test_a_join_to_another_run_forgets_what_is_held_and_offers_the_named_version():
    inst, relay = _installer()
    inst.held.version = 7
    inst.joined(_ack(version=5, manifest=MANIFEST.to_wire()), restarted=False, new_run=False)
    assert inst.held.version == -1 and relay.resets == 1  # went back in versions: reset
    assert sorted(inst.feed.pending) == [5] and inst.version_bytes == (40, "bfloat16")
    assert inst.feed.pending[5][0] == MANIFEST  # verified once, kept as the declared type
    inst.held.version = 5
    inst.joined(_ack(version=6, manifest=MANIFEST.to_wire()), restarted=False, new_run=False)
    assert inst.held.version == 5 and relay.resets == 1  # the same run, further on: kept


def test_a_manifest_that_fails_its_signature_is_never_fetched():
    inst, _ = _installer()
    forged = {**MANIFEST.to_wire(), "version": 9}  # tampered on purpose
    inst.offer(9, forged, Source("tcp://peer:1"))
    inst.offer(9, {"version": 9}, Source("tcp://peer:1"))  # malformed on purpose
    assert inst.feed.pending == {}
    inst.offer(5, MANIFEST.to_wire(), Source("tcp://peer:1"))
    assert sorted(inst.feed.pending) == [5]


def test_an_install_loads_the_ready_version_and_says_so():
    inst, _ = _installer()
    installed = []
    inst.held.backend = SimpleNamespace(
        base_hash=None, install=lambda tensors, result, v: installed.append(v)
    )
    inst.feed.ready = (5, MANIFEST, b"payload")
    asyncio.run(inst.ensure_installed())
    assert installed == [5] and inst.held.version == 5 and inst.activity.state == "idle"
    assert inst.status.doc.installed_version == 5


def test_a_lora_version_for_another_base_is_fatal():
    backend = SimpleNamespace(base_hash="a" * 64)
    check_base(SimpleNamespace(version=3, base_model="a" * 64), backend, "models/base")
    with pytest.raises(WorkerError):
        check_base(SimpleNamespace(version=3, base_model="b" * 64), backend, "models/base")


# ------------------------------------------------------------------ lifecycle


def test_a_signal_cuts_and_the_budget_runs_from_it():
    clock = SimpleNamespace(t=10.0)
    life = Lifecycle(lambda: "w0", migrate=True, clock=lambda: clock.t)
    life.loaded = True
    assert life.left(1.0) == STOP_S - 1.0  # no stop yet: the whole budget
    life.stop("signal SIGTERM")
    life.stop("later reason")  # the first reason stays
    clock.t = 11.0
    assert life.cut.is_set() and life.exit_reason == "signal SIGTERM"
    assert life.left(1.0) == pytest.approx(STOP_S - 2.0)
    quiet = Lifecycle(lambda: "w0", migrate=True)
    quiet.loaded = True
    quiet.stop("learner shut down: done")
    assert not quiet.cut.is_set()  # nothing to hand back to a learner that is gone


def test_the_owner_s_work_yields_the_machine_until_it_is_quiet():
    life, activity = Lifecycle(lambda: "w0"), Activity()
    status = StatusBoard("w0", "tcp://x:1", 0.0, None)
    looks = iter([True, False, False])

    class Owner:
        quiet_s, period_s = 1.0, 0.0

        def busy(self):
            busy = next(looks, False)
            if not busy and not life.cut.is_set():
                life.stop("done")
            return busy

        def quiet_for(self):
            return 2.0

        def describe(self):
            return "a test"

    seen = []

    async def go():
        task = asyncio.create_task(watch_owner(Owner(), life, activity, status))
        while not task.done():
            seen.append((life.yielded, activity.state))
            await asyncio.sleep(0)

    asyncio.run(go())
    assert (True, "yielded") in seen and (life.yielded, activity.state) == (False, "idle")
    assert status.doc.yielded_at is not None


# ------------------------------------------------------------------ relay node


def test_the_relay_node_offers_its_endpoint_takes_the_learner_s_tuning_and_names_a_taken_port():
    import zmq.asyncio

    from echo_rl.broadcast.relay import RelayConfig
    from echo_rl.worker.relaying import RelayNode

    ctx = zmq.asyncio.Context()
    node = RelayNode(ctx, RelayConfig(down_mbit=8.0), keys=None, run_key=lambda: b"")
    try:
        offer = node.offer()
        assert offer.endpoint.startswith("tcp://127.0.0.1:") and offer.down_mbit == 8.0
        node.tune(
            {
                "broadcast": {"window": 9, "timeout_s": 3.0},
                "security": {"max_parked_per_peer": 5, "max_parked_total": 50},
            }
        )
        assert (node.relay.cfg.window, node.relay.cfg.timeout_s) == (9, 3.0)
        assert (node.relay.server.max_parked_per_peer, node.relay.server.max_parked_total) == (
            5,
            50,
        )
        assert node.memory(None)["model"] == 0
        port = int(offer.endpoint.rpartition(":")[2])
        with pytest.raises(WorkerError, match="--relay-port"):
            RelayNode(ctx, RelayConfig(port=port), keys=None, run_key=lambda: b"")
    finally:
        node.close()
        ctx.term()


@pytest.mark.timeout(30)
def test_a_failed_nat_probe_says_why_and_what_the_volunteer_can_check(caplog):
    """Issue 55, item 7a: the log named nothing after "did not answer a probe:" and nothing to
    check. The probe goes from the punch port to reflectors where nothing listens."""
    import socket

    import zmq.asyncio

    from echo_rl.broadcast.relay import RelayConfig
    from echo_rl.worker.relaying import RelayNode

    ctx = zmq.asyncio.Context()
    node = RelayNode(ctx, RelayConfig(), keys=None, run_key=lambda: b"")
    try:
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))  # bound, never listening: refused
            b.bind(("127.0.0.1", 0))
            ports = [a.getsockname()[1], b.getsockname()[1]]
            reflectors = [f"127.0.0.1:{p}" for p in ports]
            with caplog.at_level("WARNING", logger="echo.worker"):
                asyncio.run(node.probe_nat(None, "w1", reflectors, 1.0))  # no client: not reached
    finally:
        node.close()
        ctx.term()
    (line,) = [r.getMessage() for r in caplog.records if "NAT probe failed" in r.getMessage()]
    assert f"reflector 127.0.0.1:{ports[0]} did not answer a probe: connection refused" in line
    assert "this worker will not relay" in line and node.nat == "unknown"
    assert f"may open TCP connections to 127.0.0.1 port {ports[0]} and {ports[1]}" in line
    assert "learner.reflector_ports" in line and "echo-worker doctor" in line


def test_carried_groups_go_back_with_their_prefixes_when_the_worker_stops_or_yields():
    """A worker that stops (or yields to its owner) before continuing its carried groups
    hands them back with what they hold, so another worker finishes them (echo_rl/worker/tail.py)."""
    client = ScriptedClient(lambda msg: wire.HandbackAck(groups=1, prefixes=2))
    g = make_generation(client, scripted_backend([[5, 2]]), ADAPTER)
    g.carry.keep(
        [GROUPS[1]], [[Sample([5, 2], [-0.5, -0.1]), Sample([5, 5], [-0.3, -0.3])]], version=3
    )
    g.life.yielded = True
    asyncio.run(g.return_carry())
    (msg,) = client.sent
    assert isinstance(msg, wire.Handback) and msg.reason == "yielded" and msg.groups == ["g1"]
    assert [(p.ids, p.versions) for p in msg.prefixes["g1"]] == [
        ([5, 2], [[3, 2]]),
        ([5, 5], [[3, 2]]),
    ]
    assert g.carry.groups == []
