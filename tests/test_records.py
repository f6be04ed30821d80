import math

import pytest

from echo_rl.data.records import Limits, RecordError, parse_record

LIM = Limits(vocab_size=24, max_new_tokens=4, group_size=4)


def good(**kw):
    rec = {
        "group_id": "g",
        "sample_idx": 0,
        "prompt_ids": [4, 14, 5, 17],
        "completion_ids": [11, 1],
        "logprobs": [-0.5, -1.0],
        "reward": 1.0,
        "version": 0,
        "worker_id": "w",
        "gen_s": 0.1,
    }
    rec.update(kw)
    return rec


def test_good_record_parses():
    r = parse_record(good(), LIM)
    assert r.completion_ids == [11, 1] and r.reward == 1.0


@pytest.mark.parametrize(
    "patch,reason",
    [
        ({"completion_ids": [11, 99], "logprobs": [-1.0, -1.0]}, "out_of_vocab"),
        ({"prompt_ids": [-1]}, "out_of_vocab"),
        ({"reward": math.nan}, "non_finite_reward"),
        ({"reward": math.inf}, "non_finite_reward"),
        ({"logprobs": [-0.5]}, "bad_length"),
        ({"completion_ids": [], "logprobs": []}, "bad_length"),
        ({"completion_ids": [5] * 5, "logprobs": [-1.0] * 5}, "bad_length"),
        ({"logprobs": [-0.5, 3.0]}, "bad_logprob"),
        ({"logprobs": [-0.5, math.nan]}, "non_finite_logprob"),
        ({"logprobs": [-0.5, -math.inf]}, "non_finite_logprob"),
        ({"logprobs": [-0.5, -1e39]}, "logprob_below_floor"),
        # a masked token is checked too: -1e39 is -inf in float32, and -inf * 0 is NaN
        ({"logprobs": [-0.5, -1e39], "loss_mask": [1, 0]}, "logprob_below_floor"),
        ({"logprobs": [-0.5, True]}, "invalid_fields"),
        ({"reward": 1e200}, "reward_out_of_range"),
        ({"reward": -1e308}, "reward_out_of_range"),
        ({"reward": 10**400}, "reward_out_of_range"),  # in-process only: msgpack ints are 64-bit
        ({"gen_s": math.inf}, "bad_gen_s"),
        ({"gen_s": -1.0}, "bad_gen_s"),
        ({"sample_idx": 4}, "bad_sample_idx"),
        ({"version": "1"}, "invalid_fields"),
        ({"sample_idx": True}, "invalid_fields"),
        ({"surprise": 1}, "invalid_fields"),
    ],
)
def test_bad_records_rejected_with_reason(patch, reason):
    with pytest.raises(RecordError) as e:
        parse_record(good(**patch), LIM)
    assert e.value.reason == reason


def test_bounds_follow_the_limits():
    """The reward bound and the log-prob floor come from the config (Limits); a value on the
    bound is admitted, just past it is not, and a log-prob a rounding error above 0 passes."""
    lim = Limits(24, 4, 4, max_abs_reward=10.0, min_logprob=-50.0)
    assert parse_record(good(reward=-10.0, logprobs=[-50.0, 5e-5]), lim).reward == -10.0
    for patch, reason in [
        ({"reward": 10.5}, "reward_out_of_range"),
        ({"logprobs": [-50.5, -1.0]}, "logprob_below_floor"),
    ]:
        with pytest.raises(RecordError) as e:
            parse_record(good(**patch), lim)
        assert e.value.reason == reason
    with pytest.raises(RecordError, match="learner.max_abs_reward"):  # the error names the fix
        parse_record(good(reward=1e200), LIM)


def test_missing_field_and_non_map():
    rec = good()
    del rec["reward"]
    with pytest.raises(RecordError, match="reward"):
        parse_record(rec, LIM)
    with pytest.raises(RecordError):
        parse_record([1, 2], LIM)


def test_cut_completions_are_counted():
    """A completion that stops at max_new_tokens without end-of-sequence was cut short: the
    learner's metrics line counts them (completions_cut) and warns when most are."""
    from echo_rl.data.records import Record
    from echo_rl.learner.rows import cut_share

    eos = 2

    def rec(completion, mask=None):
        return Record(
            "g", 0, [5], completion, [-0.1] * len(completion), 0.0, 0, "w", 0.1, loss_mask=mask
        )

    batch = [rec([7, 7, 7, 7]), rec([7, 2]), rec([7, 7, 7, 2]), rec([7, 7, 7, 7])]
    assert cut_share(batch, 4, eos) == 0.5  # two hit 4 tokens without eos; one ended on eos at 4
    assert cut_share([rec([7, 7], mask=[1, 1])], 4, eos) is None  # episodes not saying cut
    assert cut_share(batch, 8, eos) == 0.0


def test_most_completions_cut_warns_once_per_window_and_reports_the_share(caplog):
    """echo_rl.learner.rows.CutWatch: the share goes into every row; the warning at most once every
    CUT_WARN_EVERY steps, and only past CUT_WARN_SHARE."""
    from echo_rl.data.records import Record
    from echo_rl.learner.rows import CUT_WARN_EVERY, CutWatch

    def rec(completion):
        return Record("g", 0, [5], completion, [-0.1] * len(completion), 0.0, 0, "w", 0.1)

    watch = CutWatch(max_new_tokens=2, eos_token_id=9, adapter="gsm8k")
    cut = [rec([7, 7]), rec([7, 7]), rec([7, 9])]
    with caplog.at_level("WARNING", logger="echo.learner"):
        assert watch.share(0, cut) == round(2 / 3, 4)
        assert watch.share(1, cut) == round(2 / 3, 4)
        assert watch.share(CUT_WARN_EVERY, cut) == round(2 / 3, 4)
        assert watch.share(CUT_WARN_EVERY + 1, [rec([7, 9])]) == 0.0
    warnings = [r for r in caplog.records if "max_new_tokens" in r.getMessage()]
    assert len(warnings) == 2 and "gsm8k" in warnings[0].getMessage()
