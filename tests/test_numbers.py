"""Numbers that cannot hurt: the findings of a hostile worker sending protocol-valid extremes.

Each extreme is rejected at admission with its own counted reason while the control plane goes
on serving; a non-finite update never reaches the weights; a non-finite state is never
published; metrics rows never hold NaN/Infinity; a poisoned buffer log is set aside on resume.
"""

from __future__ import annotations

import copy
import json
import math
import struct
import time
import zlib
from dataclasses import asdict

import lz4.frame
import msgpack
import pytest
import torch
from test_control import ask, batch, client, ctx, keys, plane, records  # noqa: F401 (fixtures)

from echo_rl.core import wire
from echo_rl.core.metrics import finite_or_null
from echo_rl.data.adapter import materialise_records
from echo_rl.data.advantages import group_advantages
from echo_rl.data.durable import BufferLog, scan_log
from echo_rl.data.records import Record
from echo_rl.learner.trainer import Trainer

pytestmark = pytest.mark.timeout(120)

PROMPT = [4, 14, 5, 17]


# ----------------------------------------------------------------------------- admission


def test_extremes_are_rejected_with_their_reasons_and_serving_goes_on(plane, client):  # noqa: F811
    ask(client, wire.Join(worker_id="w1"))
    gs = ask(client, wire.WorkRequest(worker_id="w1", max_groups=7)).groups
    assert len(gs) == 7
    one_huge = records(gs[0])
    one_huge[0]["reward"] = 1e200  # killed the learner: OverflowError in the advantages
    masked_inf = records(gs[2], completion_ids=[11, 1], loss_mask=[1, 0], logprobs=[-1.0, -1e39])
    recs = (
        one_huge
        + records(gs[1], reward=1e308)
        + masked_inf
        + records(gs[3], reward=math.nan)
        + records(gs[4], reward=-math.inf)
        + records(gs[5], worker_id="w2")
        + records(gs[6])
    )
    ack = ask(client, batch(recs))
    assert ack.rejected == {
        "reward_out_of_range": 1 + 4,
        "logprob_below_floor": 4,
        "non_finite_reward": 8,
        "identity_mismatch": 4,
        "partial_group": 3,
    }  # the rest of gs[0]: groups come back whole
    assert ack.accepted == 4  # gs[6]
    rejected = plane.stats().rejected
    assert rejected["reward_out_of_range"] == 5 and rejected["identity_mismatch"] == 4
    # the control plane keeps serving, and the honest group is whole in the buffer
    assert isinstance(ask(client, wire.Heartbeat(worker_id="w1", version=0)), wire.HeartbeatAck)
    assert plane.buffer.depth().ready_groups == 1


def test_nan_as_a_msgpack_float32_is_rejected(plane, client):  # noqa: F811
    ask(client, wire.Join(worker_id="w1"))
    (g,) = ask(client, wire.WorkRequest(worker_id="w1", max_groups=1)).groups
    packed = msgpack.packb(records(g, reward=math.nan), use_bin_type=True, use_single_float=True)
    assert b"\xca\x7f\xc0\x00\x00" in packed  # the reward travels as a float32 NaN
    msg = wire.Trajectories(
        worker_id="w1", batch_id="b", count=g.n, payload=lz4.frame.compress(packed)
    )
    assert ask(client, msg).rejected == {"non_finite_reward": g.n}


def test_a_batch_whose_count_lies_is_rejected_whole(plane, client):  # noqa: F811
    ask(client, wire.Join(worker_id="w1"))
    (g,) = ask(client, wire.WorkRequest(worker_id="w1", max_groups=1)).groups
    recs = records(g)
    for count in (len(recs) + 1, len(recs) - 1, 0):
        reply = ask(
            client,
            wire.Trajectories(
                worker_id="w1", batch_id=f"c{count}", count=count, payload=wire.pack_records(recs)
            ),
        )
        assert isinstance(reply, wire.Error) and reply.reason == "count_mismatch"
        assert reply.ref == f"c{count}"
    assert plane.stats().rejected["count_mismatch"] == 3
    assert plane.buffer.stats.admitted == 0
    assert ask(client, batch(recs)).accepted == len(recs)  # the honest batch still goes in


