"""Every delivery screened at no extra forward (echo_rl/control/screen.py, docs/security.md "Screened
before training"; issue 52, item 3): a row whose claimed log-probs are far from the step-start
ones is left out of the step before any update, its sender's records of the group go to the
auditor at once, and honest rows pass."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch

from echo_rl.control.screen import audit_screened, screen_rows
from echo_rl.core.config import LearnerConfig
from echo_rl.data.records import Record
from tests.test_micro_batch import batch

pytestmark = pytest.mark.timeout(120)


def test_rows_far_from_the_policy_either_way_are_flagged_and_close_ones_pass():
    old = torch.full((4, 6), -2.0)
    claimed = old.clone()
    claimed[0] += 0.5  # staleness and rounding: a small gap
    claimed[1] = -20.0  # forged low: the importance weight would blow up
    claimed[2] = -0.01  # forged high on every token
    claimed[3, :3] = float("nan")  # not a number on a trained token
    mask = torch.ones(4, 6)
    assert screen_rows(torch.tensor([7, 8, 9, 10]), old, claimed, mask, 4.0) == [8, 10]
    mask[3, :3] = 0  # the NaN sits where nothing trains: no gap there
    assert screen_rows(torch.tensor([7, 8, 9, 10]), old, claimed, mask, 1.5) == [8, 9]


@pytest.fixture(scope="module")
def model(tokenizer):
    from echo_rl.core.config import ModelConfig
    from echo_rl.core.models import load_model

    torch.manual_seed(0)
    return load_model(ModelConfig(), tokenizer, "float32")


def test_a_forged_row_is_left_out_before_any_update(model):
    from echo_rl.learner.trainer import Trainer

    b = batch()
    forged = dataclasses.replace(b, behaviour_logprobs=b.behaviour_logprobs.clone())
    forged.behaviour_logprobs[[4, 7]] = -20.0
    cfg = LearnerConfig(lr=1e-2, updates_per_step=2)
    # one forged row in each mini-batch: the first one's logp_old comes from its training
    # forward, which the screen sees before the loss; the second's from a no-grad pass
    order = torch.randperm(10, generator=torch.Generator().manual_seed(3)).chunk(2)
    assert [int(4 in mb) + int(7 in mb) for mb in order] == [1, 1]
    screened = copy.deepcopy(model)
    trainer = Trainer(screened, cfg, seed=3, screen_nats=4.0)
    trainer.step(forged)
    assert sorted(trainer.screened_rows) == [4, 7]  # the honest rows (gap < 2 nats here) pass
    # the same step, screen off, with rows 4 and 7 masked by hand: the very same update
    masked = dataclasses.replace(forged, loss_mask=forged.loss_mask.clone())
    masked.loss_mask[[4, 7]] = 0
    by_hand = copy.deepcopy(model)
    Trainer(by_hand, cfg, seed=3).step(masked)
    a, h = dict(screened.named_parameters()), dict(by_hand.named_parameters())
    assert max(float((a[n] - h[n]).abs().max()) for n in a) < 1e-6
    unscreened = copy.deepcopy(model)  # and without the screen the forged row trains
    Trainer(unscreened, cfg, seed=3).step(forged)
    u = dict(unscreened.named_parameters())
    assert max(float((a[n] - u[n]).abs().max()) for n in a) > 1e-4


def rec(group: str, i: int, worker: str, version: int = 3) -> Record:
    return Record(group, i, [1, 2], [3, 4], [-0.5, -0.5], 1.0, version, worker)


def test_the_screened_senders_records_go_to_the_auditor_at_once(tmp_path):
    groups = [[rec("g0", 0, "w1"), rec("g0", 1, "w1")], [rec("g1", 0, "w2"), rec("g1", 1, "w9")]]
    jobs, trail = [], []
    keys = {"w1": "K1", "w9": "K9"}
    asked = audit_screened(
        groups, [1, 0, 3], keys.get, jobs.append, lambda name, e: trail.append((name, e))
    )
    assert asked == 2  # g0 from w1 (rows 0 and 1), g1's record from w9; w2 was not flagged
    assert [(j.worker_id, j.key, j.group_id, j.probation) for j in jobs] == [
        ("w1", "K1", "g0", True),
        ("w9", "K9", "g1", True),
    ]
    assert [r.sample_idx for r in jobs[0].records] == [0, 1] and len(jobs[1].records) == 1
    assert trail == [("screened", {"groups": ["g0", "g1"], "workers": ["w1", "w9"], "rows": 3})]
    json.dumps(trail)  # the trail is JSON as written
    jobs.clear()
    gone = audit_screened(groups, [2], keys.get, jobs.append, lambda *_: None)
    assert gone == 0 and jobs == []  # w2 left the fleet: left out of the step, not audited
