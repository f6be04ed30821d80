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