def test_advantages_are_finite_for_any_finite_rewards():
    for rewards in ([1e308] * 16, [1e308, -1e308] * 8, [1e200] + [0.0] * 15, [5e-324, 0.0]):
        adv = group_advantages(rewards)
        assert all(math.isfinite(a) for a in adv)
        assert max(abs(a) for a in adv) <= math.sqrt(len(rewards) - 1) + 1e-9
    # ordinary rewards: the same values as the textbook formula
    r = [0.0, 1.0, 1.0, 3.0]
    mean = sum(r) / 4
    std = math.sqrt(sum((x - mean) ** 2 for x in r) / 3)
    assert group_advantages(r, 1e-4) == pytest.approx([(x - mean) / (std + 1e-4) for x in r])
    assert all(math.isnan(a) for a in group_advantages([1.0, math.inf]))  # never raises


# ----------------------------------------------------------------------------- trainer


def _groups(n_groups: int = 2, size: int = 4) -> list[list[Record]]:
    return [
        [
            Record(f"g{k}", i, PROMPT, [11, 1 + i], [-1.0, -0.5], float(i % 2), 0, f"w{k}")
            for i in range(size)
        ]
        for k in range(n_groups)
    ]


@pytest.fixture
def trainer(small_cfg, tokenizer):
    from echo_rl.core.models import load_model

    torch.manual_seed(0)
    cfg = small_cfg.learner.model_copy(update={"updates_per_step": 1})
    return Trainer(load_model(small_cfg.model, tokenizer, "float32"), cfg, seed=0)


def _snapshot(tr: Trainer) -> tuple[dict, dict]:
    return (
        {k: v.clone() for k, v in tr.model.state_dict().items()},
        copy.deepcopy(tr.optimizer.state_dict()),
    )


def _same(a: tuple[dict, dict], b: tuple[dict, dict]) -> bool:
    weights = all(torch.equal(a[0][k], b[0][k]) for k in a[0])
    return weights and repr(a[1]) == repr(b[1])


def test_non_finite_advantage_skips_the_update_and_names_its_row(trainer):
    groups = _groups()
    good = materialise_records(groups, [1.0, -1.0] * 4, pad=0)
    trainer.step(good)  # the optimizer now has state to protect
    before = _snapshot(trainer)
    bad = materialise_records(groups, [1.0, -1.0, 1.0, math.nan, 1.0, -1.0, 1.0, -1.0], pad=0)
    stats = trainer.step(bad)
    assert stats["skipped_nonfinite"] == 1 and math.isnan(stats["loss"])
    assert trainer.nonfinite_rows == [3]
    assert _same(before, _snapshot(trainer))  # weights and Adam state untouched
    assert trainer.step(good)["skipped_nonfinite"] == 0  # and the next step trains again
    assert not _same(before, _snapshot(trainer))


def test_injected_non_finite_gradient_leaves_weights_unchanged(trainer):
    batch_ = materialise_records(_groups(), [1.0, -1.0] * 4, pad=0)
    trainer.step(batch_)
    before = _snapshot(trainer)
    param = next(trainer.model.parameters())
    hook = param.register_hook(lambda g: g * math.inf)  # the loss stays finite, a gradient not
    try:
        stats = trainer.step(batch_)
    finally:
        hook.remove()
    assert stats["skipped_nonfinite"] == 1 and math.isfinite(stats["loss"]) is False
    assert sorted(trainer.nonfinite_rows) == list(range(8))  # no single culprit: all rows
    assert _same(before, _snapshot(trainer))
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


# ----------------------------------------------------------------------------- the learner


@pytest.fixture
def learner_factory(small_cfg, tmp_path):
    from echo_rl.learner.main import Learner
    from echo_rl.learner.policy import Policy

    small_cfg.metrics.enabled = False
    made = []

    def make(resume: bool = False):
        lrn = Learner(small_cfg, tmp_path, Policy(small_cfg))
        made.append(lrn)
        lrn.start(resume)
        return lrn

    yield make
    for lrn in made:
        lrn.close("test over")


