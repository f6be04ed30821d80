"""The declared step row and run summary (echo_rl/core/steprow.py): the JSON the learner writes
keeps its keys and their order, and rows from other versions read back without loss."""

from __future__ import annotations

import json

from echo_rl.core.steprow import COL, PUBLISH_FIELDS, TRAINER_FIELDS, RunSummary, StepRow


def test_a_row_writes_its_fields_in_declared_order_and_leaves_out_what_was_not_reported():
    row = StepRow(step=3, version=3, bubble_ratio=0.25)
    row.set_reported(TRAINER_FIELDS, {"loss": 0.5, "entropy_est": 1.0})
    row.set_reported(PUBLISH_FIELDS, {})  # no publication yet
    doc = row.to_json()
    assert list(doc)[:3] == ["step", "version", "reward_mean"]
    assert doc["loss"] == 0.5 and doc["bubble_ratio"] == 0.25 and doc["completions_cut"] is None
    assert "truncated_frac" not in doc and "publish_bytes" not in doc  # absent, as before
    assert list(doc).index("entropy_est") < list(doc).index("loss") < list(doc).index("wall_s")


def test_rows_of_other_versions_round_trip_byte_for_byte():
    """An older row lacks fields (read as None, written back absent); a newer one has fields
    this version does not know (kept in ``extra``, written back)."""
    older = {"step": 0, "version": 0, "reward_mean": 0.1, "bubble_ratio": 0.0}
    newer = {
        "step": 0,
        "version": 0,
        "reward_mean": 0.1,
        "t_wait": 1.5,
        "bubble_ratio": 0.0,
        "a_future_field": {"x": 1},
    }
    for doc in (older, newer):
        row = StepRow.from_json(doc)
        assert json.dumps(row.to_json()) == json.dumps(doc)
    row = StepRow.from_json(newer)
    assert row.t_wait == 1.5 and row.loss is None and row.extra == {"a_future_field": {"x": 1}}


def test_column_constants_are_the_field_names():
    assert COL.bubble_ratio == "bubble_ratio" and COL.t_wait == "t_wait"
    assert set(vars(COL)) == set(StepRow.fields())
    assert set(TRAINER_FIELDS) | set(PUBLISH_FIELDS) <= set(StepRow.fields())


def test_a_summary_reads_back_tolerantly():
    s = RunSummary.from_json({"steps": 2, "ended": "complete", "last": {"step": 1, "t_wait": 0.2}})
    assert s.steps == 2 and s.bubble_ratio is None
    assert s.last_row is not None and s.last_row.t_wait == 0.2


def test_control_stats_from_a_mapping_keep_defaults_and_ignore_unknown_keys():
    from echo_rl.core.control_stats import STAT, ControlStats, as_stats

    s = ControlStats.from_json({"active_workers": 3, "t_bcast": 0.5, "not_a_stat": 1})
    assert s.active_workers == 3 and s.t_bcast == 0.5 and s.rejected == {} and s.decode_s is None
    assert as_stats(None) == ControlStats() and as_stats(s) is s
    assert STAT.active_workers == "active_workers"
