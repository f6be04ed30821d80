"""The control plane's load test machinery (benchmarks/load_control.py) on a small swarm."""

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def test_synthetic_workers_are_served_and_every_acknowledged_record_is_accounted_for(tmp_path):
    from benchmarks import load_control

    r = load_control.run_once(
        workers=6, per_process=3, seconds=10, group_s=0.5, fsync_delay_ms=50, tmp=tmp_path
    )
    assert r["swarms_reported"] == 2 and r["heartbeats"] > 6 * 5
    assert r["evicted"] == 0
    books = r["accounting"]  # each acknowledged record trained, dropped by a rule, or buffered
    assert r["acked_records"] > 0 and books["acked"] == r["acked_records"]
    assert books["unaccounted"] == 0


def test_the_learner_freezes_its_start_up_objects_out_of_the_collector():
    import gc

    from echo_rl.learner.startup import freeze_startup_objects

    before = gc.get_freeze_count()
    try:
        freeze_startup_objects()
        assert gc.get_freeze_count() > before
    finally:
        gc.unfreeze()  # the rest of the test session collects as usual
