"""echo_rl.learner.run_audit: every acknowledged record is trained, dropped by a named rule, or buffered;
whatever is none of these is counted as unaccounted, never hidden."""

from __future__ import annotations

import json

from echo_rl.learner.run_audit import audit_run


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _run(tmp_path, acked):
    run = tmp_path / "run"
    run.mkdir()
    _write(run / "consumed.jsonl", [{"step": 0, "groups": ["g1"]}])
    _write(
        run / "dropped.jsonl",
        [
            {"step": 1, "rule": "stale", "pairs": [["g2", 0], ["g2", 1]]},
            {"step": 1, "rule": "quarantined", "pairs": [["g3", 0]]},
            {"step": 0, "pairs": [["g4", 1]]},
        ],
    )  # a line from before rules
    ledger = tmp_path / "w.ledger"
    _write(ledger, [{"batch_id": "b0", "stored": acked}])
    return audit_run(run, [ledger], group_size=2)


def test_every_acknowledged_record_lands_in_exactly_one_place(tmp_path):
    acked = [["g1", 0], ["g1", 1], ["g2", 0], ["g2", 1], ["g3", 0], ["g4", 1]]
    books = _run(tmp_path, acked).accounting()
    assert books == {
        "acked": 6,
        "trained": 2,
        "dropped_quarantined": 1,
        "dropped_stale": 3,
        "buffered": 0,
        "unaccounted": 0,
    }


def test_a_record_acknowledged_and_then_nowhere_is_unaccounted(tmp_path):
    aud = _run(tmp_path, [["g1", 0], ["g9", 0], ["g9", 1]])
    books = aud.accounting()
    assert books["unaccounted"] == 2 and books["acked"] == 3 and books["trained"] == 1
    assert aud.lost == {("g9", 0), ("g9", 1)}
