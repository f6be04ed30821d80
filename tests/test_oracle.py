"""Oracle parity: our GRPO loss (learner/loss.py, DESIGN 7) against TRL's GRPOTrainer.

Identical batches (prompt/completion ids and masks, advantages, old, behaviour and reference
log-probs) go to

  * ours: ``token_logprobs`` on the model, then ``grpo_loss`` on the [B, L-1] target layout the
    learner uses (loss mask zero on prompt and padding positions);
  * TRL: ``GRPOTrainer.compute_loss`` (its real loss code, including its fused LM-head log-probs)
    on a second copy of the same weights, with the inputs dict its ``_generate_and_score_completions``
    would hand over;

and the loss values and every parameter gradient must agree to rtol 1e-5.

Mapping (trl 1.16, ``GRPOTrainer._compute_loss``):

  ours ``agg="token-mean"``  ==  TRL ``loss_type="bnpo"`` (sum over masked tokens / masked tokens
                                 of the micro-batch); also == ``"dapo"`` when the micro-batch is the
                                 whole generation batch (dapo divides by the token count of the
                                 whole generation batch, ``num_items_in_batch``, split over
                                 ``steps_per_generation``), which is the case here.
  ours ``agg="seq-mean"``    ==  TRL ``loss_type="grpo"`` (per-sequence mean, then batch mean).
  ours ``beta*kl``           ==  TRL ``beta`` with ``use_bias_correction_kl=False``. TRL 1.16 defaults
                                 that flag to True (KL multiplied by the differentiable ratio r, the
                                 DeepSeek-V3.2 unbiased estimator); DESIGN 7 uses the plain k3 term.
  ours ``w`` (truncated IS)  ==  TRL's vLLM IS correction with ``vllm_importance_sampling_mode=
                                 "token_truncate"``, ``clip_max=C``, ``clip_min=None``: TRL multiplies
                                 the clipped per-token surrogate by ``clamp(exp(old - sampling), max=C)``
                                 before adding the KL, exactly our ``w*surr - beta*kl``. TRL's defaults
                                 differ (``"sequence_mask"``, C_max=3.0), TRL only applies it with
                                 ``use_vllm=True`` (sampler = vLLM engine; ours: behaviour = the worker's
                                 possibly stale policy), and TRL turns a NaN sampling log-prob into
                                 w=1 where ours would propagate NaN. The ratio itself is computed inside
                                 TRL's generation function, so the test computes it with TRL's formula
                                 and, separately, checks our w against an independent computation.
"""

from __future__ import annotations

import copy
import math
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_DISABLED", "true")
os.environ.setdefault("WANDB_MODE", "disabled")

torch = pytest.importorskip("torch")
trl = pytest.importorskip("trl")

from echo.config import ModelConfig  # noqa: E402
from echo.models import build_tiny_tokenizer, load_model  # noqa: E402
from learner.loss import LossConfig, grpo_loss  # noqa: E402
from learner.trainer import token_logprobs  # noqa: E402

pytestmark = pytest.mark.oracle

RTOL = 1e-5
P, C = 6, 10  # padded prompt and completion widths
B = 8  # 4 groups of 2


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tok):
    """The tiny Qwen3 saved to disk: TRL builds its reference model from the config's path."""
    d = tmp_path_factory.mktemp("tiny-qwen3")
    model = load_model(ModelConfig(), tok)
    with torch.no_grad():  # random init is small; spread logits so log-probs are not all ~ -log V
        for p in model.parameters():
            p.mul_(3.0)
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return d


def fresh_model(model_dir, tok):
    return load_model(ModelConfig(name=str(model_dir)), tok)


