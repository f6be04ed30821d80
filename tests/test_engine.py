"""The generation engine (echo_rl/worker/backends/engine.py, echo_rl/worker/backends/decoder.py): its forward
against the model's own, its samples and log-probs against a full forward recompute, its
distribution against the transformers backend's, and the backend contract it shares with it
(budgets, continuations, stop, tail cut, answer restriction, token count, fallback)."""

from __future__ import annotations

import threading
from collections import Counter
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from echo_rl.core import wire  # noqa: E402
from echo_rl.core.config import LoraConfig, ModelConfig  # noqa: E402

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

TOL = 1e-4


@pytest.fixture(scope="module")
def engine():
    from echo_rl.worker.backends import make_backend

    return make_backend("engine", model_cfg=ModelConfig(), threads=1)


@pytest.fixture(scope="module")
def small_engine():
    """Four slots: a request of more samples goes through them by continuous batching."""
    from echo_rl.worker.backends import make_backend
    from echo_rl.worker.backends.engine import EngineTuning

    return make_backend("engine", model_cfg=ModelConfig(), threads=1, tuning=EngineTuning(slots=4))


def recompute(model, prompt, completion, temperature, bias=None) -> list[float]:
    """Log-probs of ``completion`` after ``prompt`` under ``softmax(logits / T + bias)``, from
    one full forward of the whole sequence."""
    if not completion:
        return []
    with torch.no_grad():
        logits = model(torch.tensor([list(prompt) + list(completion)])).logits[0].float()
    at = logits[len(prompt) - 1 : len(prompt) - 1 + len(completion)] / temperature
    if bias is not None:
        at = at + bias
    lp = torch.log_softmax(at, dim=-1).gather(-1, torch.tensor(completion)[:, None])[:, 0]
    return lp.tolist()


def assert_logprobs_recomputed(model, prompt, sample, temperature, bias=None) -> None:
    """The sample's own tokens (after its prefix) have the log-probs of a full recompute."""
    p = sample.prefix_len
    own = sample.completion_ids[p:]
    want = recompute(model, list(prompt) + sample.completion_ids[:p], own, temperature, bias)
    assert len(sample.logprobs) == len(sample.completion_ids)
    assert sample.logprobs[p:] == pytest.approx(want, abs=TOL)


# ------------------------------------------------------------------- the decoder's forward


def _check_decoder(model, vocab: int) -> None:
    """prefill of right-padded prompts of different lengths, then decode steps of every slot
    at its own position, against the model's forward over each slot's whole sequence."""
    from echo_rl.worker.backends.decoder import Decoder

    dec = Decoder(model)
    gen = torch.Generator().manual_seed(3)
    lengths = [5, 1, 9, 3]
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]
    width = max(lengths)
    ids = torch.tensor([p + [0] * (width - len(p)) for p in prompts])
    steps = 6
    columns = width + steps + 2
    rope = dec.rope(columns)
    with torch.no_grad():
        kv, last = dec.prefill(ids, torch.tensor(lengths), rope)
        assert last.shape == (len(prompts), vocab) and last.dtype == torch.float32
        for k, p in enumerate(prompts):
            want = model(torch.tensor([p])).logits[0, -1].float()
            assert torch.allclose(last[k], want, atol=TOL, rtol=0), k
        cache = dec.cache(len(prompts), columns)
        for s, n in enumerate(lengths):
            cache.kv[:, :, s, :, :n].copy_(kv[:, :, s, :, :n])
        seqs = [list(p) for p in prompts]
        pos = torch.tensor(lengths)
        for t in range(steps):
            tokens = torch.randint(3, vocab, (len(prompts),), generator=gen)
            # every other step reads only the columns the slots reached, as the eager loop does
            cols = None if t % 2 else int(pos.max()) + 1
            got = dec.step(tokens, pos.clone(), cache, rope, cols)
            assert got.shape == (len(prompts), vocab)
            for s in range(len(prompts)):
                seqs[s].append(int(tokens[s]))
                want = model(torch.tensor([seqs[s]])).logits[0, -1].float()
                assert torch.allclose(got[s], want, atol=TOL, rtol=0), (t, s)
            pos += 1