def test_non_finite_state_is_not_published_and_the_previous_version_stays(learner_factory):
    from echo_rl.learner.policy import Sync

    lrn = learner_factory()
    assert lrn.server.store.latest().version == 0
    _, (model_sd, _) = lrn.policy.command(Sync())
    poisoned = dict(model_sd)
    name = lrn.policy.param_names[0]
    poisoned[name] = model_sd[name].clone()
    poisoned[name].view(-1)[0] = math.nan
    lrn.release.publish(1, poisoned)
    lrn.publisher.flush()
    assert lrn.server.store.latest().version == 0 and lrn.release.refused == 1
    lrn.release.publish(1, model_sd)
    lrn.publisher.flush()  # on the publisher thread where the release is threaded
    assert lrn.server.store.latest().version == 1


def _frame(body: bytes) -> bytes:
    return struct.pack("<II", len(body), zlib.crc32(body)) + body


def test_resume_sets_a_poisoned_log_aside_and_trains(learner_factory, tmp_path):
    """The 1e200 reward that crashed the learner is in its log; before, every --resume replayed
    it into the same crash. Now it goes to buffer.log.rejected and the learner trains."""
    groups = _groups(4)
    log = BufferLog(tmp_path / "buffer.log", fsync=False)
    log.admitted([r for g in groups for r in g])
    poison = asdict(Record("gx", 0, PROMPT, [11, 1], [-1.0, -0.5], 1e200, 0, "evil"))
    log._append("admit", [poison, dict(poison, sample_idx=1, surprise=1)])
    log.close()
    with open(tmp_path / "buffer.log", "ab") as f:
        f.write(_frame(b"\xc1 not msgpack"))  # intact CRC, undecodable body
        f.write(_frame(msgpack.packb(["consume", "not a list"])))
    lrn = learner_factory(resume=True)
    assert lrn.server.endpoint  # it came up
    aside = [json.loads(x) for x in (tmp_path / "buffer.log.rejected").read_text().splitlines()]
    assert sorted(a["reason"] for a in aside) == [
        "invalid_fields",
        "reward_out_of_range",
        "unparseable",
        "unparseable",
    ]
    assert lrn.buffer.stats.rejected["set_aside_on_resume"] == 4
    assert lrn.buffer.depth().ready_groups == 4
    _, _, again = scan_log(tmp_path / "buffer.log", lrn.limits)
    assert again == []  # compacted: the next resume finds nothing to set aside
    row = lrn._one_step()
    assert row.skipped_nonfinite == 0 and math.isfinite(row.loss)


def test_a_non_finite_step_is_skipped_traced_and_written_as_null(learner_factory, tmp_path):
    lrn = learner_factory()
    for g in _groups(4):
        for r in g:
            lrn.buffer.admit(r)
    honest = lrn.adapter.materialise

    def poisoned(groups, eps, **kw):  # as if an advantage had come out NaN for group g2
        b = honest(groups, eps, **kw)
        b.advantages[8:12] = math.nan
        return b

    lrn.adapter.materialise = poisoned
    lrn.cfg.learner.updates_per_step = 1
    before = {k: v.clone() for k, v in lrn.policy.model.state_dict().items()}
    row = lrn._one_step()
    assert row.skipped_nonfinite == 1 and row.loss is None and row.nonfinite_values >= 1
    assert all(torch.equal(before[k], v) for k, v in lrn.policy.model.state_dict().items())
    assert lrn.struck == {"w2": 4}
    audit = [json.loads(x) for x in (tmp_path / "nonfinite.jsonl").read_text().splitlines()]
    assert audit == [{"step": 0, "groups": ["g2"], "workers": ["w2"]}]
    json.dumps(row.to_json(), allow_nan=False)  # what run() writes to metrics.jsonl


def test_finite_or_null_counts_what_it_replaces():
    clean, n = finite_or_null({"a": math.nan, "b": [1.0, math.inf, {"c": -math.inf}], "d": 2})
    assert clean == {"a": None, "b": [1.0, None, {"c": None}], "d": 2} and n == 3
    assert json.loads(json.dumps(clean, allow_nan=False)) == clean


# ----------------------------------------------------------------------------- end to end