@pytest.fixture(scope="module")
def batch(model_dir, tok):
    """Left-padded prompts, right-padded completions (TRL's layout), every log-prob input fixed."""
    g = torch.Generator().manual_seed(7)
    vocab = len(tok)
    first = 4  # skip the special tokens
    prompt_lens = [6, 6, 4, 5, 3, 6, 2, 6]
    comp_lens = [10, 7, 10, 1, 4, 10, 9, 3]
    prompt_ids = torch.full((B, P), tok.pad_token_id, dtype=torch.long)
    prompt_mask = torch.zeros((B, P), dtype=torch.long)
    completion_ids = torch.full((B, C), tok.pad_token_id, dtype=torch.long)
    completion_mask = torch.zeros((B, C), dtype=torch.long)
    for i, (lp, lc) in enumerate(zip(prompt_lens, comp_lens)):
        prompt_ids[i, P - lp:] = torch.randint(first, vocab, (lp,), generator=g)
        prompt_mask[i, P - lp:] = 1
        completion_ids[i, :lc] = torch.randint(first, vocab, (lc,), generator=g)
        completion_mask[i, :lc] = 1
    # Rewards per group of 2 -> group-normalised advantages of both signs (and one zero group).
    from dataplane.advantages import group_advantages

    rewards = [1.0, 0.0, 0.0, 1.0, 0.3, 0.3, 2.0, -1.0]
    adv = []
    for k in range(0, B, 2):
        adv += group_advantages(rewards[k:k + 2])
    advantages = torch.tensor(adv, dtype=torch.float32)

    # Current log-probs of the completions, to build old/ref/behaviour log-probs around them.
    model = fresh_model(model_dir, tok)
    ids = torch.cat([prompt_ids, completion_ids], 1)
    attn = torch.cat([prompt_mask, completion_mask], 1)
    with torch.no_grad():
        cur = token_logprobs(model, ids, attn)[:, P - 1:]
    cm = completion_mask.float()
    # |noise| ~ 0.3 puts many ratios r = exp(logp - old) outside [0.8, 1.2], on both sides.
    old = cur - 0.35 * torch.randn(cur.shape, generator=g)
    ref = cur + 0.5 * torch.randn(cur.shape, generator=g)
    # behaviour: some tokens far below old so that exp(old - behaviour) exceeds the cap C = 2.
    behaviour = old - 0.8 * torch.randn(cur.shape, generator=g).abs() + 0.3 * torch.randn(cur.shape, generator=g)
    # Values at masked positions are junk on purpose: both sides must ignore them.
    for x in (old, ref, behaviour):
        x.mul_(cm).add_((1 - cm) * -0.7)
    return {
        "prompt_ids": prompt_ids, "prompt_mask": prompt_mask,
        "completion_ids": completion_ids, "completion_mask": completion_mask,
        "advantages": advantages, "old": old, "ref": ref, "behaviour": behaviour, "cur": cur,
    }


def to_ours(batch, key):
    """A [B, C] completion-aligned tensor placed in the learner's [B, L-1] target layout."""
    x = batch[key]
    out = torch.full((x.shape[0], P + C - 1), -1.3)  # junk on prompt positions, masked out
    out[:, P - 1:] = x
    return out


def subset(batch, rows):
    return {k: v[rows] for k, v in batch.items()}


def our_loss(model, batch, cfg: LossConfig, use_is: bool, denom=None):
    n = batch["prompt_ids"].shape[0]
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    attn = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    mask = torch.zeros(n, P + C - 1)
    mask[:, P - 1:] = batch["completion_mask"].float()
    old = to_ours(batch, "old")
    behaviour = to_ours(batch, "behaviour") if use_is else old.clone()  # w = exp(0) = 1
    logp = token_logprobs(model, ids, attn)
    kwargs = {} if denom is None else {"denom": denom}
    return grpo_loss(logp, old, behaviour, batch["advantages"], mask, cfg,
                     to_ours(batch, "ref") if cfg.beta > 0 else None, **kwargs)


def trl_is_ratio(old, sampling, mask, clip_max, clip_min=None):
    """TRL 1.16 ``_generate_and_score_completions``, mode "token_truncate" (copied formula)."""
    diff = torch.nan_to_num((old - sampling) * mask, nan=0.0)
    return torch.clamp(torch.exp(diff), min=clip_min, max=clip_max)