def test_decoder_prefill_and_steps_equal_the_models_forward(engine):
    assert engine.decoder is not None
    _check_decoder(engine.model, engine.vocab_size)


def test_decoder_runs_an_unmerged_lora_adapter_as_peft_does(tokenizer):
    from echo_rl.core.lora import wrap
    from echo_rl.core.models import load_model

    model = wrap(load_model(ModelConfig(), tokenizer), LoraConfig(enabled=True, rank=4, alpha=8))
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        touched = 0
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
                touched += 1
    assert touched
    model.eval()
    ids = torch.tensor([[3, 9, 4, 12, 7]])
    with torch.no_grad():
        with model.disable_adapter():
            base = model(ids).logits[0, -1]
        adapted = model(ids).logits[0, -1]
    assert (adapted - base).abs().max() > 0.05  # the adapter changes what the model computes
    _check_decoder(model, len(tokenizer))


# ----------------------------------------------------------------- the engine's samples


def test_engine_logprobs_equal_a_full_forward_recompute(engine):
    groups = [
        wire.Group(group_id="a", prompt_ids=[3, 4, 5], n=3, seed=11),
        wire.Group(group_id="b", prompt_ids=[6, 7, 8, 9, 10, 11, 12], n=2, seed=11),
    ]
    out = engine.generate(groups, 12, 0.7)
    assert [len(g) for g in out] == [3, 2]
    eos = engine.tokenizer.eos_token_id
    for g, samples in zip(groups, out):
        for s in samples:
            assert s.finished and s.prefix_len == 0
            assert 1 <= len(s.completion_ids) <= 12
            assert eos not in s.completion_ids[:-1]
            assert all(lp <= 0 for lp in s.logprobs)
            assert_logprobs_recomputed(engine.model, g.prompt_ids, s, 0.7)
    # not every sample is the same token sequence: the draws are random
    assert len({tuple(s.completion_ids) for g in out for s in g}) > 1


def test_answer_restriction_samples_only_the_set_under_the_renormalised_softmax(engine):
    from echo_rl.data.answers import answer_bias

    eos = engine.tokenizer.eos_token_id
    allowed = (eos, 5, 9, 17)
    engine.restrict_answers(allowed)
    try:
        g = wire.Group(group_id="r", prompt_ids=[3, 4, 5, 6], n=8, seed=2)
        (samples,) = engine.generate([g], 6, 0.7)
    finally:
        engine.restrict_answers(None)
    bias = answer_bias(allowed, engine.vocab_size)
    seen = set()
    for s in samples:
        assert set(s.completion_ids) <= set(allowed), s.completion_ids
        seen.update(s.completion_ids)
        assert_logprobs_recomputed(engine.model, g.prompt_ids, s, 0.7, bias)
    assert len(seen) > 1
    # the restriction is lifted: the same request now reaches tokens outside the set
    (free,) = engine.generate([g], 6, 0.7)
    assert any(t not in allowed for s in free for t in s.completion_ids)


