import pytest
import torch

from echo_rl.core import wire
from echo_rl.core.config import ModelConfig
from echo_rl.core.models import (
    ModelError,
    install_payload,
    load_model,
    load_tokenizer,
    params_to_payload,
)
from echo_rl.learner.trainer import token_logprobs


def test_local_hf_folder_loads_through_same_path(tmp_path, tokenizer):
    cfg = ModelConfig()
    model = load_model(cfg, tokenizer)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    disk = ModelConfig(name=str(tmp_path))
    tok2 = load_tokenizer(disk)
    model2 = load_model(disk, tok2)
    assert tok2.encode("3+4=", add_special_tokens=False) == tokenizer.encode(
        "3+4=", add_special_tokens=False
    )
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
    from echo_rl.worker.backends import make_backend

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
        attn[i, : p + c] = 1
        ids[i, p + c :] = 0
        mask[i, p - 1 : p + c - 1] = 1  # targets p .. p+c-1: the completion tokens
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
    from echo_rl.learner.trainer import selective_logprobs

    logits = torch.randn(3, 5, 40, generator=torch.Generator().manual_seed(1))
    targets = torch.randint(0, 40, (3, 5), generator=torch.Generator().manual_seed(2))
    want = (
        torch.log_softmax(logits.bfloat16().float(), -1)
        .gather(-1, targets.unsqueeze(-1))
        .squeeze(-1)
    )
    got = selective_logprobs(logits.bfloat16(), targets)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(
        selective_logprobs(logits, targets),
        torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1),
    )


# ----------------------------------------------------------------------------- devices


@pytest.mark.parametrize(
    "spec, rank, count, want",
    [
        ("cpu", None, 2, "cpu"),
        ("auto", None, 0, "cpu"),
        ("auto", None, 2, "cuda:0"),
        ("auto", 1, 2, "cuda:1"),  # torchrun: rank r takes cuda:LOCAL_RANK
        ("cuda", None, 1, "cuda:0"),
        ("cuda", 1, 2, "cuda:1"),
        ("cuda:1", None, 2, "cuda:1"),
    ],
)
def test_device_specs_resolve(spec, rank, count, want):
    from echo_rl.core.models import resolve_device

    assert resolve_device(
        spec, "learner.device", local_rank=rank, cuda_count=count
    ) == torch.device(want)


@pytest.mark.parametrize(
    "spec, rank, count, match",
    [
        ("cuda", None, 0, r"learner.device = 'cuda' but no CUDA GPU.*set learner.device = \"cpu\""),
        ("cuda:0", None, 0, "no CUDA GPU"),
        ("cuda:2", None, 2, "GPU 2 does not exist.*cuda:0 to cuda:1"),
        ("cuda", 3, 2, "GPU 3 does not exist"),
        ("cuda:0", 1, 2, 'under torchrun.*set learner.device = "cuda"'),
        ("tpu", None, 1, "unknown device"),
    ],
)
def test_bad_device_specs_explain_the_fix(spec, rank, count, match):
    from echo_rl.core.models import resolve_device

    with pytest.raises(ModelError, match=match):
        resolve_device(spec, "learner.device", local_rank=rank, cuda_count=count)


