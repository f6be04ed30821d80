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
    assert list(stages) == [
        "model",
        "tests",
        "learner",
        "generation",
        "residency",
        "relay",
        "learning",
    ]
    assert all(s["outcome"] == "ok" for s in stages.values()), {
        k: s["outcome"] for k, s in stages.items()
    }
    assert stages["tests"]["failed"] == 0 and stages["tests"]["skipped"] >= 1  # no GPU: they say so
    for case in ("smollm2_full", "qwen3_1b_full", "smollm2_lora", "qwen3_1b_lora"):
        c = stages["learner"][case]
        assert "skipped" in c or (c["tokens_per_s"] > 0 and c["tflops_per_s"] > 0), case
    # the fused head's baseline beside it
    for case in ("smollm2_full_head_off", "qwen3_1b_full_head_off"):
        assert stages["learner"][case]["settings"]["fused_head"] is False, case
        assert stages["learner"][case]["tokens_per_s"] > 0, case
    assert stages["learner"]["smollm2_full_compiled"]["settings"]["compile"] is True
    head = stages["learner"]["head"]["summary"]["300"]  # the head alone, plain and fused
    assert head["time_fused_over_plain"] > 0 and head["peak_mib_fused"] > 0
    assert stages["learner"]["smollm2_full"]["mfu"] is None  # no GPU peak to divide by
    for rows in (1, 16, 64):
        assert stages["generation"][f"batch_{rows}"]["sequences"] == rows
    assert stages["generation"]["install"]["seconds_median"] > 0
    tiny = stages["residency"]["tiny"]
    assert tiny["unchanged_after_cycles"] and tiny["pinned"]["park_s"]
    relay = stages["relay"]["runs"][0]
    assert relay["corrupt_installs"] == 0 and relay["echo_mb_s"] > 0 and relay["bare_mb_s"] > 0
    curve = stages["learning"]["curve"]
    assert [r["step"] for r in curve] == [0, 1, 2] and all("reward_mean" in r for r in curve)
    paired = stages["learning"]["eval"]["paired"]  # the held-out rise, with its CI
    assert paired["difference"] == "step 3 - untrained" and paired["lo"] <= paired["mean"]
    for rows in (1, 16, 64):  # both backends side by side
        m = stages["generation"]["gen_speed"]["batches"][str(rows)]
        assert m["transformers"]["tokens_per_s"] > 0 and m["engine"]["tokens_per_s"] > 0
    assert res["learning_curve_png"] and (out / "learning_curve.png").stat().st_size > 0
    assert (out / "learning_metrics.jsonl").is_file() and (out / "gpu_check.log").stat().st_size > 0
    assert "learning" in run.stdout and "wrote" in run.stdout  # the table is printed


def test_a_stage_past_its_budget_is_stopped_and_the_others_still_run(tmp_path, monkeypatch):
    from benchmarks import gpu_suite

    monkeypatch.setitem(gpu_suite.DRY_BUDGETS, "tests", 1)  # pytest alone takes longer to start
    res = gpu_suite.main(["--dry-run", "--out", str(tmp_path), "--stages", "tests,model"])
    assert res["stages"]["tests"]["outcome"] == "timed out"
    assert res["stages"]["model"]["outcome"] == "ok"


def test_the_weights_are_cut_so_every_call_fits_beside_the_tree():
    from benchmarks.gpu_carry import CALL_MIB, MARGIN_MIB, part_bounds

    total = int(93.8 * 2**20)
    for tree in (9.0, 20.0, 40.0):
        bounds = part_bounds(total, tree, 10.6)
        sizes = [(b - a) / 2**20 for a, b in zip(bounds, bounds[1:])]
        assert bounds[0] == 0 and bounds[-1] == total and all(s > 0 for s in sizes)
        assert sizes[0] + 10.6 + tree <= CALL_MIB - MARGIN_MIB  # the first call carries the wheels
        assert all(s + tree <= CALL_MIB - MARGIN_MIB for s in sizes[1:])
    assert len(part_bounds(total, 9.0, 10.6)) == 3  # two calls while the tree is small
    with pytest.raises(SystemExit, match="no room"):
        part_bounds(total, 55.0, 10.6)


def test_parts_carried_in_separate_calls_are_joined_once_all_are_in(tmp_path):
    """What docs/gpu.md's two calls do on the machine: each carries a part folder
    (``--weights .gpu/partN``), the stash keeps it, and the GGUF is joined and checked once
    every part of the manifest is in."""
    import hashlib
    import json as _json

    from benchmarks.gpu_suite import GGUF_NAME, stash_weights

    data = bytes(range(256)) * 1000
    names = [f"{GGUF_NAME}.part{i}" for i in range(2)]
    man = {"parts": names, "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    folders = []
    for i, (lo, hi) in enumerate([(0, 100_000), (100_000, len(data))]):
        f = tmp_path / "carried" / f"part{i}"
        f.mkdir(parents=True)
        (f / names[i]).write_bytes(data[lo:hi])
        (f / "manifest.json").write_text(_json.dumps(man))
        folders.append(f)
    stash = tmp_path / "stash"
    assert "waiting for" in stash_weights([folders[0]], stash)["state"]
    got = stash_weights([folders[1]], stash)
    assert got["state"] == "joined" and (stash / GGUF_NAME).read_bytes() == data
    assert stash_weights([], stash)["state"] == "joined earlier"
    bad = tmp_path / "stash-bad"
    (folders[1] / names[1]).write_bytes(b"x" + data[100_001:])  # a part damaged in transit
    stash_weights([folders[0]], bad)
    assert "SHA-256 differs" in stash_weights([folders[1]], bad)["state"]
    assert not (bad / GGUF_NAME).exists()