def _strict_json(line: str) -> dict:
    def refuse(const: str) -> None:
        raise AssertionError(f"metrics.jsonl holds {const}")

    return json.loads(line, parse_constant=refuse)


def _hostile_batches(groups: list) -> list[wire.Trajectories]:
    """The findings, one batch each: a 1e200 reward, a whole group at 1e308, -1e39 on a masked
    token, NaN as a float32, a forged worker id, and a count that lies."""
    g = iter(groups)
    huge = records(next(g), worker_id="evil")
    huge[0]["reward"] = 1e200
    nan32 = lz4.frame.compress(
        msgpack.packb(
            records(next(g), worker_id="evil", reward=math.nan),
            use_bin_type=True,
            use_single_float=True,
        )
    )
    recs = [
        huge,
        records(next(g), worker_id="evil", reward=1e308),
        records(next(g), worker_id="evil", loss_mask=[1, 0], logprobs=[-1.0, -1e39]),
        records(next(g), worker_id="w0"),
    ]
    out = [
        wire.Trajectories(
            worker_id="evil", batch_id=f"e{i}", count=len(r), payload=wire.pack_records(r)
        )
        for i, r in enumerate(recs)
    ]
    out.append(wire.Trajectories(worker_id="evil", batch_id="nan32", count=4, payload=nan32))
    out.append(
        wire.Trajectories(
            worker_id="evil", batch_id="lie", count=True, payload=wire.pack_records(recs[0])
        )
    )
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_hostile_sender_cannot_stop_a_real_learner(tmp_path, small_cfg):
    import zmq
    from test_integration import Cluster, rows, wait_rows

    c = Cluster(tmp_path, small_cfg)
    try:
        # Leases long enough that none of evil's groups expires and goes to w0 under load
        # (its records would then be duplicates, not rejections); Leave releases them.
        run = c.learner(max_steps=10, lease_timeout_s=120.0)
        ctx = zmq.Context()
        sock = c.dealer(ctx)
        try:
            # evil takes its groups and sends its batches before the honest worker starts: on
            # a loaded machine w0 could otherwise hold every group until the run's 10 steps
            # were over, and evil's requests met a learner that had finished
            ask(sock, wire.Join(worker_id="evil", price=0.1, can_relay=False))
            groups: list = []
            deadline = time.monotonic() + 60
            while len(groups) < 5 and time.monotonic() < deadline:
                reply = ask(sock, wire.WorkRequest(worker_id="evil", max_groups=5 - len(groups)))
                if isinstance(reply, wire.Error) or not reply.groups:
                    # none to hand out yet, or asked too often: the learner's rate limit
                    # answers a client that polls in a loop; pace as a worker does
                    assert not isinstance(reply, wire.Error) or reply.reason == "rate_limited"
                    time.sleep(0.2)
                    continue
                groups += reply.groups
            assert len(groups) == 5, groups
            replies = [ask(sock, b) for b in _hostile_batches(groups)]
            sock.send(wire.encode(wire.Leave(worker_id="evil")))
            c.worker("w0")  # the run then trains on the honest worker's data, to the end
            wait_rows(run, 1)
        finally:
            sock.close(linger=500)
            ctx.term()
        assert [r.rejected for r in replies[:5]] == [
            # the other three samples of the first group: groups come back whole or not at all
            {"reward_out_of_range": 1, "partial_group": 3},
            {"reward_out_of_range": 4},
            {"logprob_below_floor": 4},
            {"identity_mismatch": 4},
            {"non_finite_reward": 4},
        ], replies
        assert isinstance(replies[5], wire.Error)
        assert c.wait("learner") == 0  # trained to the end
        assert c.wait("w0", 60) == 0  # the honest worker was never sent a NaN snapshot
        got = [_strict_json(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in got] == list(range(10)) == [r["step"] for r in rows(run)]
        assert all(r["skipped_nonfinite"] == 0 and r["publish_refused"] == 0 for r in got)
        assert {
            "reward_out_of_range",
            "logprob_below_floor",
            "identity_mismatch",
            "non_finite_reward",
        } <= set(got[-1]["rejected"])
    finally:
        c.group.stop_all()
