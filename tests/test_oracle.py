"""Oracle parity: our GRPO loss (echo_rl/learner/loss.py, docs/design.md §7) against TRL's GRPOTrainer.

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
                                 DeepSeek-V3.2 unbiased estimator); docs/design.md §7 and Echo's default use the
                                 plain k3 term (``learner.use_bias_correction_kl`` switches).
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

The GRPO options (temperature, epsilon_high, scale_rewards, the four IS modes, GSPO, dr_grpo,
the bias-corrected KL, mask_truncated_completions) are checked further down on a whole step, with
TRL's own ``_generate_and_score_completions`` computing the weights, advantages and masks.
"""

from __future__ import annotations

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

from echo_rl.core.config import ModelConfig  # noqa: E402
from echo_rl.core.models import build_tiny_tokenizer, load_model  # noqa: E402
from echo_rl.learner.loss import LossConfig, grpo_loss  # noqa: E402
from echo_rl.learner.trainer import token_logprobs  # noqa: E402

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
        prompt_ids[i, P - lp :] = torch.randint(first, vocab, (lp,), generator=g)
        prompt_mask[i, P - lp :] = 1
        completion_ids[i, :lc] = torch.randint(first, vocab, (lc,), generator=g)
        completion_mask[i, :lc] = 1
    # Rewards per group of 2 -> group-normalised advantages of both signs (and one zero group).
    from echo_rl.data.advantages import group_advantages

    rewards = [1.0, 0.0, 0.0, 1.0, 0.3, 0.3, 2.0, -1.0]
    adv = []
    for k in range(0, B, 2):
        adv += group_advantages(rewards[k : k + 2])
    advantages = torch.tensor(adv, dtype=torch.float32)

    # Current log-probs of the completions, to build old/ref/behaviour log-probs around them.
    model = fresh_model(model_dir, tok)
    ids = torch.cat([prompt_ids, completion_ids], 1)
    attn = torch.cat([prompt_mask, completion_mask], 1)
    with torch.no_grad():
        cur = token_logprobs(model, ids, attn)[:, P - 1 :]
    cm = completion_mask.float()
    # |noise| ~ 0.3 puts many ratios r = exp(logp - old) outside [0.8, 1.2], on both sides.
    old = cur - 0.35 * torch.randn(cur.shape, generator=g)
    ref = cur + 0.5 * torch.randn(cur.shape, generator=g)
    # behaviour: some tokens far below old so that exp(old - behaviour) exceeds the cap C = 2.
    behaviour = (
        old
        - 0.8 * torch.randn(cur.shape, generator=g).abs()
        + 0.3 * torch.randn(cur.shape, generator=g)
    )
    # Values at masked positions are junk on purpose: both sides must ignore them.
    for x in (old, ref, behaviour):
        x.mul_(cm).add_((1 - cm) * -0.7)
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": advantages,
        "old": old,
        "ref": ref,
        "behaviour": behaviour,
        "cur": cur,
    }


def to_ours(batch, key):
    """A [B, C] completion-aligned tensor placed in the learner's [B, L-1] target layout."""
    x = batch[key]
    out = torch.full((x.shape[0], P + C - 1), -1.3)  # junk on prompt positions, masked out
    out[:, P - 1 :] = x
    return out


def subset(batch, rows):
    return {k: v[rows] for k, v in batch.items()}


def our_loss(model, batch, cfg: LossConfig, use_is: bool, denom=None):
    n = batch["prompt_ids"].shape[0]
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    attn = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    mask = torch.zeros(n, P + C - 1)
    mask[:, P - 1 :] = batch["completion_mask"].float()
    old = to_ours(batch, "old")
    behaviour = to_ours(batch, "behaviour") if use_is else old.clone()  # w = exp(0) = 1
    logp = token_logprobs(model, ids, attn)
    kwargs = {} if denom is None else {"denom": denom}
    return grpo_loss(
        logp,
        old,
        behaviour,
        batch["advantages"],
        mask,
        cfg,
        to_ours(batch, "ref") if cfg.beta > 0 else None,
        **kwargs,
    )


