"""The one EWMA (echo_rl/core/ewma.py): same samples in, same values out as each hand-rolled average
it replaced (the old formulas are written out here), to float rounding."""

import math
import random

import pytest

from echo_rl.broadcast.link_meter import LinkMeter
from echo_rl.core.ewma import Ewma, ewma, time_weight
from echo_rl.provisioning.capacity import t_train_average
from echo_rl.provisioning.registry import ACTIVE, WorkerRecord, fold

SAMPLES = [random.Random(7).uniform(0.01, 50.0) for _ in range(40)]


def close(a, b):
    return a == pytest.approx(b, rel=1e-12, abs=1e-12)


def test_first_sample_replaces_then_weight_of_the_gap():
    avg = Ewma(0.25)
    assert avg.value is None and avg.get() == 0.0
    assert avg.update(4.0) == 4.0
    assert avg.update(8.0) == 5.0
    assert Ewma(0.5, prior=0.0).update(4.0) == 2.0
    with pytest.raises(ValueError):
        Ewma(1.5)
    with pytest.raises(ValueError):
        time_weight(1.0, 0.0)


def test_fixed_weight_users_keep_their_numbers():
    # learner t_train (capacity.t_train_average), learner measured_throughput (0.3, first
    # replaces), worker rollout_s / group_s (0.2, first replaces), worker throughput (0.3),
    # worker grant_rtt (0.2 from 0).
    old_t = old_mt = old_roll = None
    new_t, roll, rtt, rate = None, Ewma(0.2), Ewma(0.2, prior=0.0), Ewma(0.3)
    old_rtt, old_rate = 0.0, 0.0
    for x in SAMPLES:
        old_t = x if old_t is None else 0.8 * old_t + 0.2 * x
        old_mt = x if old_mt is None else 0.3 * x + 0.7 * old_mt
        old_roll = 0.8 * old_roll + 0.2 * x if old_roll else x
        old_rtt = 0.8 * old_rtt + 0.2 * x
        old_rate = x if old_rate == 0 else 0.3 * x + 0.7 * old_rate
        new_t = t_train_average(new_t, x)
        assert close(new_t, old_t) and close(roll.update(x), old_roll)
        assert close(rtt.update(x), old_rtt) and close(rate.update(x), old_rate)
        assert close(rate.value, old_mt)  # the learner's measured_throughput: same rule


def test_link_meter_alpha_keeps_its_numbers():
    meter, old = LinkMeter(alpha=0.5), None
    for x in SAMPLES:
        meter._measure(meter.down, "w", x)
        old = x if old is None else old + 0.5 * (x - old)
        assert close(meter.down["w"], old)


def test_registry_time_constant_fold_keeps_its_numbers():
    tau, now, old = 60.0, 0.0, 0.0
    w = WorkerRecord("w", price=1.0, state=ACTIVE, mu_hat=0.0, activated_at=-1e9)
    busy = WorkerRecord("b", price=1.0, state=ACTIVE, mu_hat=0.0, activated_at=-1e9, busy_mode=True)
    old_busy, first = 0.0, True
    for x in SAMPLES:
        dt = x / 5
        now += dt
        w.pending = busy.pending = x
        busy.pending_busy = dt / 2
        fold({"w": w, "b": busy}, now, warmup_s=0.0, tau_s=tau)
        old += (1.0 - math.exp(-dt / tau)) * (x / dt - old)
        weight = 1.0 if first else 1.0 - math.exp(-(dt / 2) / tau)
        old_busy += weight * (x / (dt / 2) - old_busy)
        first = False
        assert close(w.mu_hat, old) and close(busy.mu_hat, old_busy)


def test_controller_availability_keeps_its_numbers():
    from echo_rl.provisioning.controller import Controller

    c = Controller(clock=lambda: 0.0)
    c.add_worker("w", price=1.0, mu_prior=1.0)
    (status,) = c.workers()
    old, beta = status.availability, c.avail_beta
    for i in range(30):
        up = i % 3 != 0
        c.heartbeat("w", up)
        old += beta * (float(up) - old)
        assert close(c.workers()[0].availability, old)


def test_one_formula():
    assert ewma(None, 3.0, 0.1) == 3.0
    assert close(ewma(2.0, 4.0, 0.25), 2.5)
    assert close(time_weight(60.0, 60.0), 1 - math.exp(-1))
