"""Discrete-event simulator (echo_rl.provisioning.sim): behaviour on small scenarios, no timings."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from echo_rl.broadcast import planner
from echo_rl.provisioning import capacity
from echo_rl.provisioning.sim.api import simulate, simulate_fixed
from echo_rl.provisioning.sim.broadcast import BroadcastModel
from echo_rl.provisioning.sim.population import build_pool
from echo_rl.provisioning.sim.report import main
from echo_rl.provisioning.sim.scenario import ScenarioError, load_scenario, scenario_from_dict

EXAMPLES = __import__("pathlib").Path(__file__).resolve().parent.parent / "examples" / "sim"


def base(**over) -> dict:
    """A small run: 8 identical workers, N = 64 (8 prompts x 8), T_train 60 s, S = 3."""
    data = {
        "run": {"name": "t", "seed": 0, "steps": 24, "measure_from_step": 2},
        "learner": {
            "t_train_s": 60.0,
            "prompts_per_step": 8,
            "group_size": 8,
            "staleness": 3,
            "price_per_hour": 3.06,
        },
        "pool": {"classes": [{"name": "gpu", "count": 8, "mu": 1.0, "price": 0.35}]},
        "rollout": {"groups_per_request": 1, "duration_sigma": 0.1},
        "broadcast": {"topology": "fixed", "fixed_s": 20.0},
        "provisioning": {"selection": "all", "controller": False},
    }
    for key, value in over.items():
        section, name = key.split("__")
        data.setdefault(section, {})[name] = value
    return data


def run(data: dict, **over) -> dict:
    return simulate(data, over or None, machine=False)


# ------------------------------------------------------------------ bubbles and capacity


def test_no_bubbles_when_capacity_is_far_above_mu_req():
    r = run(base(), **{"pool.classes": [{"count": 40, "mu": 1.0, "price": 0.35}]})
    s = r["summary"]
    req = capacity.mu_req(64, 2, 60.0, 20.0)
    assert 40 * 1.0 > 3 * req
    assert s["bubble_ratio"] == 0.0
    assert s["steps_done"] == 24 and not s["stalled"]


def test_bubbles_when_capacity_is_below_mu_req():
    r = run(base(), **{"pool.classes": [{"count": 1, "mu": 0.5, "price": 0.35}]})
    s = r["summary"]
    assert s["bubble_ratio"] > 0.3
    assert s["wait_s_per_step"] > 20


def test_threshold_follows_mu_req_when_workers_pause_for_the_broadcast():
    # kappa = 2, T_bcast = 20 s: mu_req = 2*64 / (120 - 20) = 1.28/s
    req = capacity.mu_req(64, 2, 60.0, 20.0)
    above = run(
        base(),
        **{
            "pool.classes": [{"count": 1, "mu": 1.4 * req, "price": 0}],
            "rollout.groups_per_request": 1,
        },
    )
    below = run(base(), **{"pool.classes": [{"count": 1, "mu": 0.75 * req, "price": 0}]})
    assert above["summary"]["bubble_ratio"] < 0.02
    assert below["summary"]["bubble_ratio"] > 0.1


def test_larger_staleness_budget_needs_less_capacity():
    pool = {"pool.classes": [{"count": 1, "mu": 1.3, "price": 0}]}
    b = {S: run(base(learner__staleness=S), **pool)["summary"]["bubble_ratio"] for S in (2, 4)}
    assert b[4] < b[2]


def test_background_download_needs_less_capacity():
    pool = {"pool.classes": [{"count": 1, "mu": 1.2, "price": 0}]}
    pause = run(base(), **pool)["summary"]["bubble_ratio"]
    keep = run(base(rollout__generate_during_download=True), **pool)["summary"]["bubble_ratio"]
    assert keep < pause


# ------------------------------------------------------------------ staleness


@pytest.mark.parametrize("S", [1, 2, 3])
@pytest.mark.parametrize("gdd", [False, True])
def test_admitted_data_never_exceeds_the_staleness_budget(S, gdd):
    # slow broadcast and many fast workers: lots of data goes stale and must be dropped
    data = base(
        learner__staleness=S, rollout__generate_during_download=gdd, broadcast__fixed_s=55.0
    )
    data["pool"]["classes"] = [{"count": 30, "mu": 2.0, "price": 0.1}]
    r = run(data)
    stal = [st["staleness"] for st in r["steps"]]
    assert max(stal) <= S
    assert r["summary"]["staleness_max"] <= S
    if gdd:
        assert r["summary"]["trajectories"]["dropped_stale"] > 0


def test_staleness_and_drops_with_a_slow_worker_class():
    # a worker whose requests outlast S steps delivers only stale data, which is dropped
    data = base(learner__staleness=1)
    data["pool"]["classes"] = [
        {"name": "fast", "count": 6, "mu": 2.0, "price": 0.3},
        {"name": "slow", "count": 2, "mu": 0.02, "price": 0.1},
    ]
    r = run(data)
    assert r["summary"]["staleness_max"] <= 1
    assert r["summary"]["trajectories"]["dropped_stale"] > 0


# ------------------------------------------------------------------ churn


def test_churn_from_a_trace(tmp_path):
    trace = tmp_path / "trace.csv"
    trace.write_text("time_s,worker,event\n30,w0,leave\n31,w1,leave\n200,w0,join\n400,5,leave\n")
    data = base(
        churn__trace=str(trace),
        broadcast__topology="chains",
        broadcast__snapshot_gb=0.1,
        broadcast__uplink_mbit=200.0,
    )
    r = run(data)
    s = r["summary"]
    assert s["events"]["leaves"] == 3 and s["events"]["joins"] == 1
    assert s["steps_done"] == 24 and not s["stalled"]
    assert s["staleness_max"] <= 3
    # the active count follows the trace: 8 -> 6 -> 7 -> 6
    counts = [row[1] for row in r["active_timeline"]]
    assert counts[0] == 8 and min(counts) == 6 and counts[-1] == 6


def test_worker_whose_first_event_is_join_starts_absent(tmp_path):
    trace = tmp_path / "trace.csv"
    trace.write_text("time_s,worker,event\n100,w7,join\n")
    r = run(base(churn__trace=str(trace)))
    assert r["active_timeline"][0][1] == 7
    assert r["active_timeline"][-1][1] == 8


def test_relay_leaving_delays_its_chain_children_only():
    from echo_rl.provisioning.sim.core import Sim

    data = base(
        broadcast__topology="chains",
        broadcast__snapshot_gb=0.05,
        broadcast__uplink_mbit=200.0,
        broadcast__reattach_s=5.0,
    )
    data["run"]["steps"] = 3
    data["pool"]["classes"] = [{"count": 8, "mu": 1.0, "price": 0.35}]
    sim = Sim(scenario_from_dict(data))
    sim.run()
    sim._publish(sim.version + 1)  # a broadcast in progress at env.now
    chains = [c.tolist() for c in sim.snaps.cur_chains]
    assert len(chains) == 2 and all(len(c) == 4 for c in chains)  # k = 200/100 = 2 chains
    before = list(sim.snaps.pend_arrival)
    relay = chains[0][1]
    sim.churn.leave(relay)
    after = sim.snaps.pend_arrival
    for w in chains[0][2:]:
        assert after[w] == pytest.approx(before[w] + 5.0)
    for w in chains[0][:1] + chains[1]:
        assert after[w] == before[w]


def test_churn_rates_with_the_controller_replace_leavers():
    data = base(
        provisioning__controller=True,
        provisioning__selection="ours",
        provisioning__measure="capacity",
        provisioning__tick_s=5.0,
        provisioning__window_s=10.0,
        churn__leave_per_hour=3.0,
        churn__rejoin_per_hour=3.0,
        churn__heartbeat_timeout_s=5.0,
    )
    data["pool"]["classes"] = [{"count": 30, "mu": 0.5, "price": 0.35}]
    data["run"]["steps"] = 40
    r = run(data)
    s = r["summary"]
    assert s["events"]["leaves"] > 0
    assert s["events"]["activations"] > 0
    assert s["steps_done"] == 40


# ------------------------------------------------------------------ provisioning


def test_controller_activates_when_short():
    data = base(
        provisioning__controller=True,
        provisioning__selection="ours",
        provisioning__active=1,
        provisioning__measure="capacity",
        provisioning__tick_s=5.0,
        provisioning__window_s=10.0,
    )
    data["pool"]["classes"] = [{"count": 20, "mu": 0.5, "price": 0.35}]
    data["run"]["steps"] = 30
    r = run(data)
    s = r["summary"]
    assert r["initial"]["chosen"] == 1
    assert s["events"]["activations"] >= 2
    assert r["active_timeline"][-1][1] > 1
    assert any(d["action"] == "activate" for d in r["decisions"])
    # once provisioned the learner stops waiting
    late = [st["wait_s"] for st in r["steps"][-10:]]
    assert max(late) < 1.0


def test_cost_aware_selection_is_cheaper_than_random():
    prices = [0.35] * 6 + [0.9] * 14
    data = base()
    data["pool"]["classes"] = [{"count": 20, "mu": 0.5, "price": 0.35, "prices": prices}]
    data["provisioning"] = {"selection": "ours", "controller": False}
    ours = run(data)["summary"]
    data["provisioning"]["selection"] = "random"
    rand = run(data)["summary"]
    assert ours["cost_per_step_usd"] < rand["cost_per_step_usd"]


def test_cost_per_step_is_the_design_formula_for_a_fixed_set():
    r = run(base(), **{"pool.classes": [{"count": 40, "mu": 1.0, "price": 0.5}]})
    for st in r["steps"][2:]:
        expect = (3.06 + 40 * 0.5) * (st["train_s"] + st["wait_s"]) / 3600
        assert math.isclose(st["cost_usd"], expect, rel_tol=1e-9)
    s = r["summary"]
    assert math.isclose(
        s["usd_per_1k_trajectories"], s["cost_per_step_usd"] / 64 * 1000, rel_tol=1e-9
    )


def test_same_seed_same_result():
    a = run(base(rollout__duration_sigma=0.3))["summary"]
    b = run(base(rollout__duration_sigma=0.3))["summary"]
    for key in ("bubble_ratio", "staleness_mean", "sim_time_s", "trajectories"):
        assert a[key] == b[key]


# ------------------------------------------------------------------ broadcast model


def _model(topology: str, n: int, **bc) -> tuple[BroadcastModel, np.ndarray]:
    data = base(
        broadcast__topology=topology,
        broadcast__snapshot_gb=1.0,
        broadcast__uplink_mbit=400.0,
        **{f"broadcast__{k}": v for k, v in bc.items()},
    )
    data["pool"] = {
        "classes": [{"count": n, "mu": 1.0, "price": 0.3}],
        "down_mbit": 100.0,
        "up_mbit": 100.0,
        "link_sigma": 0.3,
    }
    sc = scenario_from_dict(data)
    pool = build_pool(sc, np.random.default_rng(0))
    return BroadcastModel(sc, pool), np.arange(n)


def test_star_times_come_from_the_planner_formulas():
    m, idx = _model("star", 12)
    p = m.plan(idx)
    expect = [planner.star_limited_s(1e9, d, 400.0, 12) for d in m.pool.down]
    assert np.allclose(p.offsets, expect)
    m, idx = _model("star-unlimited", 12)
    assert np.allclose(m.plan(idx).offsets, [planner.star_unlimited_s(1e9, d) for d in m.pool.down])


def test_chain_times_match_the_planner_prediction():
    m, idx = _model("chains", 24)
    p = m.plan(idx)
    assert p.mode == "planner"
    ref = planner.plan_chains(
        [planner_peer(m, i) for i in idx],
        uplink_mbit=400.0,
        snapshot_bytes=int(1e9),
        chunk_bytes=1 << 20,
    )
    assert math.isclose(p.predicted_s, ref.predicted_s, rel_tol=1e-9)
    assert sorted(np.concatenate(p.chains).tolist()) == list(range(24))
    assert p.lower_bound_s <= p.predicted_s


def planner_peer(m: BroadcastModel, i: int):
    from echo_rl.broadcast.topology.base import Peer

    return Peer(m.pool.ids[i], float(m.pool.down[i]), float(m.pool.up[i]), True)


def test_binned_planning_covers_every_recipient_once():
    m, idx = _model("chains", 300, plan_max_peers=16)
    p = m.plan(idx)
    assert p.mode == "binned"
    flat = np.concatenate(p.chains)
    assert sorted(flat.tolist()) == list(range(300))
    assert np.all(p.offsets > 0) and p.predicted_s >= p.lower_bound_s


# ------------------------------------------------------------------ scenario errors, CLI, API


def test_unknown_key_names_the_key_and_suggests_the_fix():
    data = base()
    data["learner"]["t_trian_s"] = 60
    with pytest.raises(
        ScenarioError, match=r"learner\.t_trian_s.*did you mean 'learner\.t_train_s'"
    ):
        scenario_from_dict(data)


def test_bad_value_names_key_value_and_fix():
    with pytest.raises(ScenarioError, match=r"learner\.staleness = -1.*--set learner\.staleness"):
        scenario_from_dict(base(learner__staleness=-1))
    with pytest.raises(ScenarioError, match=r"kappa=4 exceeds staleness=3"):
        scenario_from_dict(base(learner__kappa=4))
    with pytest.raises(ScenarioError, match=r"pool is empty"):
        scenario_from_dict({"pool": {}})
    with pytest.raises(
        ScenarioError, match=r"\[pool\.classes\.0\] class 'gpu': prices has 2 entries"
    ):
        data = base()
        data["pool"]["classes"][0]["prices"] = [0.1, 0.2]
        scenario_from_dict(data)


def test_cli_writes_json_and_plots(tmp_path):
    toml = tmp_path / "s.toml"
    toml.write_text(
        '[run]\nname = "cli"\nsteps = 6\n[learner]\nt_train_s = 30\n'
        "prompts_per_step = 4\ngroup_size = 4\nstaleness = 2\n"
        "[[pool.classes]]\ncount = 4\nmu = 1.0\nprice = 0.35\n"
        '[broadcast]\ntopology = "star"\nsnapshot_gb = 0.1\nuplink_mbit = 100\n'
        '[provisioning]\nselection = "all"\ncontroller = false\n'
    )
    out = tmp_path / "r.json"
    assert (
        main(
            [
                str(toml),
                "--json",
                str(out),
                "--plots",
                str(tmp_path / "p"),
                "--no-progress",
                "--set",
                "run.steps=5",
            ]
        )
        == 0
    )
    res = json.loads(out.read_text())
    assert res["summary"]["steps_done"] == 5
    assert "machine" in res
    assert (tmp_path / "p" / "cli.png").stat().st_size > 1000


def test_cli_bad_scenario_exits_2(tmp_path, capsys):
    toml = tmp_path / "bad.toml"
    toml.write_text("[pool]\nrandom_workers = 3\n[learner]\nstalenes = 2\n")
    assert main([str(toml), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "learner.stalenes" in err and "learner.staleness" in err
    assert main([str(tmp_path / "missing.toml"), "--no-progress"]) == 2


def test_simulate_fixed():
    ok = simulate_fixed(
        n_workers=8,
        mu_per_worker=1.0,
        t_train=60,
        t_bcast=20,
        N=64,
        S=3,
        kappa=2,
        steps=20,
        group_size=8,
        measure_from_step=2,
    )
    short = simulate_fixed(
        n_workers=1,
        mu_per_worker=0.5,
        t_train=60,
        t_bcast=20,
        N=64,
        S=3,
        kappa=2,
        steps=20,
        group_size=8,
    )
    assert ok["bubble_ratio"] == 0.0 and short["bubble_ratio"] > 0.3
    assert len(short["per_step_wait_s"]) == 20
    with pytest.raises(ValueError, match="multiple of group_size"):
        simulate_fixed(1, 1.0, 60, 20, 65, 3, 2, 5, group_size=8)


@pytest.mark.parametrize(
    "path",
    sorted(
        __import__("pathlib").Path(__file__).resolve().parent.parent.glob("examples/sim/*.toml")
    ),
    ids=lambda p: p.stem,
)
def test_example_scenarios_load_and_start(path):
    from echo_rl.provisioning.sim.multijob_scenario import load_multi
    from echo_rl.provisioning.sim.scenario import ScenarioError, load_scenario

    if path.stem.startswith("multirun"):  # several jobs on one fleet: their own loader
        assert load_multi(path).jobs
        with pytest.raises(ScenarioError, match="benchmarks/sim_multirun.py"):
            load_scenario(path)  # the single-job loader names the right tool
        return
    sc = load_scenario(path)
    if len(build_pool(sc, np.random.default_rng(0))) > 1000:
        return  # scale-10k: validated only; benchmarks/reproduce_sim.py runs it
    r = simulate(path, {"run.steps": 3, "run.measure_from_step": 0}, machine=False)
    assert r["summary"]["steps_done"] == 3


def test_a_worker_touched_by_a_trace_keeps_its_random_churn(tmp_path):
    """A trace event makes the worker's pending random event stale; the worker must get a new
    one from its new state, not drop out of random churn for the rest of the run."""
    from echo_rl.provisioning.sim.core import Sim

    trace = tmp_path / "trace.csv"
    trace.write_text("time_s,worker,event\n1,w0,leave\n2,w0,join\n")
    data = base(churn__trace=str(trace), churn__leave_per_hour=360.0, churn__rejoin_per_hour=720.0)
    data["pool"]["classes"] = [{"count": 2, "mu": 5.0, "price": 0.35}]
    data["run"]["steps"] = 12
    sim = Sim(scenario_from_dict(data))
    sim.run()
    # about one leave per 10 s present over 12+ minutes: dozens for either worker
    assert sim.ws.leave_epoch[0] > 10 and sim.ws.leave_epoch[1] > 10


def test_the_install_quantile_is_one_rule_without_float_noise():
    from echo_rl.broadcast.coordinator import Coordinator, quantile_rank
    from echo_rl.broadcast.topology import make_topology

    assert [quantile_rank(0.9, 10), quantile_rank(1.0, 7), quantile_rank(0.01, 5)] == [9, 7, 1]
    assert quantile_rank(0.3, 10) == 3  # 0.3 * 10 = 3.0000000000000004
    coord = Coordinator(make_topology("chains"), "tcp://root", q=0.3)
    for i in range(10):
        coord.join(f"w{i}", f"tcp://w{i}", now=-1.0)  # joined before the publication (clock 0)
    coord.publish(1, now=0.0)
    for i in range(3):
        coord.installed(f"w{i}", 1, now=1.0 + i)
    assert coord.t_bcast(1) == 3.0  # the third install, not a fourth that never came


def test_busy_time_measures_capacity_as_the_oracle_does():
    """Fed what the learner's control plane feeds it (each batch with its generation seconds),
    the controller holds about the capacity the oracle holds; fed deliveries over wall time it
    over-provisions (the rate it sees is the learner's demand, not the fleet's capacity)."""
    data = base(
        provisioning__controller=True,
        provisioning__selection="ours",
        provisioning__tick_s=5.0,
        provisioning__window_s=10.0,
        churn__leave_per_hour=3.0,
        churn__rejoin_per_hour=3.0,
        churn__heartbeat_timeout_s=5.0,
    )
    data["pool"]["classes"] = [{"count": 40, "mu": 0.5, "price": 0.35}]
    data["run"]["steps"] = 40

    def summary(measure: str) -> dict:
        d = {**data, "provisioning": {**data["provisioning"], "measure": measure}}
        return run(d)["summary"]

    busy, delivered, oracle = summary("busy"), summary("delivered"), summary("capacity")
    assert abs(busy["mu_active_mean"] / oracle["mu_active_mean"] - 1) < 0.10
    assert delivered["mu_active_mean"] > 1.5 * busy["mu_active_mean"]
    assert busy["cost_per_step_usd"] < delivered["cost_per_step_usd"]


# ----------------------------------------------------------------------------- centralized


def test_centralized_baselines_bill_every_gpu_for_the_whole_step():
    from echo_rl.provisioning.sim.centralized import run_baseline
    from echo_rl.provisioning.sim.scenario import CentralizedSection

    c = CentralizedSection(enabled=True, gpus=8, gpu_price=3.0, mu_per_gpu=0.5, train_gpus=4)
    # 2,048 trajectories in requests of 32: 64 requests of 64 s, 8 per GPU on 8 GPUs = 512 s
    sync = run_baseline(
        "sync", c, n_traj=2048, t_train=200.0, per_request=32, sigma=0.0, steps=3, seed=0
    )
    assert sync.step_s == pytest.approx(512 + 200)
    assert sync.cost_per_step_usd == pytest.approx(8 * 3.0 * 712 / 3600)
    assert sync.bubble_ratio == pytest.approx(512 / 712)
    # async: 4 generate (1,024 s) while 4 train (200 s): the step is the slower side
    asy = run_baseline(
        "async", c, n_traj=2048, t_train=200.0, per_request=32, sigma=0.0, steps=3, seed=0
    )
    assert asy.step_s == pytest.approx(1024) and asy.generating_gpus == 4


def test_a_centralized_section_without_a_rollout_rate_names_the_key():
    with pytest.raises(Exception, match="centralized.mu_per_gpu"):
        load_scenario(EXAMPLES / "centralized-8b.toml", ["centralized.mu_per_gpu=0"])
    with pytest.raises(Exception, match="centralized.train_gpus"):
        load_scenario(
            EXAMPLES / "centralized-8b.toml",
            ["centralized.train_gpus=8", 'centralized.modes=["async"]'],
        )


def test_the_centralized_scenario_compares_echo_with_its_baseline():
    r = simulate(EXAMPLES / "centralized-8b.toml", {"run.steps": 6}, machine=False)
    c = r["centralized"]
    assert [b["mode"] for b in c["baselines"]] == ["sync"]
    saving = 1 - r["summary"]["cost_per_step_usd"] / c["baselines"][0]["cost_per_step_usd"]
    assert c["echo_saving_vs_cheapest"] == pytest.approx(saving)


def test_boot_in_join_order_and_late_activations_install_at_the_replayed_time():
    """selection "first" boots the first worker only (the learner's initial_active); the
    controller then activates others, which under topology "fixed" install fixed_s after
    activation (not after a full-snapshot pull over their links)."""
    r = run(
        base(
            provisioning__selection="first",
            provisioning__active=1,
            provisioning__controller=True,
            provisioning__window_s=5.0,
            provisioning__warmup_s=1.0,
            provisioning__tick_s=1.0,
            broadcast__fixed_s=2.0,
            run__steps=30,
        )
    )
    assert r["initial"]["chosen"] == 1
    steps = r["steps"]
    assert steps[0]["n_active"] == 1
    assert r["summary"]["events"]["activations"] >= 1
    assert max(s["n_active"] for s in steps) > 1
    # the activated workers work: the late steps wait no longer than the first one did
    assert steps[-1]["wait_s"] < steps[0]["wait_s"]


def test_first_selection_needs_a_count():
    with pytest.raises(Exception, match="provisioning.active"):
        run(base(provisioning__selection="first"))