def trl_is_ratio(old, sampling, mask, clip_max, clip_min=None):
    """TRL 1.16 ``_generate_and_score_completions``, mode "token_truncate" (copied formula)."""
    diff = torch.nan_to_num((old - sampling) * mask, nan=0.0)
    return torch.clamp(torch.exp(diff), min=clip_min, max=clip_max)


def make_trl_trainer(
    model, tok, tmp_path, loss_type, beta, epsilon, rewards=None, peft_config=None, **args_overrides
):
    """TRL's GRPOTrainer on ``model``; ``rewards`` (one per completion) is what its reward
    function returns, ``peft_config`` wraps the model in a LoRA adapter (tests/test_oracle_lora.py),
    ``args_overrides`` are further GRPOConfig fields."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(
        **{
            "output_dir": str(tmp_path),
            "report_to": "none",
            "use_cpu": True,
            "bf16": False,
            "fp16": False,
            "activation_checkpointing": False,
            "per_device_train_batch_size": B,
            "num_generations": 2,
            "max_completion_length": C,
            "loss_type": loss_type,
            "beta": beta,
            "epsilon": epsilon,
            "use_bias_correction_kl": False,
            "save_strategy": "no",
            "logging_steps": 1,
            "seed": 0,
            "disable_dropout": True,
            **args_overrides,
        }
    )
    ds = Dataset.from_dict({"prompt": ["1+2="] * B})
    scores = [0.0] * B if rewards is None else list(rewards)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=lambda completions, **kw: scores[: len(completions)],
        args=args,
        train_dataset=ds,
        processing_class=tok,
        peft_config=peft_config,
    )
    trainer.current_gradient_accumulation_steps = 1  # set by the HF training loop otherwise
    return trainer


def trl_loss(trainer, batch, beta, is_cap, num_items=None):
    cm = batch["completion_mask"]
    inputs = {
        "prompt_ids": batch["prompt_ids"],
        "prompt_mask": batch["prompt_mask"],
        "completion_ids": batch["completion_ids"],
        "completion_mask": cm,
        "advantages": batch["advantages"],
        "old_per_token_logps": batch["old"],
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
        inputs["importance_sampling_ratio"] = trl_is_ratio(
            batch["old"], batch["behaviour"], cm.float(), clip_max=is_cap
        )
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
        torch.testing.assert_close(ga, gb, rtol=RTOL, atol=atol, msg=lambda m: f"{name}: {m}")  # noqa: B023


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


@pytest.mark.parametrize(
    "agg,loss_type,beta,use_is,epsilon",
    CASES,
    ids=[f"{a}-{t}-beta{b}-{'is' if i else 'nois'}-eps{e}" for a, t, b, i, e in CASES],
)
def test_loss_and_grads_match_trl(
    model_dir, tok, batch, tmp_path, agg, loss_type, beta, use_is, epsilon
):
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
def test_sharded_denominator_matches_trl_full_batch(
    model_dir, tok, batch, tmp_path, agg, loss_type
):
    """Two ranks' shards with ``denom`` = global count / world, gradients averaged (what DDP does),
    equal TRL's loss on the whole batch; and per shard, token-mean with ``denom`` D equals TRL's
    "dapo" whose normaliser is ``num_items_in_batch`` = D (one process, steps_per_generation 1)."""
    beta, world, is_cap = 0.05, 2, 2.0
    cfg = LossConfig(beta=beta, agg=agg, is_cap=is_cap)
    n_tok = int(batch["completion_mask"].sum())
    global_count = n_tok if agg == "token-mean" else B
    shards = [torch.arange(0, B // 2), torch.arange(B // 2, B)]
    assert (
        int(batch["completion_mask"][shards[0]].sum()) != n_tok // 2
    )  # denom really differs from local

    ours_model = fresh_model(model_dir, tok)
    shard_losses = []
    for rows in shards:
        loss, _ = our_loss(
            ours_model, subset(batch, rows), cfg, use_is=True, denom=global_count / world
        )
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
    """Documents a default difference: TRL's use_bias_correction_kl=True is not Echo's default."""
    cfg = LossConfig(beta=0.05, agg="token-mean")
    ours_model = fresh_model(model_dir, tok)
    loss_a, _ = our_loss(ours_model, batch, cfg, use_is=False)
    trainer = make_trl_trainer(fresh_model(model_dir, tok), tok, tmp_path, "bnpo", 0.05, 0.2)
    trainer.args.use_bias_correction_kl = True
    loss_b = trl_loss(trainer, batch, 0.05, None)
    assert loss_a.item() != pytest.approx(loss_b.item(), rel=1e-4)


def test_advantages_match_trl_formula():
    """echo_rl.data.advantages vs TRL's group scaling: (r - mean) / (nanstd (Bessel) + 1e-4)."""
    from trl.trainer.utils import nanstd

    from echo_rl.data.advantages import group_advantages

    g = torch.Generator().manual_seed(3)
    rewards = torch.rand(6, 5, generator=g, dtype=torch.float64)
    rewards[2] = 0.5  # zero-variance group
    expected = (rewards - rewards.mean(1, keepdim=True)) / (
        nanstd(rewards, dim=1).unsqueeze(1) + 1e-4
    )
    ours = torch.tensor(
        [group_advantages(row.tolist(), 1e-4) for row in rewards], dtype=torch.float64
    )
    torch.testing.assert_close(ours, expected, rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------- a whole step, GRPO options
#
# The cases above hand TRL's loss fixed inputs. Here TRL runs its own
# ``_generate_and_score_completions`` on records we hand it (its ``_generate`` replaced by one that
# returns fixed completions and their sampling log-probs), so TRL itself computes the old
# log-probs at its temperature, the importance-sampling weights of its
# ``vllm_importance_sampling_mode``, the reward scaling, the truncation mask and the reference
# log-probs. Then both models take the same parameter perturbation (the policy moved since the
# step started) and TRL's ``compute_loss`` is compared with Echo's path on the same records:
# ``Adapter.materialise`` (advantages), ``Trainer.prepare`` (truncation mask), ``Trainer.logprobs``
# (old and reference log-probs at the temperature), ``Trainer.minibatch_loss``.
# Prompts all have P tokens, so TRL's left-padded layout and ours (right-padded) coincide.

# Echo learner key -> TRL GRPOConfig field (loss_agg comes from the case's TRL loss_type).
TRL_NAME = {
    "epsilon": "epsilon",
    "epsilon_high": "epsilon_high",
    "beta": "beta",
    "scale_rewards": "scale_rewards",
    "importance_sampling_level": "importance_sampling_level",
    "use_bias_correction_kl": "use_bias_correction_kl",
    "mask_truncated_completions": "mask_truncated_completions",
    "is_mode": "vllm_importance_sampling_mode",
    "is_cap": "vllm_importance_sampling_clip_max",
}
ECHO_AGG = {
    "bnpo": "token-mean",
    "dapo": "token-mean",
    "grpo": "seq-mean",
    "dr_grpo": "seq-mean-token-sum-norm",
}
REWARDS = [1.0, 0.0, 0.0, 1.0, 0.3, 0.3, 2.0, -1.0]  # groups of 2, one tied


@pytest.fixture(scope="module")
def step_records(model_dir, tok):
    """records(temperature): 8 records (4 groups of 2) whose behaviour log-probs sit around the
    model's own at that temperature: far on some rows (the cap binds per token and per sequence),
    close on others. Rows 0 and 5 hit max_new_tokens (= C) without EOS; the rest end in EOS."""
    from echo_rl.data.records import Record

    g = torch.Generator().manual_seed(17)
    lens = [C, 7, C, 1, 4, C, 9, 3]
    ends_eos = [False, True, True, True, True, False, True, True]
    prompts = torch.randint(4, len(tok), (B, P), generator=g)
    comps = []
    for n, eos in zip(lens, ends_eos):
        ids = torch.randint(4, len(tok), (n,), generator=g).tolist()  # ids >= 4: no special token
        comps.append(ids[:-1] + [tok.eos_token_id] if eos else ids)
    scale = [1.0, 0.05, 1.0, -0.1, 0.03, 1.0, 0.2, -0.05]  # behaviour far from / close to the model
    noise = [
        (0.8 * torch.randn(n, generator=g).abs() - 0.3 * torch.randn(n, generator=g)) * a
        for n, a in zip(lens, scale)
    ]
    model, cache = fresh_model(model_dir, tok), {}

    def records(temperature):
        if temperature not in cache:
            recs = []
            for i in range(B):
                ids = torch.tensor([prompts[i].tolist() + comps[i]])
                with torch.no_grad():
                    cur = token_logprobs(model, ids, torch.ones_like(ids), temperature=temperature)[
                        0, P - 1 :
                    ]
                recs.append(
                    Record(
                        group_id=f"g{i // 2}",
                        sample_idx=i % 2,
                        prompt_ids=prompts[i].tolist(),
                        completion_ids=comps[i],
                        logprobs=(cur - noise[i]).tolist(),
                        reward=REWARDS[i],
                        version=0,
                        worker_id="w",
                    )
                )
            cache[temperature] = recs
        return cache[temperature]

    return records


def perturb(model, scale=0.08):
    """The same deterministic parameter change on either side: the update since step start."""
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            p.add_(scale * p.abs().mean() * torch.randn(p.shape, generator=g))


def echo_step_loss(model_dir, tok, recs, options, loss_type, temperature):
    from echo_rl.core.config import LearnerConfig
    from echo_rl.data.adapter import load_adapter
    from echo_rl.learner.trainer import Sampling, Trainer

    lc = LearnerConfig(**options, loss_agg=ECHO_AGG[loss_type])
    trainer = Trainer(
        fresh_model(model_dir, tok),
        lc,
        sampling=Sampling(temperature=temperature, max_new_tokens=C, eos_token_id=tok.eos_token_id),
    )
    adapter = load_adapter("toy-add", {}, tok, check_prompts=False)
    groups = [recs[k : k + 2] for k in range(0, B, 2)]
    batch, extra = trainer.prepare(
        adapter.materialise(groups, lc.adv_eps, scale_rewards=lc.scale_rewards)
    )
    rows = torch.arange(B)
    with torch.no_grad():
        old = trainer.logprobs(trainer.model, batch, rows)
        ref = (
            trainer.logprobs(trainer.ref_model, batch, rows)
            if trainer.ref_model is not None
            else None
        )
    perturb(trainer.model)
    loss, stats = trainer.minibatch_loss(batch, rows, old, ref)
    return trainer.model, loss, {**stats, **extra}


def trl_step_loss(model_dir, tok, tmp_path, recs, options, loss_type, temperature):
    trl_args = {TRL_NAME[k]: v for k, v in options.items()}
    trl_args.setdefault("vllm_importance_sampling_mode", "token_truncate")  # Echo's default
    trl_args.setdefault("vllm_importance_sampling_clip_max", 2.0)
    trainer = make_trl_trainer(
        fresh_model(model_dir, tok),
        tok,
        tmp_path,
        loss_type,
        trl_args.pop("beta", 0.0),
        trl_args.pop("epsilon", 0.2),
        rewards=[r.reward for r in recs],
        temperature=temperature,
        num_iterations=2,  # so that TRL computes old log-probs at all
        **trl_args,
    )
    # TRL applies the sampler correction only behind use_vllm; generation itself is replaced.
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
    perturb(trainer.model)
    return trainer, trainer.compute_loss(trainer.model, inputs), inputs


STEP_CASES = [
    # (id, TRL loss_type, temperature, Echo learner options)
    ("temperature0.7-dapo-kl", "dapo", 0.7, {"beta": 0.05}),
    ("temperature0.7-grpo", "grpo", 0.7, {}),
    ("epsilon_high", "dapo", 1.0, {"epsilon_high": 0.28}),
    ("scale_rewards-batch", "bnpo", 1.0, {"scale_rewards": "batch"}),
    ("scale_rewards-none", "grpo", 1.0, {"scale_rewards": "none"}),
    ("is-token_mask", "bnpo", 1.0, {"is_mode": "token_mask"}),
    ("is-sequence_truncate", "dapo", 1.0, {"is_mode": "sequence_truncate"}),
    ("is-sequence_mask", "grpo", 1.0, {"is_mode": "sequence_mask", "is_cap": 3.0}),
    ("gspo", "grpo", 1.0, {"importance_sampling_level": "sequence"}),
    (
        "gspo-bias_kl",
        "dapo",
        1.0,
        {"importance_sampling_level": "sequence", "beta": 0.05, "use_bias_correction_kl": True},
    ),
    ("dr_grpo", "dr_grpo", 1.0, {}),
    ("bias_corrected_kl", "bnpo", 1.0, {"beta": 0.05, "use_bias_correction_kl": True}),
    ("mask_truncated-bnpo", "bnpo", 1.0, {"mask_truncated_completions": True}),
    ("mask_truncated-grpo", "grpo", 1.0, {"mask_truncated_completions": True}),
    (
        "trl-defaults-with-kl",
        "dapo",
        1.0,
        {"is_mode": "sequence_mask", "is_cap": 3.0, "beta": 0.05, "use_bias_correction_kl": True},
    ),
    (
        "everything",
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
    "loss_type,temperature,options", [c[1:] for c in STEP_CASES], ids=[c[0] for c in STEP_CASES]
)
def test_step_with_grpo_options_matches_trl(
    model_dir, tok, step_records, tmp_path, loss_type, temperature, options
):
    recs = step_records(temperature)
    ours_model, loss_a, stats = echo_step_loss(
        model_dir, tok, recs, options, loss_type, temperature
    )
    loss_a.backward()
    trainer, loss_b, inputs = trl_step_loss(
        model_dir, tok, tmp_path, recs, options, loss_type, temperature
    )
    loss_b.backward()

    assert math.isfinite(loss_a.item())
    assert loss_a.item() == pytest.approx(loss_b.item(), rel=RTOL, abs=1e-7)
    assert_grads_equal(ours_model, trainer.model)

    m = trainer._metrics["train"]
    if options.get("beta"):
        assert stats["kl_mean"] == pytest.approx(m["kl"][-1], rel=1e-5)
    if (
        options.get("importance_sampling_level", "token") == "token"
    ):  # TRL's sequence stats are per sequence
        assert m["clip_ratio/low_mean"][-1] > 0 and m["clip_ratio/high_mean"][-1] > 0
        assert stats["clip_frac"] == pytest.approx(m["clip_ratio/region_mean"][-1], rel=1e-6)
    else:
        assert 0 < m["clip_ratio/region_mean"][-1] < 1
    mode = options.get("is_mode", "token_truncate")
    if mode.startswith("token"):
        assert stats["is_weight_mean"] == pytest.approx(
            m["sampling/importance_sampling_ratio/mean"][-1], rel=1e-5
        )
    # The weights exercise the mode: the cap binds (truncate) / zeroes (mask) some, not all.
    mask = inputs["completion_mask"].bool()
    w = inputs["importance_sampling_ratio"]
    w = w[mask] if mode.startswith("token") else w[mask.any(1)].flatten()
    cap = options.get("is_cap", 2.0)
    hit = (w == 0) if mode.endswith("mask") else (w == cap)
    assert hit.any() and (~hit).any() and (w < 1).any()
    if options.get("mask_truncated_completions"):
        assert stats["truncated_frac"] == pytest.approx(2 / B)
        assert int(inputs["completion_mask"].sum(1).eq(0).sum()) == 2

    # Each option changes the loss: without it (temperature 1, beta kept) ours differs.
    base = {k: v for k, v in options.items() if k == "beta"}
    if base != options or temperature != 1.0:
        _, loss_base, _ = echo_step_loss(model_dir, tok, step_records(1.0), base, loss_type, 1.0)
        assert loss_base.item() != pytest.approx(loss_a.item(), rel=1e-4, abs=1e-6)


# ----------------------------------------------------------------------------- no TRL counterpart


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean"])
@pytest.mark.parametrize("beta", [0.0, 0.05])
def test_truncated_is_against_direct_computation(agg, beta):
    """Our w = min(exp(logp_old - logp_behaviour), C), no gradient, vs docs/design.md §7 written out here.

    Float64 elementwise loops (math.exp, explicit min/clip) share no code with echo_rl/learner/loss.py.
    """
    g = torch.Generator().manual_seed(11)
    b, t = 5, 7
    eps, cap = 0.2, 2.0
    logp = (-2.0 * torch.rand(b, t, generator=g, dtype=torch.float64)).requires_grad_(True)
    old = logp.detach() + 0.3 * torch.randn(b, t, generator=g, dtype=torch.float64)
    behaviour = (old - 1.2 * torch.randn(b, t, generator=g, dtype=torch.float64)).requires_grad_(
        True
    )
    ref = logp.detach() + 0.4 * torch.randn(b, t, generator=g, dtype=torch.float64)
    adv = torch.tensor([1.3, -0.7, 0.0, -1.5, 0.4], dtype=torch.float64)
    lens = [7, 3, 5, 1, 6]
    mask = torch.zeros(b, t, dtype=torch.float64)
    for i, n in enumerate(lens):
        mask[i, t - n :] = 1.0

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
    torch.testing.assert_close(
        logp.grad, torch.tensor(expected_grad, dtype=torch.float64), rtol=1e-10, atol=1e-14
    )
    assert stats["is_weight_mean"] == pytest.approx(sum(ws) / len(ws), rel=1e-12)
    # w carries no gradient: the behaviour log-probs get none.
    assert behaviour.grad is None or float(behaviour.grad.abs().max()) == 0.0


@pytest.mark.parametrize(
    "loss_type,temperature,options",
    [c[1:] for c in STEP_CASES[:1]] + [c[1:] for c in STEP_CASES if c[0] == "everything"],
    ids=["default", "everything"],
)
def test_mixed_version_records_match_trl(
    model_dir, tok, step_records, tmp_path, loss_type, temperature, options
):
    """Records continued after a preemption (docs/preemption.md) carry tokens of two snapshot
    versions, each with its own behaviour log-prob: the step is TRL's, token by token."""
    import dataclasses

    recs = [
        dataclasses.replace(
            r,
            version=0,
            versions=[
                [0, len(r.completion_ids) // 2],
                [1, len(r.completion_ids) - len(r.completion_ids) // 2],
            ],
        )
        if len(r.completion_ids) >= 2
        else r
        for r in step_records(temperature)
    ]
    assert any(r.versions for r in recs)
    ours_model, loss_a, _ = echo_step_loss(model_dir, tok, recs, options, loss_type, temperature)
    loss_a.backward()
    trainer, loss_b, _ = trl_step_loss(
        model_dir, tok, tmp_path, recs, options, loss_type, temperature
    )
    loss_b.backward()
    assert loss_a.item() == pytest.approx(loss_b.item(), rel=RTOL, abs=1e-7)
    assert_grads_equal(ours_model, trainer.model)
