"""Checkpoint files are named by the steps taken (issue 37, point 12): a 1-step run leaves
after-00000000.pt (the start) and after-00000001.pt, and a 200-step run ends at
after-00000200.pt when progress says 200/200. Run folders written with the older names
(step--0000001.pt, step-00000199.pt: the last step's index) still load, resume and evaluate."""

from pathlib import Path

import pytest

from echo_rl.learner.checkpoint import (
    checkpoint_name,
    kept_checkpoints,
    load_checkpoint,
    save_checkpoint,
    steps_of,
)

pytestmark = pytest.mark.timeout(60)


def names(run: Path) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").glob("*.pt"))


def test_a_one_step_run_is_named_by_steps_taken(tmp_path):
    save_checkpoint(tmp_path, -1, {"step": -1, "model": {}})  # the learner's start
    save_checkpoint(tmp_path, 0, {"step": 0, "model": {}})  # after its one step
    assert names(tmp_path) == ["after-00000000.pt", "after-00000001.pt"]
    assert (tmp_path / "checkpoints" / "latest").read_text() == "after-00000001.pt"
    assert load_checkpoint(tmp_path)["step"] == 0  # the state keeps the last step's index
    save_checkpoint(tmp_path, 199, {"step": 199, "model": {}})  # step 200 of 200
    assert names(tmp_path) == ["after-00000001.pt", "after-00000200.pt"]  # the newest two


def test_both_namings_read_as_steps_taken():
    assert steps_of(checkpoint_name(200)) == 200
    assert steps_of("step--0000001.pt") == 0 and steps_of("step-00000199.pt") == 200
    assert steps_of("latest") is None and steps_of("step-x.pt") is None


def test_an_old_run_folder_loads_resumes_and_evaluates(tmp_path):
    from echo_rl.cli.commands.evaluate import EvalError, resolve_policy

    ckpt = tmp_path / "checkpoints"
    ckpt.mkdir()
    import torch

    for k in (-1, 0):  # what a 1-step run wrote before the renaming
        torch.save({"step": k, "model": {"w": torch.tensor([float(k)])}}, ckpt / f"step-{k:08d}.pt")
    (ckpt / "latest").write_text("step-00000000.pt")
    assert names(tmp_path) == ["step--0000001.pt", "step-00000000.pt"]
    assert load_checkpoint(tmp_path)["step"] == 0  # --resume reads it
    assert list(kept_checkpoints(tmp_path)) == [0, 1]
    latest = resolve_policy(tmp_path, "latest")
    assert latest.label == "step 1" and latest.path.name == "step-00000000.pt"
    assert resolve_policy(tmp_path, "0").state["w"].item() == -1.0  # the start
    with pytest.raises(EvalError, match="here steps: 0, 1"):
        resolve_policy(tmp_path, "2")
    save_checkpoint(tmp_path, 1, {"step": 1, "model": {}})  # the resumed run's next step
    assert names(tmp_path) == ["after-00000002.pt", "step-00000000.pt"]
