"""The learner server's parts, each alone with fakes around it (echo_rl/control/server.py wires them):
the session table, the dispatcher, the snapshot routes' verdicts, the members' joins and
departures, the deliveries' grants and quarantine, the notices' order."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from types import SimpleNamespace

import pytest

from echo_rl.broadcast.store import SnapshotStore
from echo_rl.control.accounts import Accounts
from echo_rl.control.deliveries import Deliveries, DeliveryChecks, DeliveryLimits
from echo_rl.control.dispatch import Dispatcher
from echo_rl.control.members import Books, Members
from echo_rl.control.notices import Notices
from echo_rl.control.reputation import Quarantine
from echo_rl.control.routes import RunIdentity, SnapshotRoutes
from echo_rl.control.sessions import SessionTable, WorkerState
from echo_rl.core import wire


def _cfg(heartbeat_s: float = 1.0, timeout_s: float = 5.0, per_s: float = 0.0) -> SimpleNamespace:
    return SimpleNamespace(
        worker=SimpleNamespace(heartbeat_s=heartbeat_s),
        transport=SimpleNamespace(heartbeat_timeout_s=timeout_s, heartbeats_per_s=per_s),
        security=SimpleNamespace(false_reports=3, ticket_ttl_s=60.0),
        provisioning=SimpleNamespace(initial_active=1),
    )


class FakeGate:
    def __init__(self, message: str = ""):
        self.keys = None  # plaintext
        self.refused: Counter[str] = Counter()
        self.banned: dict[str, str] = {}
        self._message = message
        self.bans = SimpleNamespace(note=lambda key: "served junk")

    def message(self, key: str, size: int) -> str:
        return self._message

    def join(self, key: str, token: str, n: int, known: bool) -> str:
        return ""

    def witness(self, key: str) -> str:
        return ""  # open mode: each key answers for its own reports

    def ban(self, key: str, why: str) -> None:
        self.banned[key] = why


class FakeCoordinator:
    def __init__(self):
        self.joined: dict[str, str] = {}
        self.left: list[str] = []
        self.confirmed: list[tuple[str, str]] = []
        self.reports = SimpleNamespace(counts=Counter())
        self.peers: dict = {}
        self.links = SimpleNamespace(down={}, up={})

    def join(self, worker_id, endpoint, down, up, nat):
        self.joined[worker_id] = endpoint

    def leave(self, worker_id):
        self.left.append(worker_id)

    def owner(self, endpoint):
        return None  # no relay's install reports here: a probe asks for the newest version

    def confirm(self, endpoint, outcome):
        self.confirmed.append((endpoint, outcome))


def _join(worker_id: str, relay: str = "") -> wire.Join:
    return wire.Join(worker_id=worker_id, relay_endpoint=relay, price=0.5)


# ------------------------------------------------------------------ SessionTable


def test_a_key_speaks_only_for_the_worker_it_joined_as():
    table = SessionTable(_cfg())
    table.add(b"a", "KEY1", _join("w1"))
    assert table.session(b"a2", "KEY1", "w1").ident == b"a2"  # a reconnect's new routing id
    assert table.session(b"b", "KEY2", "w1") is None
    with pytest.raises(wire.WireError) as err:
        table.session(b"a", "KEY1", "w2")
    assert err.value.reason == "identity_mismatch"
    with pytest.raises(wire.WireError) as err:
        table.joined(b"b", "KEY2", "w2")
    assert err.value.reason == "not_joined"
    assert table.remove("w1").key == "KEY1" and not table.sessions and not table.workers


def test_claims_on_an_id_or_a_relay_endpoint_of_another_key_are_refused():
    table = SessionTable(_cfg())
    table.add(b"a", "KEY1", _join("w1", "tcp://localhost:7000"))
    assert table.claim("KEY2", _join("w1"), None, ()) == "id_taken"
    # the same endpoint by another spelling is still taken
    assert table.claim("KEY2", _join("w2", "tcp://127.0.0.1:7000"), None, ()) == "endpoint_taken"
    assert (
        table.claim("KEY2", _join("w2", "tcp://10.0.0.1:1"), None, ("tcp://10.0.0.1:1",))
        == "endpoint_taken"
    )  # the learner's own
    assert table.claim("KEY2", _join("w2", "tcp://10.0.0.2:1"), None, ()) == ""


def test_a_large_fleet_stretches_the_period_and_the_timeout_alike():
    cfg = _cfg(heartbeat_s=1.0, timeout_s=5.0, per_s=2.0)
    table = SessionTable(cfg)
    for i in range(8):
        table.add(b"x", f"K{i}", _join(f"w{i}"))
    assert table.period() == 4.0  # 8 workers at 2 beats/s
    w = table.workers["w0"]
    w.period = table.period()
    assert table.timeout(w) == 20.0  # the same five missed beats
    cfg.transport.heartbeats_per_s = 0  # read when asked: off now
    assert table.period() == 1.0


# ------------------------------------------------------------------ Dispatcher


def _dispatcher(gate: FakeGate, handlers: dict, ended: list) -> tuple[Dispatcher, Counter]:
    rejected: Counter[str] = Counter()
    return Dispatcher(
        gate=gate,
        handlers=handlers,
        max_bytes=1 << 20,
        rejected=rejected,
        end_session=lambda key, why: ended.append((key, why)),
    ), rejected


def test_the_dispatcher_answers_counts_and_survives_whatever_a_frame_holds():
    def boom(ident, key, msg):
        raise KeyError("a bug")

    ended: list = []
    d, rejected = _dispatcher(
        FakeGate(),
        {
            wire.Heartbeat: lambda ident, key, msg: wire.HeartbeatAck(
                instance_id="i", version=key == "id:w1"
            ),
            wire.Leave: boom,
        },
        ended,
    )
    hb = wire.Heartbeat(worker_id="w1", version=0, rid=7)
    reply = asyncio.run(d.handle(b"i", "", [wire.encode(hb)]))
    assert isinstance(reply, wire.HeartbeatAck) and reply.rid == 7 and reply.version == 1
    assert d.kind == "heartbeat"
    assert asyncio.run(d.handle(b"i", "", [b"a", b"b"])).reason == "malformed"
    assert asyncio.run(d.handle(b"i", "", [wire.encode(wire.Doctor())])).reason == "unknown_type"
    err = asyncio.run(d.handle(b"i", "", [wire.encode(wire.Leave(worker_id="w1"))]))
    assert err.reason == "internal_error"
    assert rejected == {"malformed": 1, "unknown_type": 1, "internal_error": 1}
    assert ended == []


def test_a_banned_key_is_refused_with_its_reason_and_its_session_ends():
    ended: list = []
    d, rejected = _dispatcher(FakeGate(message="banned"), {}, ended)
    err = asyncio.run(
        d.handle(b"i", "KEY", [wire.encode(wire.Heartbeat(worker_id="w", version=0, rid=3))])
    )
    assert err.reason == "banned" and err.rid == 3 and "served junk" in err.detail
    assert ended == [("KEY", "banned")] and rejected == {"banned": 1}


# ------------------------------------------------------------------ SnapshotRoutes


def _routes(gate: FakeGate, table: SessionTable) -> SnapshotRoutes:
    routes = SnapshotRoutes(
        _cfg(),
        gate=gate,
        table=table,
        identity=RunIdentity("r", None, "inst"),
        store=SnapshotStore(),
        results=SnapshotStore(keep=2, recycle=False),
        rejected=Counter(),
        push=lambda *a: None,
    )
    routes.attach(FakeCoordinator(), None, "tcp://learner:1")
    return routes


def test_a_probe_verdict_bans_a_corrupt_relay_and_discredits_an_unconfirmed_reporter():
    gate = FakeGate()
    routes = _routes(gate, SessionTable(_cfg()))
    routes.probes.verdict("tcp://r:1", "RELAY", "ACCUSER", "corrupt")
    assert "RELAY" in gate.banned and routes.probes.rejected["relay_corrupt"] == 1
    routes.probes.verdict("tcp://r:2", "RELAY2", "ACCUSER", "intact")
    assert "RELAY2" not in gate.banned and routes.probes.unconfirmed["ACCUSER"] == 1
    assert routes.coordinator.reports.counts == {"probe:corrupt": 1, "probe:intact": 1}
    # nothing to probe with (no verifier): no probe, no verdict
    assert routes.probes.probe("tcp://r:1", "ACCUSER", -1) is False


# ------------------------------------------------------------------ Members


class FakeController:
    def __init__(self):
        self.added: dict[str, str] = {}
        self.removed: list[str] = []
        self.gone_for_good: list[bool] = []

    def active_ids(self):
        return [w for w, s in self.added.items() if s == "active"]

    def measured_any(self):
        return False

    def add_worker(self, worker_id, price, *, state, mu_prior, identity):
        assert mu_prior == 0.0  # no credit before delivery
        self.added[worker_id] = state

    def remove_worker(self, worker_id, gone_for_good=False):
        self.removed.append(worker_id)
        self.gone_for_good.append(gone_for_good)


def _members(controller=None) -> tuple[Members, SimpleNamespace]:
    table = SessionTable(_cfg())
    gate = FakeGate()
    routes = SimpleNamespace(
        latest=lambda: (-1, None),
        base_manifest=None,
        snapshot_source=lambda w: SimpleNamespace(endpoint="tcp://l:1", key=b"", ticket=b""),
        snapshot_endpoint="tcp://l:1",
    )
    routes.join_ack = lambda *a: SnapshotRoutes.join_ack(routes, *a)  # the real message
    work = SimpleNamespace(
        released=[], release_worker=lambda wid, key: work.released.append(wid) or 2
    )
    rep = SimpleNamespace(audits=Counter(), failures=Counter())
    cfg = _cfg()
    cfg.worker_view = lambda: {"worker": {}}
    m = Members(
        cfg,
        identity=RunIdentity("r", SimpleNamespace(public_bytes=b"P" * 40), "inst"),
        table=table,
        gate=gate,
        books=Books(Accounts(), rep),
        work=work,
        routes=routes,
        controller=controller,
    )
    m.attach(FakeCoordinator(), None, ("tcp://l:0", "tcp://l:1"))
    return m, work


def test_a_join_is_pending_until_its_first_useful_act_and_a_leave_closes_its_books():
    ctl = FakeController()
    m, work = _members(ctl)
    ack = m.on_join(b"i", "KEY1", _join("w1", "tcp://10.0.0.5:9"))
    assert ack.worker_id == "w1" and ack.instance_id == "inst"
    assert m.coordinator.joined["w1"] == ""  # a pending key is a tail, never a parent
    assert ctl.added == {}
    m.promote(m.table.workers["w1"], "installed v0")
    assert ctl.added == {"w1": "active"}  # the first member boots active
    assert m.coordinator.joined["w1"] == "tcp://10.0.0.5:9"
    bye = m.on_leave(b"i", "KEY1", wire.Leave(worker_id="w1"))
    assert bye.account.state == "left" and work.released == ["w1"] and ctl.removed == ["w1"]
    assert ctl.gone_for_good == [True]  # its goodbye: provisioning replaces it at once
    assert m.table.workers == {} and m.coordinator.left == ["w1"]


def test_a_key_joined_by_a_live_worker_cannot_join_as_another():
    m, _ = _members()
    m.on_join(b"i", "KEY1", _join("w1"))
    with pytest.raises(wire.WireError) as err:
        m.on_join(b"i", "KEY1", _join("w2"))
    assert err.value.reason == "key_in_use"
    m.table.workers["w1"].last_seen = time.monotonic() - 60  # silent past its timeout
    assert m.on_join(b"i", "KEY1", _join("w2")).worker_id == "w2"
    assert set(m.table.workers) == {"w2"}


# ------------------------------------------------------------------ Deliveries


def _deliveries(active: bool = True):
    members, work = _members()
    members.is_active = lambda wid: active
    buffer = SimpleNamespace(
        version=3,
        removed=[],
        depth=lambda: {"ready_groups": 0},
        remove_worker=lambda wid: buffer.removed.append(wid) or [1, 2],
    )
    returns = SimpleNamespace(
        forgotten=[], forget=lambda wid: returns.forgotten.append(wid), capped=lambda wid: False
    )
    pushed: list = []
    d = Deliveries(
        members=members,
        checks=DeliveryChecks(None, None, returns, None),
        buffer=buffer,
        work=work,
        limits=DeliveryLimits(None, 4, False, 1 << 20),
        rejected=Counter(),
        push_ident=lambda ident, msg, who: pushed.append((ident, msg.type, who)),
    )
    return d, members, buffer, returns, pushed


def test_a_standby_worker_gets_no_work_and_a_retry_interval():
    d, members, *_ = _deliveries(active=False)
    members.on_join(b"i", "KEY1", _join("w1"))
    grant = d.on_work_request(b"i", "KEY1", wire.WorkRequest(worker_id="w1", max_groups=4))
    assert grant.groups == [] and grant.retry_after_s == 0.5
    assert members.table.workers["w1"].member  # asking for work is a useful act


def test_quarantine_bans_the_key_empties_the_buffer_of_it_and_says_farewell():
    d, members, buffer, returns, pushed = _deliveries()
    members.on_join(b"conn", "KEY1", _join("w1"))
    d.quarantine(Quarantine("w1", "KEY1", "forged logprobs"))
    assert members.gate.banned == {"KEY1": "quarantined: forged logprobs"}
    assert buffer.removed == ["w1"] and returns.forgotten == ["w1"]
    assert pushed == [(b"conn", "farewell", "w1")]
    assert "w1" not in members.table.workers
    assert members.accounts.account("w1").state == "quarantined"


def test_the_measured_rate_is_a_moving_average_of_admitted_batches():
    w = WorkerState("w", b"", "K", 0.0, 0.0)
    w.last_batch_at = time.monotonic() - 1.0
    Deliveries.measure(w, 10)
    first = w.measured_throughput
    assert first == pytest.approx(10, rel=0.1) and w.admitted == 10
    w.last_batch_at = time.monotonic() - 1.0
    Deliveries.measure(w, 20)
    assert first < w.measured_throughput < 20 and w.admitted == 30


# ------------------------------------------------------------------ Notices


def test_notices_go_to_delivering_members_first_and_are_bounded():
    table = SessionTable(_cfg())
    for wid in ("pending", "member", "deliverer"):
        table.add(b"x", "K" + wid, _join(wid))
    table.workers["member"].member = True
    table.workers["deliverer"].member = True
    table.workers["deliverer"].admitted = 5
    members = SimpleNamespace(is_active=lambda wid: True)
    cfg = SimpleNamespace(security=SimpleNamespace(notices_per_publication=2))
    notices = Notices(cfg, table=table, members=members, routes=None, cpu=None, send=None)
    assert [w.worker_id for w in notices.order(1)] == ["deliverer", "member"]
    assert notices.noticed == {"sent": 2, "deferred": 1}
    assert table.workers["deliverer"].noticed == 1 and table.workers["pending"].noticed == -1
