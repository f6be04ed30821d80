"""Oracle parity with LoRA (issue 32): Echo's step on a peft-wrapped policy (``echo_rl.core.lora.wrap``)
against TRL 1.16's GRPOTrainer given the same peft config (``peft_config=``, TRL wraps the model
itself): the loss and every adapter gradient within 1e-5, and no gradient on the frozen base.

Both sides start from the same weights: the tiny Qwen3 of tests/test_oracle.py, wrapped, then
every adapter tensor set to the same deterministic values (a fresh adapter has B = 0, so A would
get no gradient and the adapter would change nothing). With the KL term on, TRL computes the
reference log-probs with the adapter disabled (the base model), as Echo's ``ref_logprobs`` does.
The cases reuse tests/test_oracle.py's batches, records and TRL plumbing.
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("trl")
pytest.importorskip("peft")

from test_oracle import (  # noqa: E402, F401
    ECHO_AGG,
    RTOL,
    TRL_NAME,
    B,
    C,
    batch,
    make_trl_trainer,
    model_dir,
    our_loss,
    step_records,
    tok,
    trl_loss,
)

from echo_rl.core.config import LoraConfig  # noqa: E402
from echo_rl.core.lora import adapter_parameters, peft_config, wrap  # noqa: E402
from echo_rl.core.models import ModelConfig, load_model  # noqa: E402
from echo_rl.learner.loss import LossConfig  # noqa: E402

pytestmark = pytest.mark.oracle

ALL_LINEAR = LoraConfig(enabled=True, rank=4, alpha=8.0)
QV = LoraConfig(enabled=True, rank=2, alpha=4.0, target_modules=["q_proj", "v_proj"])


def seed_adapter(model, scale=0.05, seed=9):
    """The same adapter values on either side (by parameter name)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(adapter_parameters(model).items()):
            p.copy_(scale * torch.randn(p.shape, generator=g))


def perturb_adapter(model, scale=0.3):
    """The update since step start: with LoRA only the adapter moves."""
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for _, p in sorted(adapter_parameters(model).items()):
            p.add_(scale * p.abs().mean() * torch.randn(p.shape, generator=g))


def echo_model(model_dir, tok, lora):
    model = wrap(load_model(ModelConfig(name=str(model_dir)), tok), lora)
    seed_adapter(model)
    return model


def trl_trainer(model_dir, tok, tmp_path, lora, loss_type, beta, epsilon, **kw):
    trainer = make_trl_trainer(
        load_model(ModelConfig(name=str(model_dir)), tok),
        tok,
        tmp_path,
        loss_type,
        beta,
        epsilon,
        peft_config=peft_config(lora),
        **kw,
    )
    seed_adapter(trainer.model)
    return trainer


def assert_adapter_grads_equal(ours, theirs):
    pa, pb = dict(ours.named_parameters()), dict(theirs.named_parameters())
    assert pa.keys() == pb.keys()
    adapter = set(adapter_parameters(ours))
    assert adapter and adapter == set(adapter_parameters(theirs))
    for name in pa:
        ga, gb = pa[name].grad, pb[name].grad
        if name not in adapter:  # the base is frozen on both sides
            assert ga is None and gb is None and not pa[name].requires_grad, name
            continue
        assert ga is not None and gb is not None, name
        assert float(gb.abs().max()) > 0, name  # every adapter tensor is trained
        atol = RTOL * float(gb.abs().max()) + 1e-12
        torch.testing.assert_close(
            ga, gb, rtol=RTOL, atol=atol, msg=lambda m, name=name: f"{name}: {m}"
        )


# ----------------------------------------------------------------------------- fixed inputs

LOSS_CASES = [
    # (id, lora, our agg, TRL loss_type, beta, truncated IS on)
    ("all-linear-bnpo-is", ALL_LINEAR, "token-mean", "bnpo", 0.0, True),
    ("all-linear-grpo-kl", ALL_LINEAR, "seq-mean", "grpo", 0.05, False),
    ("qv-dapo-kl-is", QV, "token-mean", "dapo", 0.05, True),
]


@pytest.mark.parametrize(
    "lora,agg,loss_type,beta,use_is", [c[1:] for c in LOSS_CASES], ids=[c[0] for c in LOSS_CASES]
)
def test_lora_loss_and_adapter_grads_match_trl(
    model_dir, tok, batch, tmp_path, lora, agg, loss_type, beta, use_is
):
    is_cap = 2.0
    ours = echo_model(model_dir, tok, lora)
    loss_a, _ = our_loss(
        ours, batch, LossConfig(epsilon=0.2, is_cap=is_cap, beta=beta, agg=agg), use_is
    )
    loss_a.backward()
    trainer = trl_trainer(model_dir, tok, tmp_path, lora, loss_type, beta, 0.2)
    loss_b = trl_loss(trainer, batch, beta, is_cap if use_is else None)
    loss_b.backward()

    assert math.isfinite(loss_a.item())
    assert loss_a.item() == pytest.approx(loss_b.item(), rel=RTOL, abs=1e-7)
    assert_adapter_grads_equal(ours, trainer.model)


# ----------------------------------------------------------------------------- a whole step


