"""An adapter's own limit is never judged as a worker's lie (issue 56, item 1): episodes that
outgrow the adapter's ``max_completion_tokens`` stop the worker with a message naming the
adapter and the setting, instead of being delivered, refused as ``bad_length`` and counted
against an honest worker until it is banned."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
from test_control import ctx  # noqa: F401 (fixture)
from test_trust import trusting  # noqa: F401 (fixture)

from echo_rl.core import wire
from echo_rl.data.episodes import EpisodeAdapter, EpisodeSample
from echo_rl.worker.scoring import AdapterFault, generate_and_score
from echo_rl.worker.session import WorkerError

pytestmark = pytest.mark.timeout(30)


class Game(EpisodeAdapter):
    """A multi-turn adapter whose episodes are ``length`` tokens long."""

    name = "mastermind-lite"
    max_completion_tokens = 48

    def __init__(self, length: int):
        super().__init__({}, None)
        self.length = length

    def prompts(self, rng):
        raise AssertionError("a worker never draws prompts")

    def episode(self, task, seed, sample_idx):
        raise AssertionError("rollout below plays every episode")

    def rollout(self, groups, generate):
        n = self.length
        return [
            [EpisodeSample([5] * n, [-0.5] * n, [1] * n, 1.0) for _ in range(g.n)] for g in groups
        ]


def run(length: int, max_new_tokens: int = 8):
    group = wire.Group(group_id="g", prompt_ids=[1, 2], n=2, seed=1, task={})
    backend = SimpleNamespace(tokenizer=None)
    wv = {"max_new_tokens": max_new_tokens, "temperature": 1.0}
    return generate_and_score(backend, Game(length), wv, threading.Event(), [group])


def test_an_episode_past_the_adapters_limit_stops_the_worker_naming_the_adapter():
    with pytest.raises(AdapterFault) as err:
        run(70)
    text = str(err.value)
    assert (
        "mastermind-lite" in text and "70 tokens" in text and "max_completion_tokens = 48" in text
    )
    assert "not this worker's fault" in text
    assert isinstance(err.value, WorkerError)  # echo-worker join prints it and exits 1


def test_episodes_within_the_limit_are_scored():
    out = run(48)
    assert [[r for _, r in g] for g in out] == [[1.0, 1.0]]
    assert len(run(60, max_new_tokens=64)[0]) == 2  # a longer worker.max_new_tokens admits it


# ----------------------------------------------------------------------------- the learner's side


@pytest.mark.strikes(2)
def test_a_limit_two_independent_workers_overrun_alike_is_the_runs_fault_not_theirs(
    trusting,  # noqa: F811
    ctx,  # noqa: F811
    tokenizer,
    caplog,
):
    """A record over worker.max_new_tokens is refused (bad_length) and the rest of its group
    arrives partial, a failed check: a lone worker doing so is struck. The same refusal from a
    second independent worker makes it the run's own limit: the first one's strike is
    forgiven, nobody is struck for it again (before: both honest workers quarantined within
    a second, the console silent), the log names the adapter and the fix, and nothing over
    the limit is admitted."""
    import logging

    from test_control import ask, connect
    from test_trust import honest

    too_long = [11] * (trusting.intake.limits.max_new_tokens + 1)

    def over(group, worker, bid):
        recs = [{**r, "worker_id": worker} for r in honest(trusting, group, tokenizer)]
        recs[0].update(completion_ids=too_long, logprobs=[-1.0] * len(too_long))
        payload = wire.pack_records(recs)
        return wire.Trajectories(worker_id=worker, batch_id=bid, count=len(recs), payload=payload)

    a, b = connect(trusting, ctx), connect(trusting, ctx)
    ask(a, wire.Join(worker_id="w1"))
    ask(b, wire.Join(worker_id="w2"))
    ga = ask(a, wire.WorkRequest(worker_id="w1", max_groups=2)).groups
    gb = ask(b, wire.WorkRequest(worker_id="w2", max_groups=1)).groups
    strikes = trusting.intake.reputation.strikes
    refused = {"bad_length": 1, "partial_group": 3}
    with caplog.at_level(logging.ERROR, logger="echo.learner"):
        assert ask(a, over(ga[0], "w1", "b1")).rejected == refused
        assert strikes["w1"] == 1  # one worker alone: maybe a liar
        assert ask(b, over(gb[0], "w2", "b2")).rejected == refused
        assert (strikes["w1"], strikes["w2"]) == (0, 0)  # the run's own: forgiven, not struck
        ack = ask(a, over(ga[1], "w1", "b3"))  # before: the second strike, quarantine
    assert ack.rejected == refused and ack.accepted == 0
    assert strikes["w1"] == 0 and not trusting.intake.reputation.quarantined
    said = [r.getMessage() for r in caplog.records if "independent workers" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("adapter toy-add: records refused as bad_length")
    assert "worker.max_new_tokens" in said[0] and "strikes forgiven: {'w1': 1}" in said[0]
    assert trusting.buffer.depth().ready_groups == 0  # nothing over the limit admitted


def test_one_witness_under_many_keys_stays_one_and_is_struck():
    """A token's keys are one witness (Gate.witness): a liar's second key does not make its
    over-long records the run's fault."""
    from echo_rl.control.faults import FaultBook

    class Rep:
        def forgive(self, worker_id, n):
            raise AssertionError("forgave a lone witness")

    book = FaultBook(lambda key: "token:abc", Rep(), "toy-add")
    assert [book.owns("bad_length", f"w{i}", f"k{i}", "17 tokens") for i in range(5)] == [False] * 5
    assert book.struck["bad_length"] == {f"w{i}": 1 for i in range(5)}
