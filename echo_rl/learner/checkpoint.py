"""Learner checkpoints: everything needed to continue a run as if it had not stopped.

Taken right before every publication (so no worker ever holds a snapshot newer than the last
checkpoint, and every trajectory in the buffer log is admissible again after a restore).
Layout in the run folder::

    run.key                      the run's Ed25519 signing key (0600): survives restarts so
                                 workers keep trusting the snapshots
    checkpoints/after-00000041.pt the policy after 41 steps (snapshot version 41, progress
                                 41/N; metrics.jsonl rows 0..40), model, optimizer, RNG states,
                                 work leases, counters (LoRA: the adapter's tensors and their
                                 optimizer state; the frozen base is the model folder's).
                                 after-00000000.pt is the model the run starts from
    checkpoints/latest           name of the newest complete checkpoint (atomic rename)
    checkpoints/best.pt          the checkpoint the run's held-out evaluation scored highest
    checkpoints/best.json        its score (echo_rl/learner/evaluation.py HeldoutScore; echo_rl/learner/heldout.py)
    checkpoints/eval-00000040.pt a checkpoint waiting for, or in, its held-out evaluation (a
                                 hard link: the rotation below does not take it away)

Only the two newest ``after-`` checkpoints are kept. Run folders written before this naming hold
``step-K.pt``, named by the index of the last step taken (``step--0000001.pt``: none, the
start; ``step-00000199.pt``: after 200 steps). They still load (``latest`` names the file) and
``steps_of`` reads both names as the number of steps taken.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, NotRequired, TypedDict

import torch

from echo_rl.broadcast.snapshot import RunKey
from echo_rl.learner.evaluation import HeldoutScore

if TYPE_CHECKING:
    from torch.optim.optimizer import StateDict

    from echo_rl.core.config_learner import LoraConfig
    from echo_rl.core.jsontypes import JsonObject
    from echo_rl.data.buffer import BufferStats
    from echo_rl.learner.parallel.base import ModelState
    from echo_rl.learner.rows import RunTotals

KEEP = 2


class RngState(TypedDict):
    """The generators a resumed run goes on from (``Policy.rng_state``)."""

    trainer_rng: torch.Tensor  # the trainer's mini-batch order
    torch_rng: torch.Tensor
    python_rng: tuple[object, ...]  # ``random.getstate()``


class CheckpointExtra(RngState):
    """What a checkpoint holds besides the model and optimizer (``Learner._checkpoint_state``)."""

    step: int  # the index of the last step taken (-1: none yet)
    row: NotRequired[JsonObject | None]  # that step's metrics row (older checkpoints: none)
    prompt_rng: tuple[object, ...]  # the work queue's prompt generator
    work: JsonObject  # the work queue's open leases (``WorkQueue.state``)
    buffer_stats: BufferStats
    totals: RunTotals
    wall_s: float  # the run's seconds so far


class CheckpointState(CheckpointExtra):
    """A checkpoint file's contents (``torch.save``; the file format is this dict)."""

    model: ModelState  # LoRA: the adapter's tensors only
    optimizer: StateDict


def load_or_create_key(run_dir: Path) -> RunKey:
    path = run_dir / "run.key"
    if path.exists():
        return RunKey.from_bytes(path.read_bytes())
    key = RunKey.generate()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key.private_bytes())
    return key


