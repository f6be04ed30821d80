"""The learner under torchrun (FSDP2, gloo on CPU): same math as one process, same system."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from echo_rl.core.procs import ProcessGroup, wait_ready

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_fsdp2_two_ranks_match_single_process(tmp_path):
    script = str(ROOT / "tests" / "torchrun_steps.py")
    env = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    one = subprocess.run(
        [sys.executable, script, str(tmp_path / "one.pt")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        env={**_env(), **env},
    )
    assert one.returncode == 0, one.stderr[-2000:]
    two = subprocess.run(
        [*TORCHRUN, script, str(tmp_path / "two.pt")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        env={**_env(), **env},
    )
    assert two.returncode == 0, two.stderr[-2000:]
    one_run, two_run = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "two.pt")
    a, b = one_run["params"], two_run["params"]
    assert a.keys() == b.keys()
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert worst < 1e-4, worst
    assert all(torch.isfinite(t).all() for t in b.values())
    # the non-finite update was skipped by both ranks together, and by the single process
    assert [s["skipped_nonfinite"] for s in two_run["stats"]] == [0, 0, 0, 1]
    assert [s["skipped_nonfinite"] for s in one_run["stats"]] == [0, 0, 0, 1]
    # the statistics rank 0 reports are the whole batch's, not its own shard's
    for single, fsdp in zip(one_run["stats"], two_run["stats"]):
        for k in ("loss", "clip_frac", "is_weight_mean", "grad_norm"):
            assert fsdp[k] == pytest.approx(single[k], rel=1e-4, abs=1e-6), k


def test_fsdp2_lora_two_ranks_match_single_process(tmp_path):
    """LoRA under FSDP2 (issue 32): the adapter trains on both ranks' shards as in one process
    (with the KL term to the adapter-disabled base), and a checkpoint of the adapter alone
    loads back into the sharded model."""
    script = str(ROOT / "tests" / "torchrun_steps.py")
    env = {**_env(), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for argv, out in (([sys.executable], "one.pt"), (TORCHRUN, "two.pt")):
        run = subprocess.run(
            [*argv, script, str(tmp_path / out), "lora"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=240,
            env=env,
        )
        assert run.returncode == 0, run.stderr[-2000:]
    one, two = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "two.pt")
    a, b = one["params"], two["params"]
    assert a.keys() == b.keys() and all(".lora_" in k for k in a)  # the adapter alone
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-4
    assert max(float(b[k].abs().max()) for k in b if ".lora_B." in k) > 1e-3  # it trained
    assert all(torch.equal(two["reloaded"][k], b[k]) for k in b)
    assert [s["skipped_nonfinite"] for s in two["stats"]] == [0, 0, 0, 1]
    for single, fsdp in zip(one["stats"], two["stats"]):
        for k in ("loss", "kl_mean", "grad_norm"):
            assert fsdp[k] == pytest.approx(single[k], rel=1e-4, abs=1e-6), k
    assert two["stats"][-1]["kl_mean"] > 0


def test_learner_runs_under_torchrun_with_a_worker(tmp_path, small_cfg):
    from echo_rl.core.config import dump_toml

    conf = tmp_path / "cfg.toml"
    small_cfg.learner.max_steps = 4
    conf.write_text(dump_toml(small_cfg))
    group = ProcessGroup()
    try:
        learner = group.start(
            "learner",
            [
                *TORCHRUN,
                "-m",
                "echo_rl.cli.rl",
                "learn",
                str(conf),
                "--run-dir",
                str(tmp_path / "run"),
            ],
            tmp_path / "learner.err",
            pipe_stdout=True,
        )
        endpoint = wait_ready(learner, timeout=180)
        group.start(
            "w0",
            [
                sys.executable,
                "-m",
                "echo_rl.cli.worker",
                "join",
                endpoint,
                "--id",
                "w0",
                "--identity",
                str(tmp_path / "w0.key"),
            ],
            tmp_path / "w0.log",
        )
        assert learner.wait(240) == 0, (tmp_path / "learner.err").read_text()[-2000:]
        rows = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
        assert len(rows) == 4
        assert "ranks=2" in (tmp_path / "run" / "learner.log").read_text()
    finally:
        group.stop_all()


def _env():
    import os

    return dict(os.environ)
