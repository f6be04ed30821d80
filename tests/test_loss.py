import math

import pytest
import torch

from echo_rl.data.advantages import group_advantages
from echo_rl.learner.loss import LossConfig, grpo_loss

CFG = LossConfig(epsilon=0.2, is_cap=2.0)


def t(*xs):
    return torch.tensor([list(xs)], dtype=torch.float64)


def case(adv):
    logp = torch.log(t(0.5, 0.25)).requires_grad_(True)
    old = torch.log(t(0.4, 0.25))
    beh = torch.log(t(0.4, 0.05))
    return (
        logp,
        old,
        beh,
        torch.tensor([adv], dtype=torch.float64),
        torch.ones(1, 2, dtype=torch.float64),
    )


def test_hand_computed_positive_advantage():
    # token 1: r = 0.5/0.4 = 1.25 clipped to 1.2, w = 1; token 2: r = 1, w = min(0.25/0.05, 2) = 2
    logp, old, beh, adv, mask = case(1.0)
    loss, stats = grpo_loss(logp, old, beh, adv, mask, CFG)
    assert loss.item() == pytest.approx(-(1.2 + 2.0) / 2)
    loss.backward()
    # clipped token carries no gradient; the other: d(-w*r*A/2)/dlogp = -w*r*A/2 = -1
    assert logp.grad[0].tolist() == pytest.approx([0.0, -1.0])
    assert stats["clip_frac"] == pytest.approx(0.5)
    assert stats["is_weight_mean"] == pytest.approx(1.5)


def test_hand_computed_negative_advantage_is_not_clipped():
    logp, old, beh, adv, mask = case(-1.0)
    loss, _ = grpo_loss(logp, old, beh, adv, mask, CFG)
    # min(-1.25, -1.2) = -1.25 (pessimistic side), token 2: 2 * -1
    assert loss.item() == pytest.approx((1.25 + 2.0) / 2)
    loss.backward()
    assert logp.grad[0].tolist() == pytest.approx([1.25 / 2, 1.0])


def test_kl_term_and_mask():
    logp, old, beh, adv, _ = case(0.0)
    ref = logp.detach() + math.log(2.0)
    mask = torch.tensor([[1.0, 0.0]], dtype=torch.float64)
    cfg = LossConfig(epsilon=0.2, is_cap=2.0, beta=0.1)
    loss, stats = grpo_loss(logp, old, beh, adv, mask, cfg, ref_logp=ref)
    kl = 2.0 - math.log(2.0) - 1.0
    assert loss.item() == pytest.approx(0.1 * kl)
    assert stats["kl_mean"] == pytest.approx(kl)
    with pytest.raises(ValueError, match="reference"):
        grpo_loss(logp, old, beh, adv, mask, cfg)


def test_token_mean_vs_seq_mean():
    # two sequences, 1 and 3 valid tokens, on-policy (r = w = 1): per-token term = A
    logp = torch.zeros(2, 3, dtype=torch.float64)
    adv = torch.tensor([1.0, 3.0], dtype=torch.float64)
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]], dtype=torch.float64)
    tok, _ = grpo_loss(logp, logp, logp, adv, mask, CFG)
    seq, _ = grpo_loss(logp, logp, logp, adv, mask, LossConfig(agg="seq-mean"))
    assert tok.item() == pytest.approx(-(1 + 3 * 3) / 4)
    assert seq.item() == pytest.approx(-(1 + 3) / 2)


def test_group_advantages_sample_std():
    a = group_advantages([1.0, 0.0, 0.0, 1.0], eps=0.0)
    std = math.sqrt(((0.5**2) * 4) / 3)
    assert a == pytest.approx([0.5 / std, -0.5 / std, -0.5 / std, 0.5 / std])
    assert group_advantages([0.3, 0.3]) == [0.0, 0.0]  # identical samples: no signal


# ----------------------------------------------------------------------------- temperature


