"""``make gpu-check`` cannot rot between GPU runs: its dry run (every stage's code path on the
CPU with the tiny model) runs here, and the JSON a GPU run returns has the same layout."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_dry_run_exercises_every_stage_and_writes_the_layout(tmp_path):
    out = tmp_path / "out"
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_suite.py"), "--dry-run", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=560,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    res = json.loads((out / "gpu_check.json").read_text())
    stages = res["stages"]
    assert list(stages) == ["model", "tests", "learner", "generation", "relay", "learning"]
    assert all(s["outcome"] == "ok" for s in stages.values()), {
        k: s["outcome"] for k, s in stages.items()
    }
    assert stages["tests"]["failed"] == 0 and stages["tests"]["skipped"] >= 1  # no GPU: they say so
    for case in ("smollm2_full", "qwen3_1b_full", "smollm2_lora", "qwen3_1b_lora"):
        c = stages["learner"][case]
        assert "skipped" in c or (c["tokens_per_s"] > 0 and c["tflops_per_s"] > 0), case
    assert stages["learner"]["smollm2_full"]["mfu"] is None  # no GPU peak to divide by
    for rows in (1, 16, 64):
        assert stages["generation"][f"batch_{rows}"]["sequences"] == rows
    assert stages["generation"]["install"]["seconds_median"] > 0
    relay = stages["relay"]["runs"][0]
    assert relay["corrupt_installs"] == 0 and relay["echo_mb_s"] > 0 and relay["bare_mb_s"] > 0
    curve = stages["learning"]["curve"]
    assert [r["step"] for r in curve] == [0, 1, 2] and all("reward_mean" in r for r in curve)
    assert res["learning_curve_png"] and (out / "learning_curve.png").stat().st_size > 0
    assert (out / "learning_metrics.jsonl").is_file() and (out / "gpu_check.log").stat().st_size > 0
    assert "learning" in run.stdout and "wrote" in run.stdout  # the table is printed


def test_a_stage_past_its_budget_is_stopped_and_the_others_still_run(tmp_path, monkeypatch):
    from benchmarks import gpu_suite

    monkeypatch.setitem(gpu_suite.DRY_BUDGETS, "tests", 1)  # pytest alone takes longer to start
    res = gpu_suite.main(["--dry-run", "--out", str(tmp_path), "--stages", "tests,model"])
    assert res["stages"]["tests"]["outcome"] == "timed out"
    assert res["stages"]["model"]["outcome"] == "ok"
