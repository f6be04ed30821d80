"""The seed benchmark's figures (benchmarks/quickstart_seeds.py) and the entropy metric it reads
(``entropy_est`` in metrics.jsonl, echo_rl/learner/trainer.py). No runs: metrics rows and tensors given."""

from __future__ import annotations

import math

import pytest
import torch

from echo_rl.learner.trainer import sampled_entropy


def test_sampled_entropy_is_the_mean_surprisal_of_trained_tokens():
    logp = torch.tensor([[math.log(0.5), math.log(0.25), -7.0], [math.log(0.5), 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])  # -7 is a prompt/padding position
    assert sampled_entropy(logp, mask) == pytest.approx((math.log(2) * 2 + math.log(4)) / 3)
    assert sampled_entropy(logp, torch.zeros_like(mask)) == 0.0  # nothing trained: no NaN
    # its expectation is the entropy: uniform over 8 tokens, sampled, gives log 8
    g = torch.Generator().manual_seed(0)
    draws = torch.randint(0, 8, (1, 4000), generator=g)
    uniform = torch.full((1, 4000), math.log(1 / 8)).where(draws >= 0, 0.0)
    assert sampled_entropy(uniform, torch.ones(1, 4000)) == pytest.approx(math.log(8))


def test_summary_of_a_run():
    from benchmarks import quickstart_seeds as qs

    rows = [
        {
            "step": i,
            "reward_mean": i / 99,
            "entropy_est": 3.0 - i / 50,
            "clip_frac": 0.01,
            "grad_norm": 1.0,
            "staleness_mean": 1.25,
            "wall_s": 0.5 * (i + 1),
        }
        for i in range(100)
    ]
    s = qs.summarise(rows)
    assert s["steps"] == 100
    assert s["reward_first10"] == pytest.approx(sum(range(10)) / 10 / 99, abs=1e-4)
    assert s["reward_last10"] == pytest.approx(sum(range(90, 100)) / 10 / 99, abs=1e-4)
    assert len(s["reward_every50"]) == 2 and s["entropy_last10"] == pytest.approx(3.0 - 94.5 / 50)
    assert s["wall_s"] == 50.0
    assert qs.summarise([])["reward_last10"] is None  # a run that never stepped
    run = {"seed": 3, **s, "loadavg_before": [2.5, 2.0, 1.0]}
    line = qs.table([run]).splitlines()[1].split()
    assert line[0] == "3" and float(line[2]) == pytest.approx(s["reward_last10"], abs=1e-3)
    assert qs.table([{**run, "entropy_first10": None}]).splitlines()[1].split()[3] == "-"
