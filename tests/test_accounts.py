"""The learner's books on each worker (echo_rl.control.accounts) and what the worker is told of them:
the rules alone, then on the control plane's real sockets with honest and hostile peers."""

from test_control import ask, client, connect, ctx, keys, plane, records  # noqa: F401  (fixtures: plane, ctx, keys, client)  # noqa: F401

from echo_rl.control.accounts import Accounts
from echo_rl.core import wire
from echo_rl.core.security import KeyPair

# ------------------------------------------------------------------ the rules


def test_earnings_accrue_only_while_active_and_stop_at_close():
    a = Accounts()
    a.open("w1", "K1", price=3.6, active=False, message="joined", now=100.0)
    a.tick([], now=110.0)  # standby for 10 s: nothing earned
    a.tick(["w1"], now=112.0)  # activated at 112 (the provisioner's choice, seen at a tick)
    a.tick(["w1"], now=122.0)
    a.close("w1", "left", "removed: left", now=125.0)  # counted up to the close, not the tick
    a.tick(["w1"], now=200.0)  # closed: no more
    acct = a.account("w1")
    assert acct.state == "left" and acct.active_s == 13.0
    assert acct.earned_usd == round(3.6 * 13.0 / 3600, 8) and acct.message == "removed: left"


def test_records_counted_as_judged_and_the_learner_says_why():
    a = Accounts()
    a.open("w1", "K1", 0.0, True, "joined")
    a.delivered("w1", accepted=6, duplicates=2, rejected={})
    a.delivered(
        "w1",
        accepted=0,
        duplicates=0,
        rejected={"reward_mismatch": 4, "stale": 0},
        details={"reward_mismatch": "claimed 1.0, recomputed 0.0"},
    )
    acct = a.account("w1")
    assert (acct.accepted, acct.duplicates, acct.rejected) == (6, 2, {"reward_mismatch": 4})
    assert "reward_mismatch x4 (claimed 1.0, recomputed 0.0)" in acct.message


def test_a_quarantine_is_not_overwritten_by_a_later_leave_or_refusal():
    a = Accounts()
    a.open("w1", "K1", 1.0, True, "joined")
    a.close("w1", "quarantined", "quarantined: 3 strikes")
    a.delivered("w1", 0, 0, {"quarantined": 8})  # the rest of the batch that earned the strike
    a.close("w1", "left", "removed: quarantined")
    acct = a.account("w1")
    assert acct.state == "quarantined" and acct.message == "quarantined: 3 strikes"
    assert acct.rejected == {"quarantined": 8}


def test_an_id_reused_by_another_key_starts_with_empty_books():
    a = Accounts()
    a.open("w1", "K1", 1.0, True, "joined", now=0.0)
    a.delivered("w1", 5, 0, {})
    a.close("w1", "left", "removed: left", now=100.0)
    a.open("w1", "K1", 1.0, True, "joined again", now=200.0)  # same key: the same books
    assert a.account("w1").accepted == 5 and a.account("w1").active_s == 100.0
    a.close("w1", "left", "removed: left", now=200.0)
    a.open("w1", "K2", 1.0, True, "joined", now=300.0)  # another key: nothing inherited
    assert a.account("w1").accepted == 0 and a.account("w1").active_s == 0.0


def test_books_of_departed_workers_are_bounded_oldest_first():
    a = Accounts(keep=3)
    for i in range(6):
        a.open(f"w{i}", f"K{i}", 0.0, False, "joined")
    a.open("live", "KL", 0.0, True, "joined")
    for i in range(6):
        a.close(f"w{i}", "left", "removed: left")
    assert set(a.export()) == {"w3", "w4", "w5", "live"}  # open books are never dropped


def test_refusal_reasons_per_worker_are_bounded():
    a = Accounts()
    a.open("w1", "K1", 0.0, True, "joined")
    for i in range(100):
        a.delivered("w1", 0, 0, {f"reason{i}": 1})
    assert len(a.account("w1").rejected) == 32


# ------------------------------------------------------------------ on the wire


def _join(sock, worker_id="w1", price=0.5):
    ack = ask(sock, wire.Join(worker_id=worker_id, price=price, can_relay=False))
    assert isinstance(ack, wire.JoinAck), ack
    return ack


def _heartbeat(sock, worker_id="w1"):
    return ask(sock, wire.Heartbeat(worker_id=worker_id, version=-1))


def test_heartbeats_and_farewell_carry_the_learners_books(plane, client):
    _join(client)
    first = _heartbeat(client)
    assert isinstance(first, wire.HeartbeatAck) and first.account.state == "active"
    assert first.account.price == 0.5 and first.account.message.startswith("joined: active")
    grant = ask(client, wire.WorkRequest(worker_id="w1", max_groups=2))
    good, bad = grant.groups
    batch = records(good) + records(bad, completion_ids=[999, 1])  # 999: outside the vocabulary
    ack = ask(
        client,
        wire.Trajectories(
            worker_id="w1", batch_id="b1", count=len(batch), payload=wire.pack_records(batch)
        ),
    )
    assert ack.accepted == good.n and sum(ack.rejected.values()) == bad.n
    acct = _heartbeat(client).account
    assert acct.accepted == good.n and acct.granted == 2
    assert acct.rejected == ack.rejected and "records refused" in acct.message
    bye = ask(client, wire.Leave(worker_id="w1"))
    assert isinstance(bye, wire.Farewell) and bye.account.state == "left"
    assert (bye.account.accepted, bye.account.rejected) == (acct.accepted, acct.rejected)
    # /metrics reads the same books, after the worker left
    assert plane.stats().accounts["w1"]["rejected"] == acct.rejected


def test_nobody_reads_or_closes_another_workers_books(plane, client, ctx):
    _join(client)
    mallory = connect(plane, ctx, keys=KeyPair.generate())
    _join(mallory, worker_id="mallory")
    peek = _heartbeat(mallory, worker_id="w1")  # a heartbeat naming another worker
    assert isinstance(peek, wire.Error) and peek.reason == "identity_mismatch"
    gone = ask(mallory, wire.Leave(worker_id="w1"))  # a leave naming another worker
    assert isinstance(gone, wire.Error) and gone.reason == "identity_mismatch"
    mine = _heartbeat(mallory, worker_id="mallory").account
    assert mine.state == "active" and mine.accepted == 0
    assert _heartbeat(client).account.state == "active"  # w1's books stay open and its own
    stranger = connect(plane, ctx, keys=KeyPair.generate())  # never joined
    unknown = _heartbeat(stranger, worker_id="w1")
    assert isinstance(unknown, wire.Error) or (not unknown.known and unknown.account is None)
    for s in (mallory, stranger):
        s.close(linger=0)


def test_an_id_taken_over_after_its_worker_left_inherits_nothing(plane, client, ctx):
    _join(client)
    grant = ask(client, wire.WorkRequest(worker_id="w1", max_groups=1))
    batch = records(grant.groups[0])
    ask(
        client,
        wire.Trajectories(
            worker_id="w1", batch_id="b1", count=len(batch), payload=wire.pack_records(batch)
        ),
    )
    assert isinstance(ask(client, wire.Leave(worker_id="w1")), wire.Farewell)
    other = connect(plane, ctx, keys=KeyPair.generate())
    _join(other, worker_id="w1")
    acct = _heartbeat(other, worker_id="w1").account
    assert acct.accepted == 0 and acct.granted == 0
    other.close(linger=0)