def _atomic_write(path: Path, write: Callable[[BinaryIO], object]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def checkpoint_name(steps: int) -> str:
    """The file of the policy after ``steps`` learner steps (0: the start)."""
    return f"after-{steps:08d}.pt"


def steps_of(name: str) -> int | None:
    """Steps taken at a checkpoint file ``name``: ``after-N.pt`` -> N; the older
    ``step-K.pt`` (K the last step's index, -1 before any) -> K + 1; None for other files."""
    for prefix, add in (("after-", 0), ("step-", 1)):
        if name.startswith(prefix) and name.endswith(".pt"):
            try:
                return int(name[len(prefix) : -3]) + add
            except ValueError:
                return None
    return None


def kept_checkpoints(run_dir: Path) -> dict[int, Path]:
    """Steps taken -> checkpoint file, for every checkpoint in ``run_dir`` (either naming)."""
    out = {}
    for path in (run_dir / "checkpoints").glob("*.pt"):
        steps = steps_of(path.name)
        if steps is not None:
            out[steps] = path
    return dict(sorted(out.items()))


def save_checkpoint(run_dir: Path, step: int, state: CheckpointState) -> Path:
    """``step``: the index of the last step taken (-1: none yet), as ``state["step"]``; the
    file is named by the steps taken, ``step + 1``. Keeps the newest ``KEEP``."""
    ckpt_dir = run_dir / "checkpoints"
    ckpt_dir.mkdir(exist_ok=True)
    path = ckpt_dir / checkpoint_name(step + 1)
    _atomic_write(path, lambda f: torch.save(state, f))
    _atomic_write(ckpt_dir / "latest", lambda f: f.write(path.name.encode()))
    for old in list(kept_checkpoints(run_dir).values())[:-KEEP]:
        old.unlink()
    return path


def load_checkpoint(run_dir: Path) -> CheckpointState | None:
    latest = run_dir / "checkpoints" / "latest"
    if not latest.exists():
        return None
    path = run_dir / "checkpoints" / latest.read_text().strip()
    state: CheckpointState = torch.load(path, weights_only=False)
    return state


BEST, BEST_INFO = "best.pt", "best.json"


def best_checkpoint(run_dir: Path) -> tuple[Path, HeldoutScore] | None:
    """``checkpoints/best.pt`` and its score, or None when the run has none."""
    ckpt = run_dir / "checkpoints"
    if not (ckpt / BEST).is_file() or not (ckpt / BEST_INFO).is_file():
        return None
    return ckpt / BEST, HeldoutScore.from_json(json.loads((ckpt / BEST_INFO).read_text()))


def keep_best(run_dir: Path, candidate: Path, score: HeldoutScore) -> None:
    """``candidate`` (a file in checkpoints/) becomes best.pt, ``score`` best.json."""
    ckpt = run_dir / "checkpoints"
    info = json.dumps(score.to_json()).encode()
    os.replace(candidate, ckpt / BEST)
    _atomic_write(ckpt / BEST_INFO, lambda f: f.write(info))


def export_checkpoint(
    run_dir: Path, out: Path, merged: bool = False, which: str = "latest"
) -> Path:
    """The policy of ``run_dir``'s latest checkpoint (``which = "best"``: its best.pt) as a Hugging Face folder (weights and
    tokenizer, save_pretrained) for ``model.name``: fine-tune on, evaluate, or start a run from
    a model that has learned something. A LoRA run's is its adapter (``_export_lora``)."""
    from echo_rl.core.config import ConfigError, load_config
    from echo_rl.core.gguf_import import ImportFailed
    from echo_rl.core.models import load_model, load_tokenizer

    if out.exists():
        raise ImportFailed(f"{out} exists: pick a new --out folder")
    try:
        cfg = load_config(run_dir / "config.toml")
    except (ConfigError, OSError) as err:
        raise ImportFailed(
            f"{run_dir}/config.toml: {err}; is --run-dir a learner's run folder?"
        ) from None
    if which == "best":
        found = best_checkpoint(run_dir)
        if found is None:
            raise ImportFailed(
                f"{run_dir} has no best checkpoint: the run evaluated no held-out split "
                f"(learner.heldout.every = 0?); leave --checkpoint out for the latest"
            )
        state: CheckpointState | None = torch.load(found[0], weights_only=False)
    else:
        state = load_checkpoint(run_dir)
    if state is None:
        raise ImportFailed(f"{run_dir} has no checkpoint (learner.checkpoint = false?)")
    tok = load_tokenizer(cfg.model)
    model = load_model(cfg.model, tok, "float32")
    if cfg.learner.lora.enabled:
        _export_lora(model, cfg.learner.lora, state["model"], out, merged)
    else:
        model.load_state_dict(state["model"])
        model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def _export_lora(
    base: torch.nn.Module, lora: LoraConfig, adapter_sd: ModelState, out: Path, merged: bool
) -> None:
    """The trained adapter in peft's format (adapter_config.json, adapter_model.safetensors:
    ``PeftModel.from_pretrained(base, folder)`` loads it) in ``out``; with ``merged``, ``out``
    is the whole model with the adapter merged in (for model.name) and the adapter goes to
    ``out/adapter`` (beside a config.json, transformers would take the folder for an adapter)."""
    from echo_rl.core.lora import adapter_parameters, wrap

    model = wrap(base, lora)
    if set(adapter_sd) != set(adapter_parameters(model)):
        from echo_rl.core.gguf_import import ImportFailed

        raise ImportFailed(
            "the checkpoint's tensors are not this run's LoRA adapter (the "
            "[learner.lora] settings in config.toml changed?)"
        )
    model.load_state_dict({**model.state_dict(), **adapter_sd})
    model.save_pretrained(str(out / "adapter" if merged else out))
    if merged:
        model.merge_and_unload().save_pretrained(out)
