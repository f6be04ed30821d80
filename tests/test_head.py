"""The fused LM head (echo_rl/learner/head.py): the sampled tokens' log-probs and both gradients
as the plain head + log-softmax gives them, chunk by chunk, without the [tokens, vocabulary]
logits; ``token_logprobs`` takes it for the decoder families it knows and keeps the model's own
forward for the rest."""

from __future__ import annotations

import pytest
import torch

from echo_rl.core.config import ModelConfig
from echo_rl.core.models import build_tiny_tokenizer, load_model
from echo_rl.data.answers import answer_bias
from echo_rl.learner import trainer as trainer_mod
from echo_rl.learner.head import head_logprobs
from echo_rl.learner.trainer import fused_head, selective_logprobs, token_logprobs

pytestmark = pytest.mark.timeout(60)


def plain(h, w, t, temperature=1.0, answers=None):
    logits = h @ w.t()
    return selective_logprobs(logits, t, temperature, answers)


def inputs(dtype, n_rows=3, n_pos=7, d=16, vocab=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n_rows, n_pos, d, generator=g).to(dtype).requires_grad_()
    w = torch.randn(vocab, d, generator=g).to(dtype).requires_grad_()
    t = torch.randint(0, vocab, (n_rows, n_pos), generator=g)
    return h, w, t


@pytest.mark.parametrize("rows", [1, 4, 1000])  # one position, chunks that do not divide, one
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_values_and_both_gradients_match_the_plain_head(rows, temperature):
    h, w, t = inputs(torch.float64)
    g = torch.randn(t.shape, dtype=torch.float64)
    want = plain(h, w, t, temperature)
    (want * g).sum().backward()
    want_gh, want_gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    got = head_logprobs(h, w, t, temperature, rows=rows)
    (got * g).sum().backward()
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)  # float64 stays float64
    torch.testing.assert_close(h.grad, want_gh, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(w.grad, want_gw, rtol=1e-10, atol=1e-12)
    assert got.dtype == torch.float64 and got.shape == t.shape


def test_restricted_answers_renormalise_and_a_target_outside_stays_finite():
    h, w, t = inputs(torch.float32)
    allowed = [1, 5, 9, int(t[0, 0])]
    t[1, 2] = 2  # not an answer: the context between answers, which the loss mask leaves out
    bias = answer_bias(allowed, w.shape[0])
    got = head_logprobs(h, w, t, 1.0, bias, rows=5)
    want = plain(h, w, t, 1.0, allowed)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(got).all()
    got.sum().backward()
    assert torch.isfinite(h.grad).all() and torch.isfinite(w.grad).all()


def test_bf16_follows_the_plain_paths_rounding():
    h, w, t = inputs(torch.bfloat16, d=64, vocab=300)
    want = plain(h, w, t)
    want.sum().backward()
    want_gh, want_gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    got = head_logprobs(h, w, t, rows=5)
    got.sum().backward()
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)  # same bf16 logits, same float32 math
    assert h.grad.dtype == w.grad.dtype == torch.bfloat16
    torch.testing.assert_close(h.grad, want_gh, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(w.grad, want_gw, rtol=2e-2, atol=2e-2)


def test_a_frozen_head_gets_no_gradient_and_the_hidden_states_still_do():
    h, w, t = inputs(torch.float32)
    w = w.detach()
    head_logprobs(h, w, t, rows=2).sum().backward()
    assert w.grad is None and h.grad is not None


def tiny():
    tok = build_tiny_tokenizer()
    return load_model(ModelConfig(seed=3), tok), tok


def test_token_logprobs_takes_the_fused_head_and_agrees_with_the_models_forward(monkeypatch):
    model, _ = tiny()
    assert fused_head(model) is not None  # tiny Qwen3: the head is run by Echo
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, model.config.vocab_size, (4, 12), generator=g)
    attn = torch.ones_like(ids)
    attn[1, -3:] = 0
    loss_mask = torch.zeros(4, 11)
    loss_mask[:, 5:9] = 1
    fused = token_logprobs(model, ids, attn, loss_mask, temperature=0.8, fused=True)
    fused.sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    monkeypatch.setattr(trainer_mod, "FUSED_HEAD_TYPES", frozenset())
    assert fused_head(model) is None
    own = token_logprobs(model, ids, attn, loss_mask, temperature=0.8, fused=True)
    own.sum().backward()
    torch.testing.assert_close(fused, own, rtol=1e-5, atol=1e-6)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[n], rtol=1e-4, atol=1e-6, msg=n)


def test_a_head_with_its_own_processing_keeps_the_models_forward():
    model, _ = tiny()
    model.config.model_type = "gemma2"  # soft-capped logits: only its forward knows
    assert fused_head(model) is None


def test_under_autocast_the_head_runs_in_autocasts_dtype_and_float32_weights_get_float32_grads():
    """bf16 autocast with float32 weights (what a GPU learner runs, tests/test_gpu.py): the
    fused head's matmuls in bf16 as the plain head's, its gradients back in float32."""
    h, w, t = inputs(torch.float32, d=64, vocab=300)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = plain(h, w, t)
    want.sum().backward()
    want_gh, want_gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = head_logprobs(h, w, t, rows=7)
    got.sum().backward()
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)  # the same bf16 logits
    assert h.grad.dtype == w.grad.dtype == torch.float32
    torch.testing.assert_close(h.grad, want_gh, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(w.grad, want_gw, rtol=2e-2, atol=2e-2)


def test_a_lora_model_gets_the_fused_head_and_the_same_adapter_gradients():
    """peft's model: the decoder with the adapter's layers in place, the base's head."""
    from echo_rl.core.config import LoraConfig
    from echo_rl.core.lora import wrap

    model, _ = tiny()
    model = wrap(model, LoraConfig(enabled=True))
    for n, p in model.named_parameters():  # B starts at zero: give the adapter a say
        if ".lora_B." in n:
            torch.nn.init.normal_(p, std=0.1)
    assert fused_head(model) is not None
    ids = torch.randint(4, 24, (3, 10), generator=torch.Generator().manual_seed(1))
    attn, loss_mask = torch.ones_like(ids), torch.ones(3, 9)
    fused = token_logprobs(model, ids, attn, loss_mask, fused=True)
    fused.sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad()
    own = token_logprobs(model, ids, attn, loss_mask, fused=False)
    own.sum().backward()
    torch.testing.assert_close(fused, own, rtol=1e-5, atol=1e-6)
    assert grads and all(".lora_" in n for n in grads)
    for n, p in model.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p.grad, grads[n], rtol=1e-4, atol=1e-6, msg=n)