@pytest.mark.timeout(120)
def test_on_policy_importance_weights_are_one_at_temperature(tokenizer):
    """Workers sample at worker.temperature = 0.7; the learner's step-start log-probs of those
    samples, with the same weights, must be the sampler's: w = exp(old - behaviour) = 1. With the
    logits not divided by the temperature, w is far from 1 (checked below)."""
    from echo_rl.core import wire
    from echo_rl.core.config import EchoConfig
    from echo_rl.data.adapter import materialise_records
    from echo_rl.data.records import Record
    from echo_rl.learner.policy import Policy
    from echo_rl.learner.trainer import token_logprobs
    from echo_rl.worker.backends import make_backend

    cfg = EchoConfig.model_validate({"worker": {"temperature": 0.7, "max_new_tokens": 8}})
    backend = make_backend("transformers", model_cfg=cfg.model, threads=1)
    with torch.no_grad():  # spread the random-init logits, or every temperature looks alike
        for p in backend.model.parameters():
            p.mul_(3.0)
    groups = [
        wire.Group(group_id=f"g{k}", prompt_ids=[4 + k, 14, 5, 17], n=4, seed=3) for k in range(3)
    ]
    out = backend.generate(groups, cfg.worker.max_new_tokens, cfg.worker.temperature)
    recs = [
        [
            Record(
                group_id=g.group_id,
                sample_idx=i,
                prompt_ids=g.prompt_ids,
                completion_ids=s.completion_ids,
                logprobs=s.logprobs,
                reward=0.0,
                version=0,
                worker_id="w",
            )
            for i, s in enumerate(samples)
        ]
        for g, samples in zip(groups, out)
    ]
    batch = materialise_records(recs, [0.0] * 12, tokenizer.pad_token_id)

    policy = Policy(cfg)
    policy.model.load_state_dict(backend.model.state_dict())
    rows = torch.arange(12)
    with torch.no_grad():
        old = policy.trainer.logprobs(policy.model, batch, rows)
        raw = token_logprobs(policy.model, batch.input_ids, batch.attention_mask, batch.loss_mask)
    m = batch.loss_mask > 0
    assert int(m.sum()) > 30
    w = torch.exp(old - batch.behaviour_logprobs)[m]
    assert float((w - 1).abs().max()) < 1e-4
    w_raw = torch.exp(raw - batch.behaviour_logprobs)[m]  # logits at temperature 1
    assert float((w_raw - 1).abs().max()) > 0.1


def test_temperature_in_low_precision_rows_matches_float32():
    """bf16 logits go row by row in float32; the temperature is applied to that float32 row."""
    from echo_rl.learner.trainer import selective_logprobs

    g = torch.Generator().manual_seed(0)
    logits = (4 * torch.randn(3, 5, 40, generator=g)).bfloat16()
    targets = torch.randint(0, 40, (3, 5), generator=g)
    expected = (
        torch.log_softmax(logits.double() / 0.7, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    )
    got = selective_logprobs(logits, targets, temperature=0.7)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        selective_logprobs(logits.float(), targets, 0.7).double(), expected, rtol=1e-5, atol=1e-5
    )


# ----------------------------------------------------------------------------- GRPO options, by hand


def test_epsilon_high_widens_only_the_upper_clip():
    # r = 1.25 on one token: clipped at 1.2 symmetric, not clipped with epsilon_high = 0.28
    logp = torch.log(t(0.5)).requires_grad_(True)
    old = torch.log(t(0.4))
    args = (
        old,
        old,
        torch.tensor([1.0], dtype=torch.float64),
        torch.ones(1, 1, dtype=torch.float64),
    )
    sym, _ = grpo_loss(logp, *args, LossConfig(epsilon=0.2))
    asym, stats = grpo_loss(logp, *args, LossConfig(epsilon=0.2, epsilon_high=0.28))
    assert sym.item() == pytest.approx(-1.2) and asym.item() == pytest.approx(-1.25)
    assert stats["clip_frac"] == 0.0
    # the lower side is unchanged: r = 0.75 with A < 0 is clipped at 0.8 either way
    low = torch.log(t(0.3))
    neg = (
        old,
        old,
        torch.tensor([-1.0], dtype=torch.float64),
        torch.ones(1, 1, dtype=torch.float64),
    )
    assert grpo_loss(low, *neg, LossConfig(epsilon_high=0.28))[0].item() == pytest.approx(0.8)


