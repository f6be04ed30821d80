"""A LoRA run with real processes on loopback (issue 32): the learner trains an adapter, every
version it publishes is the adapter alone (a few KB on the toy model, deltas after the first),
and the workers install each one on the base they hold and generate from it; the auditor,
recomputing under base + the claimed version's adapter, finds the honest workers honest."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from test_integration import Cluster, rows, wait_rows

from echo_rl.core.config import LoraConfig

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture
def cluster(tmp_path, small_cfg):
    c = Cluster(tmp_path, small_cfg)
    yield c
    c.group.stop_all()


def full_model_bytes(cfg) -> int:
    from echo_rl.core.models import load_model, load_tokenizer

    model = load_model(cfg.model, load_tokenizer(cfg.model))
    return sum(p.numel() for p in model.parameters()) * 2  # bf16, tied weights once


def test_lora_run_advances_and_workers_install_adapter_versions(cluster):
    cfg = cluster.cfg
    cfg.learner.lora = LoraConfig(enabled=True, rank=4, alpha=8.0)
    cfg.broadcast.dtype = "bfloat16"
    cfg.broadcast.keyframe_every = 1000
    cfg.broadcast.delta_max_ratio = 1.0
    cfg.security.probation_groups = 4  # each worker's first groups are audited
    run = cluster.learner(max_steps=10_000)
    cluster.worker("w0")
    cluster.worker("w1")
    for w in ("w0", "w1"):  # each installs adapter versions beyond the first, and generates
        wait_installs(cluster.tmp / f"{w}.log", 3)
    # Three installed versions (v0..v2) imply only two finished steps: wait for the third row.
    wait_rows(run, 3)
    cluster.group.stop("learner", timeout=60)
    got = rows(run)
    assert len(got) >= 3 and [r["step"] for r in got] == list(range(len(got)))
    assert all(r["staleness_max"] <= cfg.learner.staleness for r in got)

    # A version is the adapter: a small share of the whole model, deltas after the keyframe.
    full = full_model_bytes(cfg)
    sizes = {r["publish_full_bytes"] for r in got if "publish_full_bytes" in r}
    assert len(sizes) == 1 and sizes.pop() < 0.2 * full
    assert any(r.get("publish_encoding") == "delta" for r in got)
    # The auditor recomputed under base + the claimed adapter: the honest workers pass.
    assert got[-1]["audits"] > 0 and got[-1]["audit_failures"] == 0, [
        {
            k: r.get(k)
            for k in (
                "step",
                "audits",
                "audit_queue",
                "audits_expired",
                "audits_dropped",
                "t_audit",
                "t_train",
            )
        }
        for r in got
    ]
    assert (run / "checkpoints" / "latest").exists()
    assert "LoRA rank 4 on all-linear" in (run / "learner.log").read_text()


def wait_installs(log: Path, n: int, timeout: float = 120) -> set[int]:
    """Polls a worker's log (its only progress signal here) for ``n`` installed versions."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = log.read_text() if log.exists() else ""
        versions = {int(v) for v in re.findall(r"installed snapshot v(\d+)", text)}
        if len(versions) >= n:
            return versions
        time.sleep(0.2)
    raise AssertionError(
        f"{log.name}: fewer than {n} installed versions within {timeout}s; "
        f"its log ends:\n{text[-3000:]}"
    )


def test_a_lora_run_resumes_from_its_adapter_checkpoint(cluster):
    from echo_rl.learner.checkpoint import load_checkpoint

    cluster.cfg.learner.lora = LoraConfig(enabled=True, rank=4, alpha=8.0)
    run = cluster.learner("first", max_steps=4)
    cluster.worker("w0")
    assert cluster.wait("first") == 0 and cluster.wait("w0", 30) == 0
    ckpt = load_checkpoint(run)
    assert ckpt["step"] == 3 and ckpt["model"] and all(".lora_" in k for k in ckpt["model"])
    cluster.learner("second", resume=run, max_steps=7)
    cluster.worker("w1")
    assert cluster.wait("second") == 0
    got = rows(run)
    assert [r["step"] for r in got] == list(range(7)) and all(
        r["version"] == r["step"] for r in got
    )
    assert "resumed at step 4" in (run / "learner.log").read_text()