def make_trl_trainer(model, tok, tmp_path, loss_type, beta, epsilon):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(
        output_dir=str(tmp_path), report_to="none", use_cpu=True, bf16=False, fp16=False,
        activation_checkpointing=False, per_device_train_batch_size=B, num_generations=2,
        max_completion_length=C, loss_type=loss_type, beta=beta, epsilon=epsilon,
        use_bias_correction_kl=False, save_strategy="no", logging_steps=1, seed=0,
        disable_dropout=True,
    )
    ds = Dataset.from_dict({"prompt": ["1+2="] * B})
    trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                          args=args, train_dataset=ds, processing_class=tok)
    trainer.current_gradient_accumulation_steps = 1  # set by the HF training loop otherwise
    return trainer


def trl_loss(trainer, batch, beta, is_cap, num_items=None):
    cm = batch["completion_mask"]
    inputs = {
        "prompt_ids": batch["prompt_ids"], "prompt_mask": batch["prompt_mask"],
        "completion_ids": batch["completion_ids"], "completion_mask": cm,
        "advantages": batch["advantages"], "old_per_token_logps": batch["old"],
        "num_items_in_batch": cm.sum() if num_items is None else torch.tensor(float(num_items)),
    }
    if beta > 0:
        inputs["ref_per_token_logps"] = batch["ref"]
    if is_cap is not None:
        # TRL applies the truncated IS weight only behind use_vllm; flip the two switches its
        # _compute_loss reads (nothing else in the loss path looks at them).
        trainer.use_vllm = True
        trainer.vllm_importance_sampling_correction = True
        trainer.vllm_importance_sampling_mode = "token_truncate"
        inputs["importance_sampling_ratio"] = trl_is_ratio(batch["old"], batch["behaviour"],
                                                           cm.float(), clip_max=is_cap)
    trainer.model.train()
    return trainer.compute_loss(trainer.model, inputs)


def assert_grads_equal(model_a, model_b):
    pa, pb = dict(model_a.named_parameters()), dict(model_b.named_parameters())
    assert pa.keys() == pb.keys()
    for name in pa:
        ga, gb = pa[name].grad, pb[name].grad
        assert ga is not None and gb is not None, name
        # rtol 1e-5 relative to the tensor's scale: entries that are ~0 only need to be ~0.
        atol = RTOL * float(gb.abs().max()) + 1e-12
        torch.testing.assert_close(ga, gb, rtol=RTOL, atol=atol, msg=lambda m: f"{name}: {m}")


# ----------------------------------------------------------------------------- parity with TRL

CASES = [
    # (our agg, TRL loss_type, beta, truncated IS on, epsilon)
    ("token-mean", "bnpo", 0.0, False, 0.2),
    ("token-mean", "dapo", 0.0, False, 0.2),
    ("seq-mean", "grpo", 0.0, False, 0.2),
    ("token-mean", "bnpo", 0.05, False, 0.2),
    ("token-mean", "dapo", 0.05, False, 0.1),
    ("seq-mean", "grpo", 0.05, False, 0.2),
    ("token-mean", "bnpo", 0.0, True, 0.2),
    ("token-mean", "dapo", 0.05, True, 0.2),
    ("seq-mean", "grpo", 0.05, True, 0.1),
]


@pytest.mark.parametrize("agg,loss_type,beta,use_is,epsilon", CASES,
                         ids=[f"{a}-{t}-beta{b}-{'is' if i else 'nois'}-eps{e}" for a, t, b, i, e in CASES])
