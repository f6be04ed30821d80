"""The task's sequences against the positions the model was built for (issue 56, item 3): a
70-token episode on a 64-position model is said at start-up, with the keys that fix it."""

from __future__ import annotations

import itertools
import logging
from types import SimpleNamespace

import pytest

from echo_rl.core.config import EchoConfig
from echo_rl.learner.startup import say_length_fit

pytestmark = pytest.mark.timeout(30)


def adapter(prompt_len: int, episode: int = 0):
    prompt = SimpleNamespace(prompt_ids=[1] * prompt_len)
    return SimpleNamespace(
        prompts=lambda rng: itertools.repeat(prompt),
        multi_turn=bool(episode),
        max_completion_tokens=episode,
    )


MODEL = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=64))


def test_an_episode_longer_than_the_models_positions_is_said(caplog):
    cfg = EchoConfig.model_validate({"worker": {"max_new_tokens": 8}})
    with caplog.at_level(logging.WARNING, logger="echo.learner"):
        why = say_length_fit(cfg, adapter(12, episode=58), None, MODEL)
    assert "needs 70 positions" in why and "built for 64" in why
    assert "max_completion_tokens = 58" in why and "model.max_positions" in why
    assert [r.getMessage() for r in caplog.records] == [why]


def test_a_task_that_fits_says_nothing(caplog):
    cfg = EchoConfig.model_validate({"worker": {"max_new_tokens": 8}})
    with caplog.at_level(logging.WARNING, logger="echo.learner"):
        assert say_length_fit(cfg, adapter(12), None, MODEL) == ""
        assert say_length_fit(cfg, adapter(56), None, MODEL) == ""  # 56 + 8 = 64: fits
        assert say_length_fit(cfg, adapter(57), None, MODEL) != ""
    assert len(caplog.records) == 1
