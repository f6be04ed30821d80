"""benchmarks/load_control.py as a test of its books (issue 38): a real learner and a swarm of
synthetic workers on loopback; every record the swarm saw acknowledged is trained, dropped by
a named rule, or still buffered, and the learner's own CPU counters name every message kind
the swarm sent."""

from __future__ import annotations

import pytest

from benchmarks import load_control

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_every_acknowledged_record_is_accounted_for_and_its_cost_measured(tmp_path):
    out = load_control.run_once(16, 16, 10, 0.5, 0.0, tmp_path, ramp_s=1.0)
    books = out["accounting"]
    assert books["acked"] == out["acked_records"] > 0
    assert books["unaccounted"] == 0
    assert books["acked"] == sum(v for k, v in books.items() if k not in ("acked", "unaccounted"))
    cpu = out["cpu"]
    assert {"heartbeat", "work_request", "trajectories", "join"} <= set(cpu["loop_us"])
    assert cpu["heartbeat_us"] > cpu["loop_us"]["heartbeat"] > 0  # plus its share of the I/O
    sat = cpu["saturation"]
    assert sat["period_scaled"] >= sat["period_fixed"] > 0
    assert out["evicted"] == 0


def test_the_load_model_saturates_where_the_fleet_fills_one_core():
    from echo_rl.provisioning.sim.control_load import ControlCosts, load_us, saturation

    costs = ControlCosts(heartbeat_us=200.0, poll_us=100.0, sweep_us_per_worker_s=10.0)
    fixed = saturation(costs, 1.0, 500.0, scaled=False)
    assert fixed == 2439  # 200 + 100 / 0.5 + 10 = 410 µs a worker a second
    assert (
        load_us(fixed, costs, 1.0, 500.0, False)
        <= 1e6
        < load_us(fixed + 1, costs, 1.0, 500.0, False)
    )
    # scaled: at most 500 heartbeats and 500 polls a second (150,000 µs), then 10 µs a worker
    assert abs(saturation(costs, 1.0, 500.0, scaled=True) - 85_000) <= 1  # float rounding
    # admission that fills the core leaves no room for any fleet
    assert (
        saturation(ControlCosts(200.0, 100.0, 10.0, admission_us_per_s=1e6), 1.0, 500.0, True) == 0
    )
