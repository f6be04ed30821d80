"""LoRA adapters through peft, the same on the learner, its auditor and every worker.

With ``[learner.lora] enabled`` the policy is the base model, frozen, plus a peft LoRA adapter
(``wrap``). A published version is the adapter's tensors only (``adapter_parameters``: the
parameters whose module name starts with ``lora_``, in the model's order) plus the base model's
content hash (``base_hash``) in the signed manifest; the snapshot format, deltas and chains are
unchanged. A process that installs a version first checks that the base model it holds is the
one the version was trained on (``base_problem``).

Versions are applied unmerged: their tensors are copied into the adapter's parameters, which is
what peft's ``set_peft_model_state_dict`` does (a non-strict ``load_state_dict``), here with a
strict check that the names match exactly and without its key renaming. Merging each version
into the weights would make the next install undo the previous merge: in bf16 every
merge/unmerge pair rounds, so a worker's weights would drift from base + adapter and from the
base hash. Unmerged, the base stays bit for bit what was hashed, an install copies a few MB, and
the price is one small extra matmul pair per adapted layer.

The content hash is BLAKE3 over every base parameter's name, shape and bfloat16 bytes, in the
model's order: a float32 load (the learner, a CPU worker) and a bfloat16 load (a GPU worker) of
the same weights give the same hash, since both round to bfloat16 the same way.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

from echo_rl.core.config import LoraConfig, ModelConfig

if TYPE_CHECKING:
    import torch
    from peft import LoraConfig as PeftLoraConfig
    from peft import PeftMixedModel, PeftModel
    from transformers import PreTrainedTokenizerBase


def is_adapter_name(name: str) -> bool:
    """A LoRA parameter of a peft model (``...q_proj.lora_A.default.weight``)."""
    return any(part.startswith("lora_") for part in name.split("."))


def is_peft(model: torch.nn.Module) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def base_of(model: torch.nn.Module) -> torch.nn.Module:
    """The model a peft wrapper holds (its base, with the LoRA layers in place), else the model
    itself. Checked by duck type: importing peft is left to the runs that use it."""
    if not is_peft(model):
        return model
    get_base_model = getattr(model, "get_base_model", None)  # nn.Module types it Tensor | Module
    assert get_base_model is not None  # is_peft checked it
    inner: torch.nn.Module = get_base_model()
    return inner


def adapter_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The adapter's parameters by name, in the model's order: what a version carries."""
    return {n: p for n, p in model.named_parameters() if is_adapter_name(n)}


def peft_config(cfg: LoraConfig) -> PeftLoraConfig:
    from peft import LoraConfig as PeftLoraConfig

    return PeftLoraConfig(
        r=cfg.rank,
        # peft annotates lora_alpha int, but only divides by it: a float alpha is valid
        lora_alpha=cfg.alpha,  # type: ignore[arg-type]
        lora_dropout=cfg.dropout,
        target_modules=cfg.target_modules,
        bias="none",
        task_type="CAUSAL_LM",
    )


def wrap(model: torch.nn.Module, cfg: LoraConfig) -> PeftModel | PeftMixedModel:
    """``model`` (frozen) with a LoRA adapter on ``cfg.target_modules``: a peft model whose only
    trainable parameters are the adapter's."""
    from peft import get_peft_model

    from echo_rl.core.models import ModelError

    try:
        with warnings.catch_warnings():  # peft asks transformers a deprecated question
            warnings.filterwarnings("ignore", category=FutureWarning)
            return get_peft_model(model, peft_config(cfg))
    except ValueError as exc:  # peft: "Target modules {...} not found in the base model"
        raise ModelError(
            f"learner.lora.target_modules = {cfg.target_modules!r}: {exc}. Name "
            f"modules of this model (its linear layers: {linear_names(model)}), "
            f'or use "all-linear"'
        ) from None


def linear_names(model: torch.nn.Module) -> list[str]:
    """The distinct last names of the model's linear layers (what target_modules may name)."""
    import torch

    return sorted(
        {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    )


def base_hash(model: torch.nn.Module) -> str:
    """Content hash of a base model (not wrapped yet): hex BLAKE3 of every parameter's name,
    shape and bfloat16 bytes, in order (tied weights once)."""
    import blake3
    import torch

    h = blake3.blake3()
    with torch.no_grad():
        for name, p in model.named_parameters():
            t = p.detach().to(torch.bfloat16).contiguous().cpu()
            h.update(f"{name}|{list(t.shape)}|".encode())
            h.update(t.view(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()


def base_problem(version: int, want: str | None, held: str | None, model_name: str) -> str | None:
    """Why ``version``, an adapter for the base model ``want`` (its manifest's ``base_model``;
    None: a whole model), cannot be applied to the base model held here (None: it can).
    ``held``: this process's base hash, None when it holds a full model (no LoRA)."""
    if want is None and held is None:
        return None
    if want is None:
        return (
            f"version {version} is a whole model, but this worker applies LoRA adapters "
            f"(learner.lora.enabled in the view it joined with); rejoin the learner"
        )
    if held is None:
        return (
            f"version {version} is a LoRA adapter for base model {want[:16]}..., but this "
            f"worker loaded a whole model without an adapter; upgrade echo-rl on this worker "
            f"and rejoin"
        )
    if want != held:
        return (
            f"version {version} is a LoRA adapter for base model {want[:16]}..., but the "
            f"base model this worker holds (model.name = {model_name!r}) hashes to "
            f"{held[:16]}...: a different model or other weights. Give the worker the "
            f"learner's base model (the same folder, or the same tiny-model settings and "
            f"model.seed)"
        )
    return None


def load_policy_model(
    model_cfg: ModelConfig,
    lora: LoraConfig | None,
    tokenizer: PreTrainedTokenizerBase,
    dtype: str = "float32",
) -> tuple[Any, str | None]:
    """The model versions install into: the base model, wrapped with an (untrained) adapter
    when ``lora`` is enabled; and the base's content hash (None without LoRA)."""
    from echo_rl.core.models import load_model

    model = load_model(model_cfg, tokenizer, dtype)
    if lora is None or not lora.enabled:
        return model, None
    held = base_hash(model)
    return wrap(model, lora), held
