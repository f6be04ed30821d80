"""Leases survive a learner restart (echo_rl.control.grants, issue 39): the journal, the work queue's
restore, and a restarted control plane that admits the holder's delivery, refuses the same
group from another key that claims the holder's id, and names ``learner_restarted`` for a
lease it did not keep."""

from __future__ import annotations

import itertools
import json

import pytest
from fakes import FakeClock
from test_control import ask, batch, connect, ctx, records  # noqa: F401 (fixtures)

from echo_rl.broadcast.snapshot import RunKey
from echo_rl.control.accounts import Accounts
from echo_rl.control.fleet import FleetBooks
from echo_rl.control.grants import GrantJournal, Lease, load, open_leases
from echo_rl.control.parts import Inputs
from echo_rl.control.server import LearnerServer
from echo_rl.control.work import WorkQueue
from echo_rl.core import wire
from echo_rl.core.security import KeyPair
from echo_rl.data.adapter import Prompt
from echo_rl.data.buffer import ReplayBuffer
from echo_rl.data.records import Limits

pytestmark = pytest.mark.timeout(120)


def queue(prefix: str, clock=None) -> WorkQueue:
    prompts = (Prompt([4, 14, 5], {"i": i}) for i in itertools.count())
    return WorkQueue(
        prompts,
        group_size=4,
        max_outstanding=16,
        lease_timeout_s=10,
        prefix=prefix,
        **({"clock": clock} if clock else {}),
    )


def test_journal_keeps_the_last_lease_of_each_group_and_skips_torn_lines(tmp_path):
    path = tmp_path / "grants.jsonl"
    wq = queue("run.aaa")
    wq.journal = GrantJournal(path)
    g0, g1 = wq.grant("w1", 2, 0, key="K1")
    wq.release_worker("w1")
    wq.grant("w2", 1, 0, key="K2")  # g0 moves to w2
    wq.journal.close()
    with path.open("a") as f:
        f.write('{"group": {"group_id": "run.aaa-9"')  # a torn last line (crash mid-write)
    leases, bad = load(path)
    assert bad == 1
    assert (leases[g0.group_id].worker_id, leases[g0.group_id].key) == ("w2", "K2")
    assert (leases[g1.group_id].worker_id, leases[g1.group_id].key) == ("w1", "K1")
    assert leases[g1.group_id].group.prompt_ids == g1.prompt_ids
    assert [lease.group.group_id for lease in open_leases(leases, {g0.group_id})] == [g1.group_id]


def test_journal_is_compacted_to_the_open_leases(tmp_path):
    path = tmp_path / "grants.jsonl"
    wq = queue("run.aaa")
    wq.journal = GrantJournal(path)
    for _ in range(400):  # grant and fulfil: the journal must not grow without bound
        [g] = wq.grant("w1", 1, 0, key="K")
        wq.fulfilled(g.group_id)
    [open_one] = wq.grant("w1", 1, 0, key="K")
    assert len(path.read_text().splitlines()) <= 256
    leases, bad = load(path)
    assert bad == 0 and open_one.group_id in leases


def test_restored_leases_keep_holder_and_key_with_a_fresh_clock():
    clock = FakeClock()
    old = queue("run.aaa")
    [g] = old.grant("w1", 1, 0, key="K1")
    new = queue("run.bbb", clock)
    new.restore_leases([Lease(g, "w1", "K1")])
    assert new.holder(g.group_id) == "w1" and new.holder_key(g.group_id) == "K1"
    theirs = new.grant("w2", 4, 0)
    assert g.group_id not in [x.group_id for x in theirs]  # not handed to anyone else
    for x in theirs:
        new.fulfilled(x.group_id)
    assert new.past_instance("run.aaa-7") and not new.past_instance("run.bbb-7")
    assert not new.past_instance("other.aaa-7")
    clock.t = 11.0  # the holder never came back: the lease expires and goes to others
    assert new.expire() == 1
    assert g.group_id in [x.group_id for x in new.grant("w2", 8, 0)]


