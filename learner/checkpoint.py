"""Learner checkpoints: everything needed to continue a run as if it had not stopped.

Taken right before every publication (so no worker ever holds a snapshot newer than the last
checkpoint, and every trajectory in the buffer log is admissible again after a restore).
Layout in the run folder::

    run.key                      the run's Ed25519 signing key (0600): survives restarts so
                                 workers keep trusting the snapshots
    checkpoints/step-00000041.pt model, optimizer, RNG states, version, work leases, counters
                                 (LoRA: the adapter's tensors and their optimizer state; the
                                 frozen base is the model folder's)
    checkpoints/latest           name of the newest complete checkpoint (atomic rename)

Only the two newest checkpoints are kept.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from broadcast.snapshot import RunKey

KEEP = 2


def load_or_create_key(run_dir: Path) -> RunKey:
    path = run_dir / "run.key"
    if path.exists():
        return RunKey.from_bytes(path.read_bytes())
    key = RunKey.generate()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key.private_bytes())
    return key


def _atomic_write(path: Path, write) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_checkpoint(run_dir: Path, step: int, state: dict[str, Any]) -> Path:
    ckpt_dir = run_dir / "checkpoints"
    ckpt_dir.mkdir(exist_ok=True)
    path = ckpt_dir / f"step-{step:08d}.pt"
    _atomic_write(path, lambda f: torch.save(state, f))
    _atomic_write(ckpt_dir / "latest", lambda f: f.write(path.name.encode()))
    for old in sorted(ckpt_dir.glob("step-*.pt"))[:-KEEP]:
        old.unlink()
    return path


def load_checkpoint(run_dir: Path) -> dict[str, Any] | None:
    latest = run_dir / "checkpoints" / "latest"
    if not latest.exists():
        return None
    path = run_dir / "checkpoints" / latest.read_text().strip()
    return torch.load(path, weights_only=False)


def export_checkpoint(run_dir: Path, out: Path, merged: bool = False) -> Path:
    """The policy of ``run_dir``'s latest checkpoint as a Hugging Face folder (weights and
    tokenizer, save_pretrained) for ``model.name``: fine-tune on, evaluate, or start a run from
    a model that has learned something. A LoRA run's is its adapter (``_export_lora``)."""
    from echo.config import ConfigError, load_config
    from echo.gguf_import import ImportFailed
    from echo.models import load_model, load_tokenizer

    if out.exists():
        raise ImportFailed(f"{out} exists: pick a new --out folder")
    try:
        cfg = load_config(run_dir / "config.toml")
    except (ConfigError, OSError) as err:
        raise ImportFailed(f"{run_dir}/config.toml: {err}; is --run-dir a learner's run folder?") from None
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


def _export_lora(base: Any, lora: Any, adapter_sd: dict[str, Any], out: Path, merged: bool) -> None:
    """The trained adapter in peft's format (adapter_config.json, adapter_model.safetensors:
    ``PeftModel.from_pretrained(base, folder)`` loads it) in ``out``; with ``merged``, ``out``
    is the whole model with the adapter merged in (for model.name) and the adapter goes to
    ``out/adapter`` (beside a config.json, transformers would take the folder for an adapter)."""
    from echo.lora import adapter_parameters, wrap

    model = wrap(base, lora)
    if set(adapter_sd) != set(adapter_parameters(model)):
        from echo.gguf_import import ImportFailed

        raise ImportFailed("the checkpoint's tensors are not this run's LoRA adapter (the "
                           "[learner.lora] settings in config.toml changed?)")
    model.load_state_dict({**model.state_dict(), **adapter_sd})
    model.save_pretrained(out / "adapter" if merged else out)
    if merged:
        model.merge_and_unload().save_pretrained(out)