def test_is_modes_by_hand():
    # one sequence, two tokens with behaviour ratios exp(old - behaviour) = 3 and 0.5
    old = torch.log(t(0.3, 0.1))
    beh = torch.log(t(0.1, 0.2))
    adv, mask = torch.tensor([1.0], dtype=torch.float64), torch.ones(1, 2, dtype=torch.float64)
    expect = {
        "token_truncate": (2.0 + 0.5) / 2,
        "token_mask": (0.0 + 0.5) / 2,
        "sequence_truncate": 1.5,
        "sequence_mask": 1.5,  # sequence: w = 3 * 0.5 = 1.5 < cap
        "none": 1.0,
    }  # no correction: w = 1 whatever the behaviour policy was
    for mode, value in expect.items():
        loss, _ = grpo_loss(old, old, beh, adv, mask, LossConfig(is_mode=mode, is_cap=2.0))
        assert -loss.item() == pytest.approx(value), mode
    loss, stats = grpo_loss(
        old, old, beh, adv, mask, LossConfig(is_mode="sequence_mask", is_cap=1.4)
    )
    assert loss.item() == 0.0 and stats["is_zeroed_frac"] == 1.0


def test_sequence_level_ratio_is_the_geometric_mean():
    # GSPO: token log-ratios 0.3 and -0.1 (third token masked) -> one ratio exp(0.1) per sequence
    old = torch.zeros(1, 3, dtype=torch.float64)
    logp = torch.tensor([[0.3, -0.1, 5.0]], dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0]], dtype=torch.float64)
    loss, _ = grpo_loss(
        logp, old, old, torch.tensor([1.0], dtype=torch.float64), mask, LossConfig(level="sequence")
    )
    assert loss.item() == pytest.approx(-math.exp(0.1))
    loss.backward()  # d/dlogp_j of -exp(mean) = -exp(0.1) / 2 on both trained tokens, 0 masked
    assert logp.grad[0].tolist() == pytest.approx([-math.exp(0.1) / 2] * 2 + [0.0])


def test_dr_grpo_divides_by_a_constant():
    # sequences of 1 and 3 tokens, on-policy: per-token term = A; sums 1 and 9 over 2 * max_len
    logp = torch.zeros(2, 3, dtype=torch.float64)
    adv = torch.tensor([1.0, 3.0], dtype=torch.float64)
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]], dtype=torch.float64)
    loss, _ = grpo_loss(
        logp, logp, logp, adv, mask, LossConfig(agg="seq-mean-token-sum-norm", max_len=5)
    )
    assert loss.item() == pytest.approx(-(1 + 9) / (2 * 5))
    with pytest.raises(ValueError, match="max_len"):
        LossConfig(agg="seq-mean-token-sum-norm")


def test_bias_corrected_kl_is_weighted_by_the_ratio():
    logp = torch.log(t(0.5)).requires_grad_(True)
    old, ref = torch.log(t(0.4)), torch.log(t(0.25))
    zero, one = torch.tensor([0.0], dtype=torch.float64), torch.ones(1, 1, dtype=torch.float64)
    kl = 0.5 - math.log(0.5) - 1
    loss, stats = grpo_loss(
        logp, old, old, zero, one, LossConfig(beta=0.1, kl_bias_correction=True), ref
    )
    assert loss.item() == pytest.approx(0.1 * 1.25 * kl)
    assert stats["kl_mean"] == pytest.approx(1.25 * kl)


def test_loss_config_rejects_unknown_choices():
    for bad in ({"agg": "sum"}, {"is_mode": "token"}, {"level": "group"}):
        with pytest.raises(ValueError, match="unknown"):
            LossConfig(**bad)


# ----------------------------------------------------------------------------- advantages


def test_batch_and_unscaled_advantages():
    from echo_rl.data.advantages import batch_advantages

    groups = [[1.0, 0.0], [0.3, 0.3], [2.0, -1.0]]
    flat = [r for g in groups for r in g]
    mean = sum(flat) / 6
    std = math.sqrt(sum((r - mean) ** 2 for r in flat) / 5)
    centred = [0.5, -0.5, 0.0, 0.0, 1.5, -1.5]
    assert batch_advantages(groups, 1e-4, "none") == pytest.approx(centred)
    assert batch_advantages(groups, 1e-4, "batch") == pytest.approx(
        [c / (std + 1e-4) for c in centred]
    )
    assert batch_advantages(groups, 1e-4, "group") == pytest.approx(
        [a for g in groups for a in group_advantages(g, 1e-4)]
    )
    with pytest.raises(ValueError, match="scaling"):
        batch_advantages(groups, 1e-4, "global")


