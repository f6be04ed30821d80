from __future__ import annotations

import random

import pytest

from echo_rl.core.config import EchoConfig

TIERS = ("unit", "integration", "lab")


def tier_of(item: pytest.Item) -> str:
    """A test's tier: an explicit tier marker, else ``lab`` for what needs a prepared machine
    (namespaces, a GPU), ``integration`` for what starts processes (``slow``), else ``unit``."""
    for tier in TIERS:
        if item.get_closest_marker(tier) is not None:
            return tier
    if item.get_closest_marker("netns") or item.get_closest_marker("gpu"):
        return "lab"
    return "integration" if item.get_closest_marker("slow") else "unit"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--durations-json",
        default=None,
        metavar="PATH",
        help="write every test's seconds (setup + call + teardown) and tier here, slowest "
        "first (make test-durations: tests/durations.json); read only to report",
    )


_SECONDS: dict[str, float] = {}
_TIER: dict[str, str] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _SECONDS[report.nodeid] = _SECONDS.get(report.nodeid, 0.0) + report.duration


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    path = session.config.getoption("--durations-json", default=None)
    if not path or not _SECONDS:
        return
    import json
    import platform
    from pathlib import Path

    tests = sorted(_SECONDS.items(), key=lambda kv: -kv[1])
    by_tier: dict[str, float] = {}
    for node, secs in tests:
        by_tier[_TIER.get(node, "unit")] = by_tier.get(_TIER.get(node, "unit"), 0.0) + secs
    Path(path).write_text(
        json.dumps(
            {
                "machine": {
                    "cpus": __import__("os").cpu_count(),
                    "python": platform.python_version(),
                },
                "total_s": round(sum(_SECONDS.values()), 1),
                "by_tier_s": {k: round(v, 1) for k, v in sorted(by_tier.items())},
                "tests": [
                    {"test": node, "seconds": round(secs, 3), "tier": _TIER.get(node, "unit")}
                    for node, secs in tests
                ],
            },
            indent=1,
        )
        + "\n"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """One tier marker per test, so ``-m unit`` (``make test-fast``) selects the inner loop."""
    for item in items:
        tier = tier_of(item)
        _TIER[item.nodeid] = tier
        if item.get_closest_marker(tier) is None:
            item.add_marker(tier)


@pytest.fixture(scope="session", autouse=True)
def _worker_status_dir(tmp_path_factory):
    """Workers started by tests keep their status files here, not in the user's home."""
    import os

    old = os.environ.get("ECHO_STATUS_DIR")
    os.environ["ECHO_STATUS_DIR"] = str(tmp_path_factory.mktemp("worker-status"))
    yield
    if old is None:
        os.environ.pop("ECHO_STATUS_DIR", None)
    else:
        os.environ["ECHO_STATUS_DIR"] = old


@pytest.fixture(scope="session")
def tokenizer():
    from echo_rl.core.models import build_tiny_tokenizer

    return build_tiny_tokenizer()


@pytest.fixture
def small_cfg() -> EchoConfig:
    """A config small enough for in-process and loopback tests."""
    return EchoConfig.model_validate(
        {
            "learner": {
                "prompts_per_step": 4,
                "group_size": 4,
                "max_steps": 6,
                "staleness": 2,
                "wait_timeout_s": 60,
            },
            "buffer": {"capacity_groups": 16},
            "worker": {"groups_per_request": 2, "heartbeat_s": 0.3},
            "transport": {
                "heartbeat_timeout_s": 3.0,
                "request_timeout_s": 3.0,
                "max_message_mib": 1.0,
            },
            "broadcast": {"dtype": "float32", "chunk_mib": 0.0625},
        }
    )


@pytest.fixture
def rng() -> random.Random:
    return random.Random(1234)
