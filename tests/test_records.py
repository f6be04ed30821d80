import math

import pytest

from dataplane.records import Limits, RecordError, parse_record

LIM = Limits(vocab_size=24, max_new_tokens=4, group_size=4)


def good(**kw):
    rec = {"group_id": "g", "sample_idx": 0, "prompt_ids": [4, 14, 5, 17], "completion_ids": [11, 1],
           "logprobs": [-0.5, -1.0], "reward": 1.0, "version": 0, "worker_id": "w", "gen_s": 0.1}
    rec.update(kw)
    return rec


def test_good_record_parses():
    r = parse_record(good(), LIM)
    assert r.completion_ids == [11, 1] and r.reward == 1.0


@pytest.mark.parametrize("patch,reason", [
    ({"completion_ids": [11, 99], "logprobs": [-1.0, -1.0]}, "out_of_vocab"),
    ({"prompt_ids": [-1]}, "out_of_vocab"),
    ({"reward": math.nan}, "non_finite_reward"),
    ({"reward": math.inf}, "non_finite_reward"),
    ({"logprobs": [-0.5]}, "bad_length"),
    ({"completion_ids": [], "logprobs": []}, "bad_length"),
    ({"completion_ids": [5] * 5, "logprobs": [-1.0] * 5}, "bad_length"),
    ({"logprobs": [-0.5, 3.0]}, "bad_logprob"),
    ({"logprobs": [-0.5, math.nan]}, "bad_logprob"),
    ({"sample_idx": 4}, "bad_sample_idx"),
    ({"version": "1"}, "invalid_fields"),
    ({"sample_idx": True}, "invalid_fields"),
    ({"surprise": 1}, "invalid_fields"),
])
def test_bad_records_rejected_with_reason(patch, reason):
    with pytest.raises(RecordError) as e:
        parse_record(good(**patch), LIM)
    assert e.value.reason == reason


def test_missing_field_and_non_map():
    rec = good()
    del rec["reward"]
    with pytest.raises(RecordError, match="reward"):
        parse_record(rec, LIM)
    with pytest.raises(RecordError):
        parse_record([1, 2], LIM)