def test_materialise_passes_scale_rewards(tokenizer):
    from echo_rl.data.adapter import load_adapter
    from echo_rl.data.records import Record

    ad = load_adapter("toy-add", {}, tokenizer, check_prompts=False)
    groups = [
        [
            Record(
                group_id=f"g{k}",
                sample_idx=i,
                prompt_ids=[5, 6],
                completion_ids=[7],
                logprobs=[-1.0],
                reward=r,
                version=0,
                worker_id="w",
            )
            for i, r in enumerate(g)
        ]
        for k, g in enumerate([[1.0, 0.0], [4.0, 0.0]])
    ]
    assert ad.materialise(groups, scale_rewards="none").advantages.tolist() == pytest.approx(
        [0.5, -0.5, 2, -2]
    )


# ----------------------------------------------------------------------------- truncated completions


def test_mask_truncated_completions(tokenizer):
    from echo_rl.core.config import LearnerConfig
    from echo_rl.data.adapter import LearnerBatch
    from echo_rl.learner.trainer import Sampling, Trainer, truncated_rows

    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    ids = torch.tensor(
        [[5, 6, 7, 8, eos], [5, 6, 7, 8, 9], [5, 6, eos, pad, pad], [5, 6, 7, pad, pad]]
    )
    mask = torch.tensor(
        [[0, 1, 1, 1], [0, 1, 1, 1], [0, 1, 0, 0], [0, 0, 0, 0]], dtype=torch.float32
    )
    assert truncated_rows(ids, mask, eos).tolist() == [
        False,
        True,
        False,
        False,
    ]  # row 3: nothing trained
    batch = LearnerBatch(
        input_ids=ids,
        attention_mask=(ids != pad).long(),
        loss_mask=mask,
        behaviour_logprobs=torch.zeros(4, 4),
        advantages=torch.zeros(4),
        rewards=torch.zeros(4),
        versions=torch.zeros(4, dtype=torch.long),
    )
    model = torch.nn.Linear(1, 1)  # prepare never runs the model
    eos_known = Sampling(eos_token_id=eos)
    on = Trainer(model, LearnerConfig(mask_truncated_completions=True), sampling=eos_known)
    out, extra = on.prepare(batch)
    assert out.loss_mask.sum(1).tolist() == [3, 0, 1, 0] and extra == {"truncated_frac": 0.25}
    assert batch.loss_mask.sum() == 7  # the caller's batch is left alone
    off, _ = Trainer(model, LearnerConfig(), sampling=eos_known).prepare(batch)
    assert off is batch
    with pytest.raises(ValueError, match="eos_token_id"):
        Trainer(model, LearnerConfig(mask_truncated_completions=True))


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    "override,words",
    [
        ("learner.epsilon_high=0.1", ["learner.epsilon_high", "epsilon_high >= learner.epsilon"]),
        ('learner.is_mode="token_mask"', ["learner", "is_cap > 1"]),  # with the cap at 1 below
        ('learner.is_mode="token"', ["learner.is_mode", "token_truncate"]),
        ('learner.scale_rewards="std"', ["learner.scale_rewards", "'batch'"]),
        ('learner.loss_agg="dr_grpo"', ["learner.loss_agg", "seq-mean-token-sum-norm"]),
        (
            'learner.importance_sampling_level="seq"',
            ["learner.importance_sampling_level", "'sequence'"],
        ),
    ],
)
def test_config_errors_name_the_key_and_the_fix(override, words):
    from echo_rl.core.config import ConfigError, load_config

    extra = ["learner.is_cap=1.0"] if "token_mask" in override else []
    with pytest.raises(ConfigError) as err:
        load_config(None, [override, *extra])
    for w in words:
        assert w in str(err.value)
