"""The run's held-out evaluation (echo_rl/learner/heldout.py, echo_rl/learner/evaluator.py; docs/learner.md
"Watching the policy"): checkpoints scored by a process beside the learner exactly as
``echo-rl eval`` scores them, the best kept as checkpoints/best.pt, a checkpoint waiting behind
another replaced by a newer one, an evaluator that fails named without stopping the run, and a
whole run built to collapse: warned, stopped, its best checkpoint the one before."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from echo_rl.core.config import HeldoutConfig
from echo_rl.core.steprow import read_rows
from echo_rl.learner.checkpoint import best_checkpoint, checkpoint_name
from echo_rl.learner.evaluation import read_state
from echo_rl.learner.heldout import HeldoutEval
from tests.test_eval_run import make_run

ROOT = Path(__file__).resolve().parents[1]
TOY = {"adapter": {"name": "toy-add", "options": {"heldout": 12}}, "worker": {"max_new_tokens": 3}}
pytestmark = pytest.mark.integration


def heldout(run: Path, every: int = 3) -> HeldoutEval:
    hc = HeldoutConfig(every=every, prompts=12, samples=2, final_wait_s=120)
    return HeldoutEval(hc, run, max_steps=100, steps=0)


@pytest.mark.timeout(180)
def test_checkpoints_are_scored_as_eval_scores_them_and_the_best_is_kept(tmp_path):
    from echo_rl.cli.commands.evaluate import evaluate

    run = make_run(tmp_path, TOY, steps=(0, 3, 6, 9), noise=2.0)
    ckpt = run / "checkpoints"
    ev = heldout(run)
    try:
        ev.offer(0, ckpt / checkpoint_name(0))  # scored at once
        ev.offer(1, ckpt / checkpoint_name(3))  # not due (the next is 3): nothing
        ev.offer(3, ckpt / checkpoint_name(3))  # waits behind 0 ...
        ev.offer(6, ckpt / checkpoint_name(6))  # ... and is replaced by 6
        assert ev.skipped == 1
        assert {p.name for p in ckpt.glob("eval-*.pt")} == {"eval-00000000.pt", "eval-00000006.pt"}
        ev.finish()
        ev.offer(9, ckpt / checkpoint_name(9))
        ev.finish()
        assert ev.failed is None
    finally:
        ev.close()
    rows = [json.loads(x) for x in (run / "heldout.jsonl").read_text().splitlines()]
    assert [r["steps"] for r in rows] == [0, 6, 9]
    assert not list(ckpt.glob("eval-*.pt"))  # every link went: kept as best, or removed
    found = best_checkpoint(run)
    assert found is not None
    path, best = found
    top = max(rows, key=lambda r: r["mean"])
    assert best.steps == top["steps"] and best.mean == top["mean"]
    kept = read_state(path)  # best.pt is that checkpoint, byte for byte in its tensors
    same = read_state(ckpt / checkpoint_name(best.steps))
    assert kept.keys() == same.keys() and all(torch.equal(kept[k], same[k]) for k in kept)
    # what echo-rl eval prints for that checkpoint, on the same prompts and seeds
    res = evaluate(run, "best", split="heldout", n=12, samples=2, threads=1)
    assert res["policies"][0]["policy"] == f"best (step {best.steps})"
    assert res["policies"][0]["per_prompt"] == [round(x, 6) for x in best.per_prompt]
    by_step = evaluate(run, str(rows[1]["steps"]), split="heldout", n=12, samples=2, threads=1)
    assert by_step["policies"][0]["reward"]["mean"] == pytest.approx(rows[1]["mean"], abs=1e-6)


@pytest.mark.timeout(180)
def test_a_checkpoint_that_does_not_fit_is_named_and_the_run_goes_on(tmp_path, caplog):
    run = make_run(tmp_path, TOY, steps=(0,))
    bad = run / "checkpoints" / checkpoint_name(3)
    torch.save({"step": 2, "model": {"model.embed_tokens.weight": torch.zeros(3, 3)}}, bad)
    ev = heldout(run)
    try:
        with caplog.at_level(logging.WARNING, logger="echo.learner"):
            ev.offer(3, bad)
            ev.finish()
        assert ev.failed is not None and "eval-00000003.pt" in ev.failed
        assert "does not fit the run's model" in ev.failed
        said = " ".join(r.getMessage() for r in caplog.records)
        assert "the run goes on without it" in said
        ev.offer(6, run / "checkpoints" / checkpoint_name(0))  # after a failure: no-op
        assert not list((run / "checkpoints").glob("eval-*.pt"))
    finally:
        ev.close()
    assert best_checkpoint(run) is None


@pytest.mark.timeout(300)
def test_a_run_built_to_collapse_is_warned_stopped_and_keeps_its_best(tmp_path):
    """The quickstart's toy at a learning rate 500 times its own: the policy turns
    deterministic within a few steps and every group scores alike."""
    run = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "echo_rl.cli.rl",
        "quickstart",
        "--config",
        str(ROOT / "examples/quickstart.toml"),
        "--run-dir",
        str(run),
        "--set",
        "learner.max_steps=40",
        "--set",
        "adapter.presets.toy-add.heldout=16",
        "--set",
        "learner.heldout.every=3",
        "--set",
        "learner.heldout.prompts=16",
        "--set",
        "quickstart.workers=2",
        "--set",
        "learner.lr=0.5",
        "--set",
        "learner.beta=0",
        "--set",
        'learner.collapse="stop"',
    ]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = read_rows(run / "metrics.jsonl")
    flagged = [r.step for r in rows if r.collapse]
    assert flagged and len(rows) == flagged[0] + 1 < 40  # stopped at the first flagged step
    summary = json.loads((run / "summary.json").read_text())
    assert summary["ended"].startswith(f"stopped: the policy collapsed at step {flagged[0]}")
    log = (run / "learner.log").read_text()
    assert "the policy looks to be collapsing" in log and "learner.beta = 0.1" in log
    assert "COLLAPSING" in done.stdout  # the console says it too
    found = best_checkpoint(run)
    assert found is not None
    scores = [json.loads(x) for x in (run / "heldout.jsonl").read_text().splitlines()]
    assert found[1].mean == max(s["mean"] for s in scores)
    assert found[1].steps < flagged[0]  # the best is a policy from before the warning
    assert rows[-1].best_step == found[1].steps
    assert not list((run / "checkpoints").glob("eval-*.pt"))