def _pooled_table(a: Counter, b: Counter, least: int = 10) -> list[list[int]]:
    """Two rows of counts over the tokens either saw; tokens seen fewer than ``least`` times
    in both together pooled into one column."""
    keep = [t for t in sorted(set(a) | set(b)) if a[t] + b[t] >= least]
    rest = [t for t in set(a) | set(b) if t not in keep]
    table = [[c[t] for t in keep] + [sum(c[t] for t in rest)] for c in (a, b)]
    if not table[0][-1] + table[1][-1]:
        table = [row[:-1] for row in table]
    return table


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_engine_samples_the_distribution_the_transformers_backend_samples(temperature):
    """The same weights, made peaked (the random tiny model is close to uniform, where a
    wrong temperature would hardly show): first and second tokens of many samples from each
    backend, drawn with different seeds, pass a chi-square two-sample test."""
    from scipy.stats import chi2_contingency

    from echo_rl.worker.backends.engine import EngineBackend
    from echo_rl.worker.backends.transformers import TransformersBackend

    ref = TransformersBackend(ModelConfig(seed=5), threads=1)
    eng = EngineBackend(ModelConfig(), threads=1)
    with torch.no_grad():
        ref.model.model.norm.weight.mul_(8.0)
    eng.model.load_state_dict(ref.model.state_dict())
    eos = ref.tokenizer.eos_token_id
    n = 2000
    firsts, seconds = [], []
    for backend, seed in ((ref, 101), (eng, 202)):
        g = wire.Group(group_id="d", prompt_ids=[3, 4, 5], n=n, seed=seed)
        (samples,) = backend.generate([g], 2, temperature)
        assert len(samples) == n
        firsts.append(Counter(s.completion_ids[0] for s in samples))
        seconds.append(Counter(s.completion_ids[1] for s in samples if s.completion_ids[0] != eos))
    with torch.no_grad():
        probs = torch.softmax(ref.model(torch.tensor([[3, 4, 5]])).logits[0, -1] / temperature, -1)
    assert probs.max() > 0.3  # peaked: a temperature ignored would change the counts
    for a, b in (firsts, seconds):
        table = _pooled_table(a, b)
        assert len(table[0]) >= 3
        p = chi2_contingency(table).pvalue
        assert p > 1e-3, (temperature, table, p)


# ------------------------------------------------------------- budgets and continuous batching


def test_continuous_batching_keeps_every_rows_budget_and_logprobs(small_engine, monkeypatch):
    from echo_rl.worker.backends import decoder as decoder_mod

    caches = []
    real = decoder_mod.Decoder.cache

    def spy(self, slots, columns):
        caches.append(slots)
        return real(self, slots, columns)

    monkeypatch.setattr(decoder_mod.Decoder, "cache", spy)
    eos = small_engine.tokenizer.eos_token_id
    budgets = [2, 7, 30]
    groups = [
        wire.Group(group_id=f"g{k}", prompt_ids=[3 + k, 4, 5 + k], n=4, seed=9, max_new_tokens=b)
        for k, b in enumerate(budgets)
    ]
    before = small_engine.tokens_sampled
    out = small_engine.generate(groups, 20, 0.8)
    assert caches == [4]  # 12 rows through 4 slots
    assert [len(g) for g in out] == [4, 4, 4]
    for g, samples in zip(groups, out):
        budget = min(g.max_new_tokens, 20)
        for s in samples:
            assert s.finished
            assert 1 <= len(s.completion_ids) <= budget
            if len(s.completion_ids) < budget:
                assert s.completion_ids[-1] == eos
            assert eos not in s.completion_ids[:-1]
            assert_logprobs_recomputed(small_engine.model, g.prompt_ids, s, 0.8)
    # the short budget is what ended the first group's rows, and the long rows ran past it
    assert any(len(s.completion_ids) == 2 for s in out[0])
    assert max(len(s.completion_ids) for g in out[1:] for s in g) > 7
    # no slot sampled past its own row's end (tokens that would only be thrown away)
    assert small_engine.tokens_sampled - before == sum(
        len(s.completion_ids) for g in out for s in g
    )


def test_a_continuation_starts_with_its_prefix_and_goes_on_from_it(engine):
    eos = engine.tokenizer.eos_token_id
    prefix = wire.Prefix(
        sample_idx=1, ids=[7, 8, 9], logprobs=[-0.5, -1.5, -2.5], versions=[[4, 3]]
    )
    ended = wire.Prefix(sample_idx=2, ids=[6, eos], logprobs=[-0.2, -0.3], versions=[[4, 2]])
    g = wire.Group(group_id="c", prompt_ids=[3, 4, 5], n=3, seed=4, prefixes=[prefix, ended])
    (samples,) = engine.generate([g], 10, 0.7)
    fresh, cont, done = samples
    assert fresh.prefix_len == 0 and fresh.prefix_versions == []
    assert cont.prefix_len == 3
    assert cont.completion_ids[:3] == [7, 8, 9]
    assert cont.logprobs[:3] == [-0.5, -1.5, -2.5]
    assert cont.prefix_versions == [[4, 3]]
    assert 3 < len(cont.completion_ids) <= 10  # the budget counts the prefix
    assert cont.finished
    if len(cont.completion_ids) < 10:
        assert cont.completion_ids[-1] == eos
    assert_logprobs_recomputed(engine.model, g.prompt_ids, cont, 0.7)
    assert_logprobs_recomputed(engine.model, g.prompt_ids, fresh, 0.7)
    # a prefix that already ended comes back as it is
    assert done.completion_ids == [6, eos] and done.logprobs == [-0.2, -0.3]
    assert done.prefix_len == 2 and done.finished


