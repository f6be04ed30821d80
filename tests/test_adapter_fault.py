"""An adapter's own limit is never judged as a worker's lie (issue 56, item 1): episodes that
outgrow the adapter's ``max_completion_tokens`` stop the worker with a message naming the
adapter and the setting, instead of being delivered, refused as ``bad_length`` and counted
against an honest worker until it is banned."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from dataplane.episodes import EpisodeSample
from echo import wire
from worker.scoring import AdapterFault, generate_and_score
from worker.session import WorkerError

pytestmark = pytest.mark.timeout(30)


class Game:
    """A multi-turn adapter whose episodes are ``length`` tokens long."""

    name = "mastermind-lite"
    multi_turn = True
    max_completion_tokens = 48

    def __init__(self, length: int):
        self.length = length

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