def test_loss_and_grads_match_trl(model_dir, tok, batch, tmp_path, agg, loss_type, beta, use_is, epsilon):
    is_cap = 2.0
    cfg = LossConfig(epsilon=epsilon, is_cap=is_cap, beta=beta, agg=agg)

    ours_model = fresh_model(model_dir, tok)
    loss_a, stats = our_loss(ours_model, batch, cfg, use_is)
    loss_a.backward()

    trainer = make_trl_trainer(fresh_model(model_dir, tok), tok, tmp_path, loss_type, beta, epsilon)
    loss_b = trl_loss(trainer, batch, beta, is_cap if use_is else None)
    loss_b.backward()

    assert not trainer.args.gradient_checkpointing
    assert math.isfinite(loss_a.item())
    assert loss_a.item() == pytest.approx(loss_b.item(), rel=RTOL, abs=1e-7)
    assert_grads_equal(ours_model, trainer.model)

    # The clip must actually be exercised on both advantage signs, and both sides must agree on it.
    m = trainer._metrics["train"]
    assert m["clip_ratio/low_mean"][-1] > 0 and m["clip_ratio/high_mean"][-1] > 0
    assert stats["clip_frac"] == pytest.approx(m["clip_ratio/region_mean"][-1], rel=1e-6)
    if beta > 0:
        assert stats["kl_mean"] == pytest.approx(m["kl"][-1], rel=1e-5)
    if use_is:
        w = trl_is_ratio(batch["old"], batch["behaviour"], batch["completion_mask"].float(), is_cap)
        cm = batch["completion_mask"].bool()
        assert (w[cm] == is_cap).any() and (w[cm] < 1).any()  # the cap binds on some tokens


