"""Capacity model (docs/design.md §3/§4) on hand-computed cases; the arithmetic is in the comments."""

import dataclasses

import pytest

from echo_rl.provisioning.capacity import (
    CapacityInputs,
    Infeasible,
    choose_kappa,
    mu_req,
    overlaps,
    staleness_bound_overlap,
    staleness_bound_worst,
)


def test_mu_req_hand_computed():
    # kappa*N / (kappa*T_train - T_bcast) = 2*64 / (2*10 - 4) = 128 / 16 = 8
    assert mu_req(64, 2, 10.0, 4.0) == pytest.approx(8.0)
    # no broadcast: N / T_train = 64 / 10
    assert mu_req(64, 3, 10.0, 0.0) == pytest.approx(6.4)


def test_mu_req_infeasible_names_the_numbers():
    # kappa*T_train = 1*3 = 3 <= T_bcast = 3: the broadcast outlasts the publication period
    with pytest.raises(Infeasible) as err:
        mu_req(64, 1, 3.0, 3.0)
    assert isinstance(err.value, ValueError)
    msg = str(err.value)
    assert "kappa*T_train = 1 x 3 s = 3 s <= T_bcast = 3 s" in msg
    assert "raise kappa above T_bcast/T_train = 1" in msg


@pytest.mark.parametrize(
    "args",
    [(0, 1, 1.0, 0.0), (8, 0, 1.0, 0.0), (8, 1, 0.0, 0.0), (8, 1, 1.0, -1.0), (8, 1.5, 1.0, 0.0)],
)
def test_bad_inputs_are_rejected(args):
    with pytest.raises(ValueError):
        mu_req(*args)


def test_overlap_condition():
    # T_bcast + kappa*N/mu <= kappa*T_train: 4 + 2*64/8 = 20 <= 20 (boundary counts)
    assert overlaps(64, 2, 10.0, 4.0, 8.0)
    # 4 + 128/7.9 = 20.2 > 20
    assert not overlaps(64, 2, 10.0, 4.0, 7.9)
    assert not overlaps(64, 2, 10.0, 4.0, 0.0)  # nothing produced, learner waits forever


def test_overlap_holds_exactly_at_mu_req_despite_rounding():
    # awkward floats: mu_req = 3*3 / (3*0.7 - 0.3) = 9 / 1.8 = 5 (not exactly in binary)
    for n, kappa, t_train, t_bcast in [(3, 3, 0.7, 0.3), (7, 5, 0.1, 0.2), (1000, 2, 1.3, 0.9)]:
        assert overlaps(n, kappa, t_train, t_bcast, mu_req(n, kappa, t_train, t_bcast))


def test_worst_case_bound():
    # kappa - 1 + ceil((T_bcast + N/mu) / T_train) = 1 + ceil((4 + 64/8)/10) = 1 + ceil(1.2) = 3
    assert staleness_bound_worst(64, 2, 10.0, 4.0, 8.0) == 3
    # 1 + ceil((2 + 8)/10) = 1 + ceil(1.0) = 2
    assert staleness_bound_worst(64, 2, 10.0, 2.0, 8.0) == 2
    # (0.1 + 2/10)/0.3 is 1.0000000000000002 in floats; the bound is 0 + ceil(1) = 1, not 2
    assert staleness_bound_worst(2, 1, 0.3, 0.1, 10.0) == 1
    with pytest.raises(ValueError, match="mu_total must be > 0"):
        staleness_bound_worst(64, 2, 10.0, 2.0, 0.0)


def test_overlap_bound():
    # kappa + ceil((1 - 1/kappa) T_bcast/T_train) = 3 + ceil(2/3 * 6/10) = 3 + ceil(0.4) = 4
    assert staleness_bound_overlap(3, 10.0, 6.0) == 4
    # 4 + ceil(3/4 * 3/1) = 4 + ceil(2.25) = 7
    assert staleness_bound_overlap(4, 1.0, 3.0) == 7
    # kappa = 1: every step publishes, 1 + ceil(0) = 1
    assert staleness_bound_overlap(1, 1.0, 5.0) == 1
    # (1 - 1/3) * 3 is 2.0000000000000004 naively; 3 + ceil(2) = 5, not 6
    assert staleness_bound_overlap(3, 1.0, 3.0) == 5
    # docs/design.md §3: kappa = S - 1 and T_bcast <= T_train gives s_max <= S (here S = 5)
    assert staleness_bound_overlap(4, 1.0, 1.0) <= 5