# -------------------------------------------------------------------------- stop and tail cut


def test_a_stop_already_set_returns_unfinished_samples_of_at_most_a_token(engine, small_engine):
    eos = engine.tokenizer.eos_token_id
    stop = threading.Event()
    stop.set()
    pre = wire.Prefix(sample_idx=0, ids=[7, 8], logprobs=[-1.0, -1.0], versions=[[1, 2]])
    groups = [
        wire.Group(group_id="s", prompt_ids=[3, 4], n=8, seed=1),
        wire.Group(group_id="p", prompt_ids=[5, 6], n=1, seed=1, prefixes=[pre]),
    ]
    for backend in (engine, small_engine):  # all rows in slots; most of them still waiting
        out = backend.generate(groups, 20, 1.0, stop=stop)
        assert [len(g) for g in out] == [8, 1]
        unfinished = 0
        for s in out[0]:
            assert len(s.completion_ids) <= 1
            ended = s.completion_ids == [eos]
            assert s.finished == ended
            unfinished += not s.finished
        assert unfinished
        (c,) = out[1]
        assert c.completion_ids[:2] == [7, 8] and c.prefix_len == 2
        assert len(c.completion_ids) <= 3
        assert not c.finished or c.completion_ids[-1] == eos
        for g, samples in zip(groups, out):
            for s in samples:
                assert_logprobs_recomputed(backend.model, g.prompt_ids, s, 1.0)


def test_the_tail_cut_ends_the_request_once_the_share_of_fresh_samples_has_ended(engine):
    eos = engine.tokenizer.eos_token_id
    g = wire.Group(group_id="t", prompt_ids=[3, 4], n=32, seed=5)
    (whole,) = engine.generate([g], 60, 1.0)
    (cut,) = engine.generate([g], 60, 1.0, tail=0.5)
    assert all(s.finished for s in whole)
    ended = [s for s in cut if s.finished]
    running = [s for s in cut if not s.finished]
    assert running and len(ended) >= 16  # it stopped once half had ended, not before
    lengths = {len(s.completion_ids) for s in running}
    assert len(lengths) == 1 and all(s.completion_ids[-1] != eos for s in running)
    at = lengths.pop()
    assert max(len(s.completion_ids) for s in whole) > at  # it saved tokens
    assert all(s.completion_ids[-1] == eos and len(s.completion_ids) <= at for s in ended)
    # not cut late either: one token earlier, fewer than half had ended
    assert sum(1 for s in ended if len(s.completion_ids) < at) < 16
    for s in cut:
        assert_logprobs_recomputed(engine.model, g.prompt_ids, s, 1.0)


# --------------------------------------------------------------------- counting and fallback


def test_tokens_sampled_grows_by_the_new_tokens(small_engine):
    pre = wire.Prefix(sample_idx=1, ids=[7, 8], logprobs=[-1.0, -1.0], versions=[[1, 2]])
    groups = [
        wire.Group(group_id="x", prompt_ids=[3, 4], n=5, seed=8, prefixes=[pre]),
        wire.Group(group_id="y", prompt_ids=[5], n=3, seed=8, max_new_tokens=4),
    ]
    before = small_engine.tokens_sampled
    out = small_engine.generate(groups, 15, 1.0)
    new = sum(len(s.completion_ids) - s.prefix_len for g in out for s in g)
    assert new > 8
    assert small_engine.tokens_sampled - before == new
    stop = threading.Event()
    stop.set()
    before = small_engine.tokens_sampled
    out = small_engine.generate(groups, 15, 1.0, stop=stop)
    new = sum(len(s.completion_ids) - s.prefix_len for g in out for s in g)
    assert small_engine.tokens_sampled - before == new


