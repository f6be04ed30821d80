"""A causal LM's forward over a key/value cache allocated once, on the model's own modules.

Hugging Face's ``forward`` is written for every use at once: it builds masks, cache objects
and output records in Python on every call, and its caches write every row at one shared
position. Generation needs much less. ``Decoder`` runs the same computation as the model's
``forward`` for the Llama family (Llama, SmolLM2, Mistral without a sliding window, Qwen2,
Qwen3), calling the model's own modules for every weight (embedding, norms, projections,
MLP, head: so peft's LoRA layers apply unmerged and an installed version is what runs) and
doing only the attention and the cache itself:

* ``KVCache``: one tensor [2, layers, slots, kv_heads, columns, head_dim], allocated once;
  each slot (one sample) is independent, its prompt at columns [0, P) and every new token
  written at the slot's own position, so slots start, end and are refilled on their own.
* ``prefill``: prompts of any lengths at once (right-padded, causal), returning their
  keys and values and the logits of each prompt's last token only (never [tokens, vocab]).
* ``step``: one token per slot at per-slot positions, attention masked to each slot's own
  columns. Every shape is fixed by the cache, so a step can be captured as a CUDA graph.

Fewer, larger kernels, since a small model's step is bound by their count (docs/worker.md,
"The generation engine"): norms by ``rms_norm`` (one fused kernel on CUDA, where the model's
module runs seven), rotary positions by one flip with the sign folded into the sine table,
and, for a model without a LoRA adapter, the q/k/v projections and the MLP's gate and up
projections each as one matrix product: the parameters become views into one fused weight
(``fuse``), so an installed version, copied into them in place, is what the fused product
reads. A peft model keeps its modules' own products (its adapter applies per projection).

``tests/test_engine.py`` checks ``prefill`` and ``step`` against the model's own forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from echo_rl.core.errors import EchoError
from echo_rl.core.lora import base_of, is_peft

# Architectures whose decoder layer is exactly: x + attn(norm(x)), then x + mlp(norm(x)), with
# rotary positions, grouped-query attention and (Qwen3) per-head q/k norms.
SUPPORTED = frozenset({"llama", "qwen2", "qwen3", "mistral"})


class UnsupportedModel(EchoError):
    """The model is not one ``Decoder`` runs: the backend falls back to ``generate``."""

    default_reason = "unsupported_model"


def check_supported(model: torch.nn.Module) -> None:
    """Raise ``UnsupportedModel`` naming why, unless ``Decoder`` computes what the model does."""
    cfg = _causal_lm(model).config
    kind = getattr(cfg, "model_type", None)
    if kind not in SUPPORTED:
        raise UnsupportedModel(f"model_type {kind!r} (the engine runs {sorted(SUPPORTED)})")
    if getattr(cfg, "use_sliding_window", False) or (
        kind == "mistral" and getattr(cfg, "sliding_window", None)
    ):
        raise UnsupportedModel("sliding-window attention")
    types = set(getattr(cfg, "layer_types", None) or ["full_attention"])
    if types != {"full_attention"}:
        raise UnsupportedModel(f"layer types {sorted(types)}")
    if getattr(cfg, "rope_scaling", None) and cfg.rope_scaling.get("rope_type") == "longrope":
        raise UnsupportedModel("longrope positions")
    layer = _causal_lm(model).model.layers[0]
    if not all(hasattr(layer.mlp, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn")):
        raise UnsupportedModel(f"an MLP other than gate/up/down ({type(layer.mlp).__name__})")
    if not hasattr(layer.input_layernorm, "variance_epsilon"):
        raise UnsupportedModel(
            f"a norm other than RMSNorm ({type(layer.input_layernorm).__name__})"
        )


def _causal_lm(model: torch.nn.Module) -> Any:
    return base_of(model)


@dataclass
class Fused:
    """One layer's fused weights: q, k and v as one product, the MLP's gate and up as one."""

    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    gate_up: torch.Tensor


def fuse(layer: Any) -> Fused:
    """Concatenate ``layer``'s q/k/v and gate/up weights and make the parameters views into
    them (in place: an install's ``copy_`` into a parameter writes the fused weight)."""
    attn, mlp = layer.self_attn, layer.mlp
    qkv = _join([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
    bias = None
    if attn.q_proj.bias is not None:
        bias = _join([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias])
    return Fused(qkv, bias, _join([mlp.gate_proj.weight, mlp.up_proj.weight]))


def _join(params: list[torch.nn.Parameter]) -> torch.Tensor:
    whole = torch.cat([p.data for p in params])
    at = 0
    for p in params:
        p.data = whole[at : at + p.shape[0]]
        at += p.shape[0]
    return whole


def _norm(module: Any, x: torch.Tensor) -> torch.Tensor:
    """The model's RMSNorm ``module`` of ``x`` as one ``rms_norm``."""
    return F.rms_norm(x, (x.shape[-1],), module.weight, module.variance_epsilon)


@dataclass
class KVCache:
    """Keys and values of every slot: ``kv[0]`` keys, ``kv[1]`` values, each
    [layers, slots, kv_heads, columns, head_dim]."""

    kv: torch.Tensor

    @property
    def slots(self) -> int:
        return int(self.kv.shape[2])

    @property
    def columns(self) -> int:
        return int(self.kv.shape[4])

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()


class Decoder:
    """The forward of ``model`` (a causal LM of ``SUPPORTED``, or a peft model around one)."""

    def __init__(self, model: torch.nn.Module):
        check_supported(model)
        lm = _causal_lm(model)
        cfg = lm.config
        self.body = lm.model
        self.head = lm.lm_head
        self.layers = list(self.body.layers)
        attn = self.layers[0].self_attn
        self.head_dim = int(attn.head_dim)
        self.heads = int(cfg.num_attention_heads)
        self.kv_heads = int(cfg.num_key_value_heads)
        self.group = self.heads // self.kv_heads
        self.scaling = float(attn.scaling)
        self.qk_norm = hasattr(attn, "q_norm")
        self.max_positions = int(getattr(cfg, "max_position_embeddings", 0) or 0)
        mlp = self.layers[0].mlp
        self.act = mlp.act_fn
        self.inter = int(mlp.gate_proj.weight.shape[0]) if hasattr(mlp, "gate_proj") else 0
        # a peft model keeps its modules' products: its adapter applies per projection
        self.fused = None if is_peft(model) else [fuse(layer) for layer in self.layers]

    @property
    def dtype(self) -> torch.dtype:
        dtype: torch.dtype = self.body.embed_tokens.weight.dtype
        return dtype

    @property
    def device(self) -> torch.device:
        device: torch.device = self.body.embed_tokens.weight.device
        return device

    def cache(self, slots: int, columns: int) -> KVCache:
        shape = (2, len(self.layers), slots, self.kv_heads, columns, self.head_dim)
        return KVCache(torch.zeros(shape, dtype=self.dtype, device=self.device))

    def rope(self, columns: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin of every position [0, columns), [columns, head_dim] each: the
        model's own rotary embedding, computed once a request and indexed by position after.
        The sine's first half is negated, so ``x * cos + swap_halves(x) * sin`` is the model's
        ``x * cos + rotate_half(x) * sin`` (``_rope``)."""
        pos = torch.arange(columns, device=self.device)[None]
        probe = torch.zeros(1, dtype=self.dtype, device=self.device)
        cos, sin = self.body.rotary_emb(probe, pos)
        half = self.head_dim // 2
        sin = torch.cat((-sin[0, :, :half], sin[0, :, half:]), dim=-1)
        return cos[0].contiguous(), sin.contiguous()

    def _qkv(
        self, i: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [..., heads, D], k and v [..., kv_heads, D] of layer ``i`` for ``x`` [..., hidden],
        roped (``cos``/``sin`` [..., D])."""
        attn = self.layers[i].self_attn
        lead = x.shape[:-1]
        nq, nk = self.heads * self.head_dim, self.kv_heads * self.head_dim
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # broadcast over heads
        if self.fused is not None:
            f = self.fused[i]
            qkv = F.linear(x, f.qkv, f.qkv_bias)
            v = qkv[..., nq + nk :].view(*lead, self.kv_heads, self.head_dim)
            if not self.qk_norm:  # q and k side by side: roped as one
                qk = _rope(qkv[..., : nq + nk].view(*lead, -1, self.head_dim), cos, sin)
                return qk[..., : self.heads, :], qk[..., self.heads :, :], v
            q = qkv[..., :nq].view(*lead, self.heads, self.head_dim)
            k = qkv[..., nq : nq + nk].view(*lead, self.kv_heads, self.head_dim)
        else:
            q = attn.q_proj(x).view(*lead, self.heads, self.head_dim)
            k = attn.k_proj(x).view(*lead, self.kv_heads, self.head_dim)
            v = attn.v_proj(x).view(*lead, self.kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = _norm(attn.q_norm, q), _norm(attn.k_norm, k)
        return _rope(q, cos, sin), _rope(k, cos, sin), v

    def _mlp(self, i: int, x: torch.Tensor) -> torch.Tensor:
        mlp = self.layers[i].mlp
        if self.fused is None:
            out: torch.Tensor = mlp(x)
            return out
        gate_up = F.linear(x, self.fused[i].gate_up)
        act = self.act(gate_up[..., : self.inter]) * gate_up[..., self.inter :]
        out = mlp.down_proj(act)
        return out

    def prefill(
        self, ids: torch.Tensor, lengths: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Prompts ``ids`` [n, T] (right-padded; ``lengths`` [n] real tokens each): their keys
        and values [2, layers, n, kv_heads, T, D] and the float32 logits [n, vocab] after each
        prompt's last real token. Padding comes after every real token, so the causal mask
        alone keeps it out of what is read."""
        n, width = ids.shape
        cos, sin = rope[0][:width], rope[1][:width]
        x = self.body.embed_tokens(ids)
        kv = torch.empty(
            (2, len(self.layers), n, self.kv_heads, width, self.head_dim),
            dtype=self.dtype,
            device=ids.device,
        )
        for i, layer in enumerate(self.layers):
            h = _norm(layer.input_layernorm, x)
            q, k, v = self._qkv(i, h, cos, sin)
            k, v = k.transpose(1, 2), v.transpose(1, 2)  # [n, kv_heads, T, D]
            kv[0, i], kv[1, i] = k, v
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2),
                k,
                v,
                is_causal=True,
                scale=self.scaling,
                enable_gqa=self.group > 1,
            )
            x = x + layer.self_attn.o_proj(out.transpose(1, 2).reshape(n, width, -1))
            x = x + self._mlp(i, _norm(layer.post_attention_layernorm, x))
        last = x[torch.arange(n, device=ids.device), lengths - 1]  # [n, hidden]
        return kv, self.logits(last)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(_norm(self.body.norm, hidden)).float()
        return out

    def step(
        self,
        tokens: torch.Tensor,
        pos: torch.Tensor,
        cache: KVCache,
        rope: tuple[torch.Tensor, torch.Tensor],
        columns: int | None = None,
    ) -> torch.Tensor:
        """One token per slot: ``tokens`` [slots] at positions ``pos`` [slots] (each written
        into its slot's cache there), attending to its slot's columns up to ``pos``. Returns
        float32 logits [slots, vocab]. ``columns`` reads only the first that many columns (an
        eager caller that knows no slot reaches past them); None reads all (a fixed shape)."""
        kv = cache.kv
        width = cache.columns if columns is None else columns
        slots = torch.arange(tokens.shape[0], device=tokens.device)
        cos, sin = rope[0][pos], rope[1][pos]  # [slots, D]
        mask = (torch.arange(width, device=tokens.device)[None] <= pos[:, None])[:, None, None]
        x = self.body.embed_tokens(tokens)  # [slots, hidden]
        b = tokens.shape[0]
        for i, layer in enumerate(self.layers):
            h = _norm(layer.input_layernorm, x)
            q, k, v = self._qkv(i, h, cos, sin)
            keys, values = kv[0, i], kv[1, i]  # [slots, kv_heads, columns, D]
            keys[slots, :, pos] = k
            values[slots, :, pos] = v
            # the `group` query heads that share a kv head read it as one query block
            out = F.scaled_dot_product_attention(
                q.view(b, self.kv_heads, self.group, self.head_dim),
                keys[:, :, :width],
                values[:, :, :width],
                attn_mask=mask,
                scale=self.scaling,
            )
            x = x + layer.self_attn.o_proj(out.reshape(b, -1))
            x = x + self._mlp(i, _norm(layer.post_attention_layernorm, x))
        return self.logits(x)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` with ``sin``'s first half negated (``Decoder.rope``):
    rotate_half is then the two halves swapped, one flip."""
    halves = x.reshape(*x.shape[:-1], 2, x.shape[-1] // 2)
    out: torch.Tensor = x * cos + halves.flip(-2).reshape(x.shape) * sin
    return out