def _plane(cfg, tmp_path, work, tokenizer) -> LearnerServer:
    lc = cfg.learner
    buffer = ReplayBuffer(lc.staleness, cfg.buffer.capacity_groups, lc.group_size)
    return LearnerServer(
        cfg,
        Inputs(
            run_id="run",
            key=RunKey.generate(),
            buffer=buffer,
            work=work,
            limits=Limits(len(tokenizer), cfg.worker.max_new_tokens, lc.group_size),
            run_dir=tmp_path,
        ),
    )


def test_a_restarted_plane_admits_the_holders_work_and_no_one_elses(
    small_cfg,
    tokenizer,
    ctx,  # noqa: F811
    tmp_path,
):
    holder, thief = KeyPair.generate(), KeyPair.generate()
    journal = tmp_path / "grants.jsonl"
    first = queue("run.aaa")
    first.journal = GrantJournal(journal)
    plane = _plane(small_cfg, tmp_path, first, tokenizer)
    plane.start()
    try:
        sock = connect(plane, ctx, keys=holder)
        ask(sock, wire.Join(worker_id="w1"))
        mine, other = ask(sock, wire.WorkRequest(worker_id="w1", max_groups=2)).groups
    finally:
        plane.shutdown("crash")  # the lease journal is all that is left of the grants
    second = queue("run.bbb")
    leases, _ = load(journal)
    second.restore_leases(open_leases(leases, set()))
    plane = _plane(small_cfg, tmp_path, second, tokenizer)
    plane.start()
    try:
        # a stranger claims the holder's id first: the leases stay bound to the holder's key
        t = connect(plane, ctx, keys=thief)
        ask(t, wire.Join(worker_id="w1"))
        ack = ask(t, batch(records(mine)))
        assert ack.accepted == 0 and ack.rejected == {"not_your_group": 4}
        ask(t, wire.Leave(worker_id="w1"))  # its leaving frees none of the holder's leases
        assert second.issued[mine.group_id].deadline != float("inf")
        h = connect(plane, ctx, keys=holder)
        ask(h, wire.Join(worker_id="w1"))
        ack = ask(h, batch(records(mine), "b2"))
        assert ack.accepted == 4 and ack.rejected == {}
        lost = other.model_copy(update={"group_id": "run.aaa-99"})  # a lease the journal lacks
        ack = ask(h, batch(records(lost), "b3"))
        assert ack.rejected == {"learner_restarted": 4}
        stats = plane.stats()
        assert stats.restored_admitted == 4 and stats.restored_leases == 2
        assert "learner_restarted" in plane.accounts.account("w1").message
    finally:
        plane.shutdown("over")


def test_fleet_books_round_trip_and_damage_is_not_fatal(tmp_path):
    books = FleetBooks(tmp_path / "fleet.json")
    acc = Accounts()
    acc.open("w1", "K1", 0.3, True, "joined", now=0.0)
    acc.delivered("w1", 12, 1, {"stale": 2})
    books.save(
        {
            "controller": {"K1": {"mu_hat": 3.0, "failed_probations": 0, "active": True}},
            "accounts": acc.state(),
        }
    )
    state = books.load()
    assert state.controller["K1"]["active"] is True
    again = Accounts()
    assert again.restore({**state.accounts, "bad": {"key": 3}, "w2": "junk"}) == 1
    again.open("w1", "K1", 0.3, True, "re-joined")  # same id and key: the books go on
    a = again.account("w1")
    assert (a.accepted, a.duplicates, a.rejected, a.state) == (12, 1, {"stale": 2}, "active")
    again.open("w1", "OTHER", 0.3, True, "joined")  # another key under that id: a new book
    assert again.account("w1").accepted == 0
    (tmp_path / "fleet.json").write_text("{not json")
    assert books.load().controller == {}
    (tmp_path / "fleet.json").write_text(json.dumps({"schema": 99}))
    assert books.load().accounts == {}