def test_unsupported_architectures_are_refused_by_the_decoder():
    from transformers import GPT2Config, GPT2LMHeadModel, Qwen3Config, Qwen3ForCausalLM

    from echo_rl.worker.backends.decoder import Decoder, UnsupportedModel, check_supported

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=24, n_positions=16, n_embd=8, n_layer=1, n_head=2))
    with pytest.raises(UnsupportedModel, match="gpt2"):
        check_supported(gpt2)
    with pytest.raises(UnsupportedModel):
        Decoder(gpt2)
    qwen = dict(vocab_size=24, hidden_size=8, num_hidden_layers=1, num_attention_heads=2)
    check_supported(Qwen3ForCausalLM(Qwen3Config(**qwen)))  # supported as it is
    renamed = Qwen3Config(**qwen)
    renamed.model_type = "qwen3_moe"
    with pytest.raises(UnsupportedModel, match="qwen3_moe"):
        check_supported(SimpleNamespace(config=renamed))
    sliding = Qwen3Config(**qwen, use_sliding_window=True, sliding_window=4, max_window_layers=0)
    with pytest.raises(UnsupportedModel):
        check_supported(SimpleNamespace(config=sliding))


def test_the_engine_falls_back_to_generate_for_a_model_it_does_not_run(monkeypatch):
    from echo_rl.worker.backends import engine as engine_mod
    from echo_rl.worker.backends.transformers import TransformersBackend

    def refuse(model):
        raise engine_mod.UnsupportedModel("model_type 'gpt2'")

    monkeypatch.setattr(engine_mod, "Decoder", refuse)
    eng = engine_mod.EngineBackend(ModelConfig(), threads=1)
    assert eng.decoder is None
    ref = TransformersBackend(ModelConfig(), threads=1)
    g = wire.Group(group_id="f", prompt_ids=[3, 4, 5], n=4, seed=3)
    (got,) = eng.generate([g], 8, 0.7)
    (want,) = ref.generate([g], 8, 0.7)
    assert [s.completion_ids for s in got] == [s.completion_ids for s in want]
    assert [s.logprobs for s in got] == [s.logprobs for s in want]


def test_a_kept_cuda_workspace_serves_a_request_only_when_it_fits_and_is_not_much_larger():
    """On CUDA the captured step computes every slot and column of the kept workspace: it is
    reused for a request it holds, and not for one it would make pay for 2x its shape."""
    from echo_rl.worker.backends.engine import _fits

    assert _fits((16, 128, 64), (16, 128, 64)) and _fits((32, 256, 128), (16, 128, 64))
    assert not _fits((16, 128, 64), (32, 128, 64))  # too few slots
    assert not _fits((16, 128, 64), (16, 128, 128))  # too narrow for the budget
    assert not _fits((256, 256, 128), (16, 256, 128))  # 16x the slots a batch of 16 needs
    assert not _fits((16, 1024, 128), (16, 256, 128))  # 4x the columns


def test_with_every_row_in_a_slot_the_engine_draws_what_generate_draws_for_the_seed():
    """The exponential race is how torch.multinomial draws one sample too, and both draw a
    [rows, vocab] race per step: on the CPU, same weights and seed, the samples are the same
    (docs/worker.md; why `echo-rl eval`'s untrained score did not move with the switch)."""
    from echo_rl.worker.backends.engine import EngineBackend
    from echo_rl.worker.backends.transformers import TransformersBackend

    old = TransformersBackend(ModelConfig(), threads=1)
    new = EngineBackend(ModelConfig(), threads=1)
    new.model.load_state_dict(old.model.state_dict())
    groups = [
        wire.Group(group_id=f"g{i}", prompt_ids=[7, 14, 8, 17], n=8, seed=3) for i in range(4)
    ]
    a, b = old.generate(groups, 16, 1.0), new.generate(groups, 16, 1.0)
    assert [[s.completion_ids for s in g] for g in a] == [[s.completion_ids for s in g] for g in b]
    for ga, gb in zip(a, b):
        for sa, sb in zip(ga, gb):
            assert sa.logprobs == pytest.approx(sb.logprobs, abs=1e-5)
