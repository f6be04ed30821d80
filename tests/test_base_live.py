"""The base model travels once (issue 32, item 3), with real processes on loopback: a LoRA run
on a model folder (the tiny model saved with save_pretrained); the folder is moved away once the
learner has published it, so a worker can only get it over the chunk servers. Worker 1 (empty
cache) fetches every base byte; worker 2 (the same cache, ``ECHO_HOME``) fetches none; worker 3
(a cache of its own) fetches it from a peer, not the learner. Each installs adapter versions."""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path

import pytest
from test_integration import Cluster
from test_lora_live import wait_installs

from echo_rl.core.config import LoraConfig, dump_toml
from echo_rl.core.models import engine_model_dir
from echo_rl.core.procs import python_argv, wait_ready

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

FETCHED = re.compile(r"base model \w+\.\.\. fetched: (\d+) bytes in \d+ chunks from ([^,\s]+)")


@pytest.fixture
def cluster(tmp_path, small_cfg):
    c = Cluster(tmp_path, small_cfg)
    yield c
    c.group.stop_all()


def start_worker(cluster: Cluster, name: str, home: Path) -> Path:
    log = cluster.tmp / f"{name}.log"
    cluster.group.start(
        name,
        python_argv(
            "echo_rl.cli.worker",
            "join",
            cluster.endpoint,
            "--id",
            name,
            "--identity",
            str(cluster.tmp / f"{name}.key"),
        ),
        log,
        env={"ECHO_HOME": str(home)},
    )
    return log


def wait_line(log: Path, pattern: str, timeout: float = 150) -> re.Match:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = re.search(pattern, log.read_text() if log.exists() else "")
        if m:
            return m
        time.sleep(0.2)
    raise AssertionError(
        f"{pattern!r} not in {log} within {timeout}s:\n"
        + (log.read_text()[-3000:] if log.exists() else "(no log)")
    )


def start_learner(cluster: Cluster, host: Path) -> Path:
    """The learner in its own working directory ``host``, where ``model.name`` (a relative
    path) is: the workers' directory has no such folder, as on another machine."""
    run, conf = cluster.tmp / "learner", cluster.tmp / "learner.toml"
    run.mkdir()
    conf.write_text(dump_toml(cluster.cfg))
    proc = cluster.group.start(
        "learner",
        python_argv("echo_rl.cli.rl", "learn", str(conf), "--run-dir", str(run)),
        cluster.tmp / "learner.err",
        pipe_stdout=True,
        cwd=host,
    )
    cluster.endpoint = wait_ready(proc, timeout=120)
    return run


def test_second_worker_on_the_same_base_fetches_no_base_bytes(cluster):
    cfg = cluster.cfg
    host = cluster.tmp / "learner-host"
    saved = engine_model_dir(cfg.model, cluster.tmp / "saved")  # the tiny model, on disk
    shutil.copytree(saved, host / "base-model")
    cfg.model.name = "base-model"
    cfg.learner.lora = LoraConfig(enabled=True, rank=4, alpha=8.0)
    cfg.learner.max_steps = 10_000
    run = start_learner(cluster, host)
    assert not Path("base-model").exists()  # the workers' working directory
    learner_log = (run / "learner.log").read_text()
    published = re.search(
        r"base model (\w+)\.\.\. published for workers without it: \d+ files, "
        r"(\d+) bytes",
        learner_log,
    )
    assert published, learner_log[-2000:]
    base_bytes = int(published.group(2))

    w1 = start_worker(cluster, "w1", cluster.tmp / "home1")
    got = FETCHED.search(wait_line(w1, FETCHED.pattern).group(0))
    assert int(got.group(1)) == base_bytes  # every byte, once
    wait_installs(w1, 2)
    cached = cluster.tmp / "home1" / "base"
    assert [p.name[:16] for p in cached.iterdir()] == [published.group(1)]

    w2 = start_worker(cluster, "w2", cluster.tmp / "home1")  # same machine, same cache
    wait_line(w2, r"found in the cache at \S+: 0 bytes fetched")
    wait_installs(w2, 2)
    assert "fetched:" not in w2.read_text()
    status = {
        w: json.loads((Path(os.environ["ECHO_STATUS_DIR"]) / f"{w}.json").read_text())
        for w in ("w1", "w2")
    }  # the workers' status files: the same counts
    assert [(s["base_origin"], s["base_fetched_bytes"]) for s in status.values()] == [
        ("fetched", base_bytes),
        ("cache", 0),
    ]

    w3 = start_worker(cluster, "w3", cluster.tmp / "home3")  # another machine: from a peer
    got3 = FETCHED.search(wait_line(w3, FETCHED.pattern).group(0))
    assert int(got3.group(1)) == base_bytes
    wait_installs(w3, 2)
    text = (run / "learner.log").read_text()
    grants = dict(re.findall(r"worker (w\d): base model from (\S+) \(no_base\)", text))
    relays = dict(re.findall(r"worker (w\d) joined \(key \w+, price [^,]+, relay (\S+)\)", text))
    assert grants["w1"] not in relays.values()  # nobody held it yet: the learner served w1
    assert grants["w3"] == got3.group(2)
    assert got3.group(2) in (relays["w1"], relays["w2"])  # a peer served w3, not the learner