def echo_step(model_dir, tok, recs, lora, options, loss_type, temperature):
    """Echo's learner path on a LoRA policy: materialise, prepare, step-start and reference
    log-probs (``ref_logprobs``: the adapter disabled), the adapter moves, the mini-batch loss."""
    from echo_rl.core.config import LearnerConfig
    from echo_rl.data.adapter import load_adapter
    from echo_rl.learner.trainer import Sampling, Trainer

    lc = LearnerConfig(**options, loss_agg=ECHO_AGG[loss_type])
    trainer = Trainer(
        echo_model(model_dir, tok, lora),
        lc,
        sampling=Sampling(temperature=temperature, max_new_tokens=C, eos_token_id=tok.eos_token_id),
    )
    assert trainer.ref_model is None  # no copy of the model: the base is the reference
    adapter = load_adapter("toy-add", {}, tok, check_prompts=False)
    groups = [recs[k : k + 2] for k in range(0, B, 2)]
    batch, _ = trainer.prepare(
        adapter.materialise(groups, lc.adv_eps, scale_rewards=lc.scale_rewards)
    )
    rows = torch.arange(B)
    with torch.no_grad():
        old = trainer.logprobs(trainer.model, batch, rows)
        ref = trainer.ref_logprobs(batch, rows)
    perturb_adapter(trainer.model)
    loss, stats = trainer.minibatch_loss(batch, rows, old, ref)
    return trainer.model, loss, stats


def trl_step(model_dir, tok, tmp_path, recs, lora, options, loss_type, temperature):
    trl_args = {TRL_NAME[k]: v for k, v in options.items()}
    trl_args.setdefault("vllm_importance_sampling_mode", "token_truncate")  # Echo's default
    trl_args.setdefault("vllm_importance_sampling_clip_max", 2.0)
    trainer = trl_trainer(
        model_dir,
        tok,
        tmp_path,
        lora,
        loss_type,
        trl_args.pop("beta", 0.0),
        trl_args.pop("epsilon", 0.2),
        rewards=[r.reward for r in recs],
        temperature=temperature,
        num_iterations=2,
        **trl_args,
    )
    trainer.use_vllm = trainer.vllm_importance_sampling_correction = True
    trainer._generate = lambda prompts: (
        [r.prompt_ids for r in recs],
        [r.completion_ids for r in recs],
        None,
        [tok.decode(r.completion_ids) for r in recs],
        [r.logprobs for r in recs],
        {},
        None,
        None,
    )
    trainer.model.train()
    inputs = trainer._generate_and_score_completions([{"prompt": "1+2="}] * B)
    perturb_adapter(trainer.model)
    return trainer, trainer.compute_loss(trainer.model, inputs)


STEP_CASES = [
    # (id, lora, TRL loss_type, temperature, Echo learner options)
    ("all-linear-dapo-kl-t0.7", ALL_LINEAR, "dapo", 0.7, {"beta": 0.05}),
    ("qv-grpo", QV, "grpo", 1.0, {}),
    (
        "all-linear-everything",
        ALL_LINEAR,
        "dr_grpo",
        0.7,
        {
            "epsilon_high": 0.28,
            "scale_rewards": "batch",
            "is_mode": "sequence_truncate",
            "importance_sampling_level": "sequence",
            "beta": 0.05,
            "use_bias_correction_kl": True,
            "mask_truncated_completions": True,
        },
    ),
]


@pytest.mark.parametrize(
    "lora,loss_type,temperature,options",
    [c[1:] for c in STEP_CASES],
    ids=[c[0] for c in STEP_CASES],
)
def test_lora_step_matches_trl(
    model_dir, tok, step_records, tmp_path, lora, loss_type, temperature, options
):
    recs = step_records(temperature)
    ours, loss_a, stats = echo_step(model_dir, tok, recs, lora, options, loss_type, temperature)
    loss_a.backward()
    trainer, loss_b = trl_step(
        model_dir, tok, tmp_path, recs, lora, options, loss_type, temperature
    )
    loss_b.backward()

    assert math.isfinite(loss_a.item())
    assert loss_a.item() == pytest.approx(loss_b.item(), rel=RTOL, abs=1e-7)
    assert_adapter_grads_equal(ours, trainer.model)
    if options.get("beta"):  # the reference is the base on both sides
        assert stats["kl_mean"] > 0
        assert stats["kl_mean"] == pytest.approx(trainer._metrics["train"]["kl"][-1], rel=1e-5)


def test_lora_reference_is_the_base_not_the_adapter(model_dir, tok, step_records):
    """Negative control: with the adapter left on for the reference, the KL (and so the loss)
    is not TRL's."""
    recs = step_records(0.7)
    _, loss_a, stats = echo_step(model_dir, tok, recs, ALL_LINEAR, {"beta": 0.05}, "dapo", 0.7)
    from echo_rl.learner import trainer as trainer_mod

    real = trainer_mod.Trainer.ref_logprobs
    trainer_mod.Trainer.ref_logprobs = lambda self, b, r: self.logprobs(self.model, b, r)
    try:
        _, loss_c, stats_c = echo_step(
            model_dir, tok, recs, ALL_LINEAR, {"beta": 0.05}, "dapo", 0.7
        )
    finally:
        trainer_mod.Trainer.ref_logprobs = real
    assert stats_c["kl_mean"] != pytest.approx(stats["kl_mean"], rel=1e-3)
    assert loss_c.item() != pytest.approx(loss_a.item(), rel=1e-5)
