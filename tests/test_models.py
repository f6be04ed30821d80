import pytest
import torch

from echo import wire
from echo.config import ModelConfig
from echo.models import (ModelError, install_payload, load_model, load_tokenizer, params_to_payload)
from learner.trainer import token_logprobs


def test_local_hf_folder_loads_through_same_path(tmp_path, tokenizer):
    cfg = ModelConfig()
    model = load_model(cfg, tokenizer)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    disk = ModelConfig(name=str(tmp_path))
    tok2 = load_tokenizer(disk)
    model2 = load_model(disk, tok2)
    assert tok2.encode("3+4=", add_special_tokens=False) == tokenizer.encode("3+4=", add_special_tokens=False)
    ids = torch.tensor([[4, 14, 5, 17]])
    assert torch.allclose(model(ids).logits, model2(ids).logits, atol=1e-6)
    assert tok2.apply_chat_template([{"role": "user", "content": "1+1="}], tokenize=False)


def test_missing_or_broken_model_folder_explains_fix(tmp_path):
    with pytest.raises(ModelError, match="no such directory.*tiny-qwen3"):
        load_tokenizer(ModelConfig(name=str(tmp_path / "absent")))
    with pytest.raises(ModelError, match="config.json"):
        load_tokenizer(ModelConfig(name=str(tmp_path)))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_payload_round_trip(tokenizer, dtype):
    src = load_model(ModelConfig(seed=1), tokenizer)
    dst = load_model(ModelConfig(seed=2), tokenizer)
    index, payload = params_to_payload(src.named_parameters(), dtype)
    install_payload(dst, index, payload)
    for (n, a), (_, b) in zip(src.named_parameters(), dst.named_parameters()):
        assert torch.equal(a.to(getattr(torch, dtype)).float(), b), n


def test_payload_for_another_model_is_refused(tokenizer):
    src = load_model(ModelConfig(num_layers=1), tokenizer)
    dst = load_model(ModelConfig(num_layers=2), tokenizer)
    index, payload = params_to_payload(src.named_parameters(), "float32")
    with pytest.raises(ModelError, match="does not fit"):
        install_payload(dst, index, payload)


def test_worker_behaviour_logprobs_match_learner(tokenizer):
    """The worker's sampler log-probs and the learner's recomputation agree at equal weights."""
    from worker.backends import make_backend

    backend = make_backend("transformers", model_cfg=ModelConfig(), threads=1)
    groups = [wire.Group(group_id="g", prompt_ids=[4, 14, 5, 17], n=8, seed=3)]
    [samples] = backend.generate(groups, max_new_tokens=4, temperature=1.0)
    assert len(samples) == 8
    learner_model = load_model(ModelConfig(), tokenizer)  # same seed, same weights
    for s in samples:
        ids = torch.tensor([[4, 14, 5, 17] + s.completion_ids])
        lp = token_logprobs(learner_model, ids, torch.ones_like(ids))[0, 3:]
        assert lp.tolist() == pytest.approx(s.logprobs, abs=1e-4)
        assert s.completion_ids[-1] == tokenizer.eos_token_id or len(s.completion_ids) == 4


def _ragged_batch(generator, vocab):
    """Right-padded rows whose prompts and completions differ in length, with their masks."""
    prompts, completions = [3, 7, 5], [4, 2, 6]
    L = max(p + c for p, c in zip(prompts, completions)) + 2  # two columns of pure padding
    ids = torch.randint(4, vocab, (3, L), generator=generator)
    attn = torch.zeros(3, L, dtype=torch.long)
    mask = torch.zeros(3, L - 1)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        attn[i, :p + c] = 1
        ids[i, p + c:] = 0
        mask[i, p - 1:p + c - 1] = 1  # targets p .. p+c-1: the completion tokens
    return ids, attn, mask


def test_logprobs_of_the_trained_span_match_the_full_computation(tokenizer):
    """Computing only the columns some row trains on (no prompt logits, no trailing padding)
    gives the same log-probs and the same gradients where the loss looks."""
    model = load_model(ModelConfig(), tokenizer)
    ids, attn, mask = _ragged_batch(torch.Generator().manual_seed(0), len(tokenizer))
    # the reference: the plain computation, not this function
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]
    full = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    model.zero_grad()
    (full * mask).sum().backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    span = token_logprobs(model, ids, attn, mask)
    (span * mask).sum().backward()
    assert span.shape == full.shape
    torch.testing.assert_close(span * mask, full * mask, rtol=1e-5, atol=1e-6)
    assert not span[:, :1].any() and not span[:, -1:].any()  # outside the span: not computed
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[n], rtol=1e-4, atol=1e-6, msg=n)


def test_low_precision_logits_go_row_by_row_in_float32():
    from learner.trainer import selective_logprobs

    logits = torch.randn(3, 5, 40, generator=torch.Generator().manual_seed(1))
    targets = torch.randint(0, 40, (3, 5), generator=torch.Generator().manual_seed(2))
    want = torch.log_softmax(logits.bfloat16().float(), -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    got = selective_logprobs(logits.bfloat16(), targets)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(selective_logprobs(logits, targets),
                               torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1))
