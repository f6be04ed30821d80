"""The LM head and the sampled tokens' log-probs in one pass, a chunk of positions at a time.

``log_softmax(h @ W.T / T)[target]`` computed the plain way writes the [tokens, vocabulary]
logits, keeps them (and their float32 copy) for the backward, and reads them again in
logsumexp's, gather's and the cast's backward: for SmolLM2's 49k vocabulary that is 192 KiB of
float32 per trained token, for a 152k vocabulary 594 KiB: the largest activation of a step.

Here the forward keeps only each position's log-sum-exp (one float): per chunk of positions it
computes the logits, the target's logit and the log-sum-exp, and drops the chunk. The backward
recomputes each chunk's logits (one extra head matmul), turns them into the softmax in place and
makes the gradient ``g * (onehot(target) - softmax) / T`` there, then the hidden states' and the
head weight's gradients from it. No tensor larger than one chunk's logits exists at any time.

Numerics follow the plain path: the logits in the model's dtype (or autocast's), then float32
for the scaling, the log-sum-exp and the gradient, which goes back to the compute dtype for the
two matmuls (what autograd does through ``.float()``). ``tests/test_head.py`` checks values and
both gradients against the plain path, ``tests/test_micro_batch.py`` a whole step.

The price is the extra matmul. Alone, on a CPU, the head costs more time fused: 1,024
positions of SmolLM2's head took 1.40 s fused against 1.22 s plain, forward and backward, at
0.62 x the peak memory; at a 152k vocabulary 4.80 against 3.84 s at 0.48 x
(``benchmarks/bench_head.py``, ``benchmarks/results/issue50_cpu/head_cpu.json``). In a whole
learner step, whose no-grad pass recomputes nothing and whose plain path writes and faults in
the logits several times, it did not: a small model with SmolLM2's vocabulary ran 1.05-1.12 x
faster fused in four of four pairs, a SmolLM2-sized one 0.98 x (one pair; TRL's side of the
same runs 0.96 x) (``benchmarks/results/issue50_cpu/README.md``). So ``learner.fused_head`` is
on by default; its GPU side is measured by ``make gpu-check`` (docs/gpu.md), owed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch

# A chunk's float32 logits take at most CHUNK_BYTES, and a chunk has at least MIN_ROWS
# positions: fewer make the head's matmul inefficient (on a CPU, 27-position chunks of a
# 151,936-token vocabulary took the head from 3.6 to 11.4 s; benchmarks/bench_head.py).
CHUNK_BYTES = 256 << 20
MIN_ROWS = 256


def chunk_rows(vocab: int) -> int:
    return max(MIN_ROWS, CHUNK_BYTES // (4 * vocab))


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype the plain head's matmul would run in: autocast's where it is on."""
    dev = t.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return t.dtype


def _accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for the log-softmax of low-precision logits; a float64 model keeps float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class _HeadLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        inv_t: float,
        bias: torch.Tensor | None,
        rows: int,
    ) -> torch.Tensor:
        dtype = _compute_dtype(hidden)
        h, w = hidden.to(dtype), weight.to(dtype)
        n, acc = h.shape[0], _accumulate_dtype(dtype)
        out = torch.empty(n, dtype=acc, device=h.device)
        lse = torch.empty(n, dtype=acc, device=h.device)
        with torch.autocast(h.device.type, enabled=False):
            for s in range(0, n, rows):
                z = _scaled_logits(h[s : s + rows], w, inv_t)
                t = targets[s : s + rows].unsqueeze(1)
                picked = z.gather(1, t).squeeze(1)
                if bias is not None:
                    z.add_(bias)
                lse[s : s + rows] = torch.logsumexp(z, dim=1)
                out[s : s + rows] = picked - lse[s : s + rows]
        ctx.save_for_backward(hidden, weight, targets, lse, bias)
        ctx.inv_t, ctx.rows, ctx.dtype = inv_t, rows, dtype
        return out

    @staticmethod
    def backward(
        ctx: Any, grad_out: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None, None, None]:
        hidden, weight, targets, lse, bias = ctx.saved_tensors
        inv_t, rows, dtype = ctx.inv_t, ctx.rows, ctx.dtype
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        h, w = hidden.to(dtype), weight.to(dtype)
        grad_h = torch.empty_like(h) if want_h else None
        acc = _accumulate_dtype(dtype)
        grad_w = torch.zeros(weight.shape, dtype=acc, device=w.device) if want_w else None
        g_all = grad_out.to(acc)
        with torch.autocast(h.device.type, enabled=False):
            for s in range(0, h.shape[0], rows):
                hs, g = h[s : s + rows], g_all[s : s + rows].unsqueeze(1)
                z = _scaled_logits(hs, w, inv_t)
                if bias is not None:
                    z.add_(bias)
                # d(picked - lse)/dz = onehot(target) - softmax(z); times g and the 1/T of z
                p = z.sub_(lse[s : s + rows].unsqueeze(1)).exp_()
                p.mul_(-g * inv_t)
                p.scatter_add_(1, targets[s : s + rows].unsqueeze(1), g * inv_t)
                gz = p.to(dtype)
                if grad_h is not None:
                    torch.mm(gz, w, out=grad_h[s : s + rows])
                if grad_w is not None:
                    grad_w.add_(gz.t().mm(hs))
        return (
            None if grad_h is None else grad_h.to(hidden.dtype),
            None if grad_w is None else grad_w.to(weight.dtype),
            None,
            None,
            None,
            None,
        )


# Function.apply is untyped in torch's stubs; its result here is the forward's.
_apply = cast(Callable[..., torch.Tensor], _HeadLogprobs.apply)


def _scaled_logits(h: torch.Tensor, w: torch.Tensor, inv_t: float) -> torch.Tensor:
    """A chunk's logits in float32 at the sampling temperature (a fresh tensor, written in place
    by the callers)."""
    z = h.mm(w.t())
    z = z.to(_accumulate_dtype(z.dtype))
    if inv_t != 1.0:
        z.mul_(inv_t)
    return z


def head_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    bias: torch.Tensor | None = None,
    rows: int | None = None,
) -> torch.Tensor:
    """``log_softmax((hidden @ weight.T) / temperature + bias).gather(targets)`` without the
    logits: ``hidden`` [..., d], ``weight`` [V, d] (a bias-free head), ``targets`` [...] long,
    ``bias`` [V] float32 (0 on allowed tokens, -inf elsewhere; the target's own logit is taken
    without it, as ``selective_logprobs`` does). Returns float32 (float64 for a float64 model)
    of ``targets``' shape.
    ``rows``: positions per chunk (default: ``chunk_rows``)."""
    lead = targets.shape
    h = hidden.reshape(-1, hidden.shape[-1])
    t = targets.reshape(-1)
    n = chunk_rows(weight.shape[0]) if rows is None else rows
    out = _apply(h, weight, t, 1.0 / temperature, bias, n)
    return out.view(lead)