@pytest.mark.parametrize("agg,loss_type", [("token-mean", "bnpo"), ("seq-mean", "grpo")])
def test_sharded_denominator_matches_trl_full_batch(model_dir, tok, batch, tmp_path, agg, loss_type):
    """Two ranks' shards with ``denom`` = global count / world, gradients averaged (what DDP does),
    equal TRL's loss on the whole batch; and per shard, token-mean with ``denom`` D equals TRL's
    "dapo" whose normaliser is ``num_items_in_batch`` = D (one process, steps_per_generation 1)."""
    beta, world, is_cap = 0.05, 2, 2.0
    cfg = LossConfig(beta=beta, agg=agg, is_cap=is_cap)
    n_tok = int(batch["completion_mask"].sum())
    global_count = n_tok if agg == "token-mean" else B
    shards = [torch.arange(0, B // 2), torch.arange(B // 2, B)]
    assert int(batch["completion_mask"][shards[0]].sum()) != n_tok // 2  # denom really differs from local

    ours_model = fresh_model(model_dir, tok)
    shard_losses = []
    for rows in shards:
        loss, _ = our_loss(ours_model, subset(batch, rows), cfg, use_is=True, denom=global_count / world)
        loss.backward()  # grads add up over the shards; averaged below
        shard_losses.append(loss.item())
    for p in ours_model.parameters():
        p.grad /= world

    trainer = make_trl_trainer(fresh_model(model_dir, tok), tok, tmp_path, loss_type, beta, 0.2)
    full = trl_loss(trainer, batch, beta, is_cap)
    full.backward()
    assert sum(shard_losses) / world == pytest.approx(full.item(), rel=RTOL, abs=1e-7)
    assert_grads_equal(ours_model, trainer.model)

    if agg == "token-mean":
        dapo = make_trl_trainer(fresh_model(model_dir, tok), tok, tmp_path, "dapo", beta, 0.2)
        for rows, ours_value in zip(shards, shard_losses):
            value = trl_loss(dapo, subset(batch, rows), beta, is_cap, num_items=n_tok / world)
            assert ours_value == pytest.approx(value.item(), rel=RTOL, abs=1e-7)


def test_trl_default_kl_differs_from_design(model_dir, tok, batch, tmp_path):
    """Documents a design difference: TRL's default use_bias_correction_kl=True is not DESIGN 7."""
    cfg = LossConfig(beta=0.05, agg="token-mean")
    ours_model = fresh_model(model_dir, tok)
    loss_a, _ = our_loss(ours_model, batch, cfg, use_is=False)
    trainer = make_trl_trainer(fresh_model(model_dir, tok), tok, tmp_path, "bnpo", 0.05, 0.2)
    trainer.args.use_bias_correction_kl = True
    loss_b = trl_loss(trainer, batch, 0.05, None)
    assert loss_a.item() != pytest.approx(loss_b.item(), rel=1e-4)


def test_advantages_match_trl_formula():
    """dataplane.advantages vs TRL's group scaling: (r - mean) / (nanstd (Bessel) + 1e-4)."""
    from trl.trainer.utils import nanstd

    from dataplane.advantages import group_advantages

    g = torch.Generator().manual_seed(3)
    rewards = torch.rand(6, 5, generator=g, dtype=torch.float64)
    rewards[2] = 0.5  # zero-variance group
    expected = (rewards - rewards.mean(1, keepdim=True)) / (nanstd(rewards, dim=1).unsqueeze(1) + 1e-4)
    ours = torch.tensor([group_advantages(row.tolist(), 1e-4) for row in rewards], dtype=torch.float64)
    torch.testing.assert_close(ours, expected, rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------- no TRL counterpart


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean"])
@pytest.mark.parametrize("beta", [0.0, 0.05])
def test_truncated_is_against_direct_computation(agg, beta):
    """Our w = min(exp(logp_old - logp_behaviour), C), no gradient, vs DESIGN 7 written out here.

    Float64 elementwise loops (math.exp, explicit min/clip) share no code with learner/loss.py.
    """
    g = torch.Generator().manual_seed(11)
    b, t = 5, 7
    eps, cap = 0.2, 2.0
    logp = (-2.0 * torch.rand(b, t, generator=g, dtype=torch.float64)).requires_grad_(True)
    old = logp.detach() + 0.3 * torch.randn(b, t, generator=g, dtype=torch.float64)
    behaviour = (old - 1.2 * torch.randn(b, t, generator=g, dtype=torch.float64)).requires_grad_(True)
    ref = logp.detach() + 0.4 * torch.randn(b, t, generator=g, dtype=torch.float64)
    adv = torch.tensor([1.3, -0.7, 0.0, -1.5, 0.4], dtype=torch.float64)
    lens = [7, 3, 5, 1, 6]
    mask = torch.zeros(b, t, dtype=torch.float64)
    for i, n in enumerate(lens):
        mask[i, t - n:] = 1.0

    cfg = LossConfig(epsilon=eps, is_cap=cap, beta=beta, agg=agg)
    loss, stats = grpo_loss(logp, old, behaviour, adv, mask, cfg, ref if beta > 0 else None)
    loss.backward()

    # Direct computation: value and d(loss)/d(logp) per token, by hand.
    lp, o, bh, rf = (x.detach().tolist() for x in (logp, old, behaviour, ref))
    terms, grads, ws = [[0.0] * t for _ in range(b)], [[0.0] * t for _ in range(b)], []
    capped = 0
    for i in range(b):
        for j in range(t):
            if mask[i, j] == 0:
                continue
            r = math.exp(lp[i][j] - o[i][j])
            w = min(math.exp(o[i][j] - bh[i][j]), cap)
            capped += w == cap
            ws.append(w)
            a = float(adv[i])
            unclipped, clipped = r * a, min(max(r, 1 - eps), 1 + eps) * a
            surr = min(unclipped, clipped)
            # the min picks r*A (or the clip is inactive): d/dlogp = r*A; else the flat clip: 0
            dsurr = r * a if (1 - eps <= r <= 1 + eps or unclipped < clipped) else 0.0
            delta = rf[i][j] - lp[i][j]
            kl = math.exp(delta) - delta - 1
            dkl = -math.exp(delta) + 1  # d kl / d logp
            terms[i][j] = w * surr - beta * kl
            grads[i][j] = w * dsurr - beta * dkl
    if agg == "token-mean":
        n = float(mask.sum())
        expected = -sum(map(sum, terms)) / n
        expected_grad = [[-g_ / n for g_ in row] for row in grads]
    else:
        expected = -sum(sum(terms[i]) / lens[i] for i in range(b)) / b
        expected_grad = [[-g_ / lens[i] / b for g_ in grads[i]] for i in range(b)]

    assert capped > 0 and min(ws) < 1.0  # the cap binds, and some weights down-weight
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    torch.testing.assert_close(logp.grad, torch.tensor(expected_grad, dtype=torch.float64),
                               rtol=1e-10, atol=1e-14)
    assert stats["is_weight_mean"] == pytest.approx(sum(ws) / len(ws), rel=1e-12)
    # w carries no gradient: the behaviour log-probs get none.
    assert behaviour.grad is None or float(behaviour.grad.abs().max()) == 0.0
