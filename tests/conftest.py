from __future__ import annotations

import random

import pytest

from echo.config import EchoConfig


@pytest.fixture(scope="session")
def tokenizer():
    from echo.models import build_tiny_tokenizer

    return build_tiny_tokenizer()


@pytest.fixture
def small_cfg() -> EchoConfig:
    """A config small enough for in-process and loopback tests."""
    return EchoConfig.model_validate({
        "learner": {"prompts_per_step": 4, "group_size": 4, "max_steps": 6, "staleness": 2,
                    "wait_timeout_s": 60},
        "buffer": {"capacity_groups": 16},
        "worker": {"groups_per_request": 2, "heartbeat_s": 0.3},
        "transport": {"heartbeat_timeout_s": 3.0, "request_timeout_s": 3.0, "max_message_mib": 1.0},
        "broadcast": {"dtype": "float32", "chunk_kib": 64},
    })


@pytest.fixture
def rng() -> random.Random:
    return random.Random(1234)