def test_choose_kappa_largest_within_budget():
    # S=3, N=64, T_train=10, T_bcast=2, mu=8
    # kappa=3: bound 3 + ceil(2/3 * 0.2 = 0.13) = 4 > 3 -> no
    # kappa=2: bound 2 + ceil(1/2 * 0.2 = 0.1) = 3 <= 3; overlap 2 + 2*64/8 = 18 <= 20 -> yes
    c = choose_kappa(3, 64, 10.0, 2.0, 8.0)
    assert (c.kappa, c.bound, c.overlap, c.fallback) == (2, 3, True, False)
    assert not c.bcast_slower_than_train and c.warnings == ()


def test_choose_kappa_equals_s_without_broadcast_time():
    # T_bcast = 0: bound(kappa=3) = 3 + 0 = 3 <= 3; overlap 0 + 3*64/8 = 24 <= 30
    assert choose_kappa(3, 64, 10.0, 0.0, 8.0).kappa == 3


def test_choose_kappa_overlap_picks_larger_kappa():
    # S=4, N=10, T_train=1, T_bcast=0.5, mu=12.5
    # kappa=4: bound 4 + ceil(3/4 * 0.5) = 5 > 4 -> no
    # kappa=3: bound 3 + ceil(2/3 * 0.5 = 0.33) = 4 <= 4; overlap 0.5 + 30/12.5 = 2.9 <= 3 -> yes
    assert choose_kappa(4, 10, 1.0, 0.5, 12.5).kappa == 3


def test_choose_kappa_falls_back_to_s_minus_1_and_says_why():
    # same as above with mu=11: kappa=3 overlap 0.5 + 30/11 = 3.23 > 3; kappa=2 bound
    # 2 + ceil(0.25) = 3 ok but overlap 0.5 + 20/11 = 2.32 > 2; kappa=1 overlap 0.5 + 10/11 =
    # 1.41 > 1. Fallback kappa = S-1 = 3, worst-case bound 2 + ceil(1.41) = 4;
    # mu_req(kappa=3) = 30 / (3 - 0.5) = 12
    c = choose_kappa(4, 10, 1.0, 0.5, 11.0)
    assert (c.kappa, c.fallback, c.overlap, c.bound) == (3, True, False, 4)
    assert "overlap needs mu >= 12/s" in c.reason and c.reason in c.warnings


def test_choose_kappa_fallback_min_one_and_no_throughput():
    # S=1: only kappa=1 exists; with mu=0 there is no overlap and no finite bound
    c = choose_kappa(1, 64, 10.0, 2.0, 0.0)
    assert (c.kappa, c.fallback, c.bound) == (1, True, None)


def test_choose_kappa_warns_when_broadcast_slower_than_training():
    # T_bcast=15 > T_train=10. kappa=3: bound 3 + ceil(2*15/(3*10) = 1) = 4 > 3;
    # kappa=2: bound 2 + ceil(15/20 = 0.75) = 3; overlap 15 + 128/100 = 16.28 <= 20
    c = choose_kappa(3, 64, 10.0, 15.0, 100.0)
    assert c.kappa == 2 and not c.fallback
    assert c.bcast_slower_than_train
    assert any("T_bcast = 15 s exceeds T_train = 10 s" in w for w in c.warnings)


def test_choose_kappa_rejects_bad_budget():
    with pytest.raises(ValueError, match="staleness budget S"):
        choose_kappa(-1, 64, 10.0, 2.0, 8.0)
    sync = choose_kappa(0, 64, 10.0, 2.0, 8.0)  # synchronous: every step, no overlap
    assert (sync.kappa, sync.bound, sync.overlap) == (1, 0, False) and "synchronous" in sync.reason


def test_capacity_inputs_delegate_and_are_frozen():
    inputs = CapacityInputs(n=64, t_train=10.0, t_bcast=4.0)
    assert inputs.mu_req(2) == pytest.approx(8.0)
    assert inputs.overlaps(2, 8.0)
    assert inputs.choose_kappa(3, 8.0).kappa == choose_kappa(3, 64, 10.0, 4.0, 8.0).kappa
    with pytest.raises(dataclasses.FrozenInstanceError):
        inputs.n = 1  # type: ignore[misc]
    with pytest.raises(ValueError, match="T_train"):
        CapacityInputs(n=64, t_train=0.0, t_bcast=1.0)