def test_device_keys_are_validated_in_the_config():
    from echo_rl.core.config import ConfigError, load_config

    cfg = load_config(None, ["learner.device=cuda:1", "worker.device=cpu"])
    assert (cfg.learner.device, cfg.worker.device) == ("cuda:1", "cpu")
    assert cfg.worker_view()["worker"]["device"] == "cpu"  # workers get it on join
    assert load_config(None).learner.device == "auto"
    for bad in ("gpu", "cuda:", "cuda:x", "CPU"):
        with pytest.raises(ConfigError, match=rf"learner.device = '{bad}'.*auto.*cpu.*cuda:N"):
            load_config(None, [f"learner.device={bad}"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_asking_for_cuda_without_one_fails_at_start_up():
    from echo_rl.learner.parallel import make_parallel
    from echo_rl.worker.backends import make_backend

    with pytest.raises(ModelError, match="learner.device = 'cuda' but no CUDA GPU"):
        make_parallel("cuda")
    with pytest.raises(ModelError, match="worker.device = 'cuda:0' but no CUDA GPU"):
        make_backend("transformers", model_cfg=ModelConfig(), device="cuda:0")
    assert make_parallel("auto").device == torch.device("cpu")


def test_cpu_learner_stays_float32_and_moves_batches_to_its_device(tokenizer):
    from echo_rl.data.adapter import LearnerBatch
    from echo_rl.learner.parallel import Single

    par = Single("cpu")
    model = par.wrap(load_model(ModelConfig(), tokenizer))
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert model(torch.tensor([[4, 5, 6]])).logits.dtype == torch.float32  # no autocast on CPU
    t = torch.ones(2, 3)
    batch = LearnerBatch(t.long(), t.long(), t, t, t[:, 0], t[:, 0], t[:, 0].long())
    moved = par.to_device(batch)
    assert moved.input_ids is batch.input_ids  # on the CPU nothing is copied
    model_sd, optim_sd = par.full_state(model, torch.optim.Adam(model.parameters()))
    assert all(v.device.type == "cpu" for v in model_sd.values())


def test_autocast_forward_covers_the_forward_only(tokenizer):
    """The bf16 path of a GPU learner, exercised on the CPU's autocast: forward in bf16,
    parameters and gradients float32, autocast off after the call (also after an error), and
    a deepcopy (the reference model) autocasts on its own."""
    import copy

    from echo_rl.learner.parallel.single import autocast_forward

    model = load_model(ModelConfig(), tokenizer)
    autocast_forward(model, "cpu", torch.bfloat16)
    ids = torch.tensor([[4, 5, 6, 7]])
    out = model(ids).logits
    assert out.dtype == torch.bfloat16
    assert not torch.is_autocast_enabled("cpu")
    out.float().sum().backward()
    assert all(p.grad.dtype == torch.float32 for p in model.parameters() if p.grad is not None)
    with pytest.raises(Exception):  # noqa: B017
        model(torch.tensor([[10_000]]))  # out of the vocabulary: the forward raises
    assert not torch.is_autocast_enabled("cpu")
    ref = copy.deepcopy(model).requires_grad_(False)
    with torch.no_grad():
        model.get_input_embeddings().weight.add_(1.0)
    assert ref(ids).logits.dtype == torch.bfloat16
    assert not torch.equal(
        ref(ids).logits, model(ids).logits
    )  # its own weights, not the original's


def test_a_runs_checkpoint_exports_as_a_model_folder(tmp_path, small_cfg, tokenizer):
    """`echo-rl model export`: the trained policy, loadable by model.name like any HF folder."""
    from echo_rl.core.config import dump_toml
    from echo_rl.core.gguf_import import ImportFailed
    from echo_rl.learner.checkpoint import export_checkpoint, save_checkpoint

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text(dump_toml(small_cfg))
    with pytest.raises(ImportFailed, match="no checkpoint"):
        export_checkpoint(run, tmp_path / "none")
    trained = load_model(small_cfg.model, tokenizer)
    with torch.no_grad():
        trained.lm_head.weight.mul_(3.0)  # anything the random init would not give
    save_checkpoint(run, 5, {"model": trained.state_dict(), "step": 5})
    out = export_checkpoint(run, tmp_path / "out")
    back = load_model(ModelConfig(name=str(out)), load_tokenizer(ModelConfig(name=str(out))))
    assert torch.equal(back.lm_head.weight, trained.lm_head.weight)
    with pytest.raises(ImportFailed, match="exists"):
        export_checkpoint(run, out)


def test_the_text_vocabulary_spells_ordinary_text_and_keeps_the_arith_ids():
    from echo_rl.core.models import build_tiny_tokenizer

    arith, text = build_tiny_tokenizer(), load_tokenizer(ModelConfig(tiny_vocab="text"))
    sentence = "Sort these numbers: 3, 1, 2.\nAnswer (ascending):"
    ids = text.encode(sentence)
    assert text.unk_token_id not in ids and text.decode(ids) == sentence
    assert arith.encode("12+3=") == text.encode("12+3=")  # the toy tasks' ids do not move
    assert len(arith) == 24 and len(text) > 90
    model = load_model(ModelConfig(tiny_vocab="text"), text)
    assert model.get_input_embeddings().weight.shape[0] == len(text)


def test_a_prompt_the_tokenizer_cannot_spell_stops_at_start_up():
    """<unk> in a prompt used to pass the start-up check: the model trained on unreadable text."""
    import random

    from echo_rl.core.models import build_tiny_tokenizer
    from echo_rl.data.adapter import Adapter, AdapterError, Prompt, check_adapter

    class Words(Adapter):
        def prompts(self, rng: random.Random):
            while True:
                yield Prompt(self.tokenizer.encode("sort: b a c"), {})

        def reward(self, task, completion_ids, completion_text):
            return 0.0

    with pytest.raises(AdapterError, match=r'unknown token.*model.tiny_vocab = "text"'):
        check_adapter(Words({}, build_tiny_tokenizer()), build_tiny_tokenizer(), "words")
    check_adapter(Words({}, build_tiny_tokenizer("text")), build_tiny_tokenizer("text"), "words")
