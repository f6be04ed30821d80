"""The multi-job simulator (echo_rl/provisioning/sim/multijob.py): several RL jobs on one fleet, shared
against dedicated. Small fleets (100 workers) so each run takes a fraction of a second."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from echo_rl.provisioning.sim.multijob import JobRun, MultiSim, home_sets
from echo_rl.provisioning.sim.multijob_report import compare, table
from echo_rl.provisioning.sim.multijob_scenario import load_multi, multi_from_dict
from echo_rl.provisioning.sim.multijob_sweep import sweep_row, sweep_table, with_contrast
from echo_rl.provisioning.sim.scenario import ScenarioError

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "sim"


def _job(name: str, S: int, offset: float) -> dict[str, Any]:
    # ~68 workers while rollout-bound (30 s steps), ~17 while learner-bound (120 s steps)
    return {
        "name": name,
        "mu": 1.6,
        "staleness": S,
        "prompts_per_step": 204,
        "group_size": 16,
        "cold_s": 60,
        "warm_s": 2.5,
        "sync_s": 2,
        "phase_offset_s": offset,
        "phases": [
            {"duration_s": 300, "t_train_s": 120},
            {"duration_s": 300, "t_train_s": 30},
        ],
    }


def _data(jobs: list[dict[str, Any]], **fleet: Any) -> dict[str, Any]:
    return {
        "run": {"name": "t", "seed": 1, "horizon_s": 1200},
        "fleet": {"workers": 100, "resident_models": 2, **fleet},
        "jobs": jobs,
    }


OFFSET = [_job("a", 3, 0), _job("b", 2, 300)]


@pytest.mark.parametrize(
    "policy", ["target", "turns", "turns-decay", "turns-need", "turns-needfirst"]
)
def test_staleness_never_exceeds_S_in_either_mode(policy: str) -> None:
    jobs = [_job("a", 3, 0), _job("b", 1, 300), _job("c", 0, 150)]
    res = compare(multi_from_dict(_data(jobs, policy=policy)))
    for mode in ("shared", "dedicated"):
        for j in res[mode]["jobs"]:
            assert j["steps"] > 0
            assert j["staleness_max"] <= j["S"], (mode, j)


def test_a_gated_jobs_workers_serve_the_other_job() -> None:
    res = compare(multi_from_dict(_data(OFFSET)))
    ded, sh = res["dedicated"], res["shared"]
    # Offset phases: while one learner is the bottleneck its gate closes, and its dedicated
    # workers idle; shared, they serve the rollout-bound job, which then steps faster.
    assert sh["idle_fraction"] < ded["idle_fraction"] - 0.1
    # The record of workers held adds up to the worker-seconds used (its own bookkeeping).
    for s in sh["jobs"]:
        assert sum(sh["held_per_minute"][s["name"]]) * 60 == pytest.approx(s["worker_s"], rel=0.02)
    for d, s in zip(ded["jobs"], sh["jobs"], strict=True):
        assert s["steps"] > d["steps"]
        assert s["ratio"] > 1.0
    assert "ratio" in table(res)


@pytest.mark.parametrize("policy", ["target", "turns"])
def test_one_job_shared_is_dedicated_exactly(policy: str) -> None:
    res = compare(multi_from_dict(_data([_job("solo", 2, 0)], policy=policy)))
    ded, sh = res["dedicated"], res["shared"]
    d, s = dict(ded["jobs"][0]), dict(sh["jobs"][0])
    s.pop("ratio"), s.pop("fleet_cost_over_bound")
    assert d == s
    assert sh["held_per_minute"] == ded["held_per_minute"]
    assert sh["idle_fraction"] == ded["idle_fraction"]
    assert res["shared"]["jobs"][0]["ratio"] == 1.0


def test_one_resident_model_pays_cold_loads_two_do_not() -> None:
    k1 = compare(multi_from_dict(_data(OFFSET, resident_models=1)))["shared"]
    k2 = compare(multi_from_dict(_data(OFFSET, resident_models=2)))["shared"]
    cold1 = sum(j["cold_loads"] for j in k1["jobs"])
    cold2 = sum(j["cold_loads"] for j in k2["jobs"])
    # K = 2: at most one cold load per worker (its second model, once); K = 1 reloads on
    # every switch, and warm loads cannot happen.
    assert cold2 <= 100 < cold1
    assert sum(j["warm_loads"] for j in k1["jobs"]) == 0
    assert sum(j["warm_loads"] for j in k2["jobs"]) > 0
    assert k1["switch_fraction"] > k2["switch_fraction"]
    home = compare(multi_from_dict(_data(OFFSET, reach="home")))["shared"]
    assert sum(j["cold_loads"] for j in home["jobs"]) == 100  # K >= jobs: "home" is "any"


def _flat(name: str, t_train_s: float, weight: float = 1.0) -> dict[str, Any]:
    """A job without phases: its learner steps every ``t_train_s``."""
    j = _job(name, 2, 0)
    j["weight"], j["phases"] = weight, [{"duration_s": 600, "t_train_s": t_train_s}]
    return j


def test_turns_serves_only_jobs_that_ask(monkeypatch: pytest.MonkeyPatch) -> None:
    # "slow": one learner step outlasts the horizon, so once its gate's 2 batches are out its
    # gate stays closed. Turns would owe it the device (it has the least device-seconds on
    # every worker that served "fast"), but a closed gate does not ask: it gets nothing more.
    starts: list[tuple[str, int]] = []
    orig = MultiSim._start

    def start(self: MultiSim, i: int, job: JobRun) -> None:
        if self.shared:
            starts.append((job.spec.name, job.free_slots()))
        orig(self, i, job)

    monkeypatch.setattr(MultiSim, "_start", start)
    res = compare(multi_from_dict(_data([_flat("slow", 5000), _flat("fast", 20)], policy="turns")))
    sh = res["shared"]
    assert all(free > 0 for _, free in starts)  # every request went to a job with open slots
    B = 204
    slow_requests = sum(1 for name, _ in starts if name == "slow")
    assert slow_requests == 3 * B  # its first batch, then the gate's 2 batches (S = 2)
    slow, fast = sh["jobs"]
    assert slow["steps"] == 0 and fast["steps"] > 0
    # The rest of the fleet's time went to "fast": none idle while it asked.
    assert slow["worker_s"] + fast["worker_s"] == pytest.approx(100 * 1200, rel=0.01)
    assert slow["worker_s"] < 0.15 * fast["worker_s"]


def test_turns_splits_each_device_by_weight_among_asking_jobs() -> None:
    # Two jobs whose learners want more than the fleet (gates open nearly all the time): each
    # worker's device-seconds split by weight, 2:1 (Turns' books, echo_rl/worker/sharing.py).
    res = compare(
        multi_from_dict(_data([_flat("a", 20, weight=2.0), _flat("b", 20)], policy="turns"))
    )
    a, b = res["shared"]["jobs"]
    assert a["worker_s"] / b["worker_s"] == pytest.approx(2.0, rel=0.1)
    assert a["steps"] > 1.5 * b["steps"]
    # The heuristic splits by capacity targets instead: equal learners, equal shares.
    tgt = compare(multi_from_dict(_data([_flat("a", 20, weight=2.0), _flat("b", 20)])))
    a, b = tgt["shared"]["jobs"]
    assert a["worker_s"] / b["worker_s"] == pytest.approx(1.0, rel=0.1)


def test_turns_leaves_dedicated_alone_and_loads_each_joined_model_cold_once() -> None:
    jobs = [_job("a", 3, 0), _job("b", 2, 200), _job("c", 2, 400)]
    target = compare(multi_from_dict(_data(jobs, reach="any")))
    turns = compare(multi_from_dict(_data(jobs, reach="any", policy="turns")))
    assert turns["dedicated"] == target["dedicated"]  # the policy is the shared mode's
    # Every model a worker joined stays in host memory once loaded: at most 2 cold loads per
    # worker (the two jobs other than its own), then warm switches only (K = 2 on the device).
    cold = sum(j["cold_loads"] for j in turns["shared"]["jobs"])
    assert 0 < cold <= 2 * 100
    assert sum(j["warm_loads"] for j in turns["shared"]["jobs"]) > 0


def test_turns_decay_books_forget_old_turns_at_tau() -> None:
    sc = multi_from_dict(_data(OFFSET, policy="turns-decay", turns_tau_s=60.0))
    w = MultiSim(sc, [0] * 100, np.ones(100), shared=True).w
    w.charge(0, 0, 10.0, 0.0)
    w.charge(0, 1, 5.0, 60.0)  # one tau later: job 0's 10 s count 10 / e
    assert w.used[0] == pytest.approx([10.0 / np.e, 5.0])
    plain = MultiSim(multi_from_dict(_data(OFFSET, policy="turns")), [0] * 100, np.ones(100), True)
    plain.w.charge(0, 0, 10.0, 0.0)
    plain.w.charge(0, 1, 5.0, 60.0)
    assert plain.w.used[0] == [10.0, 5.0]  # plain Turns: the whole run's books


def test_turns_need_moves_worker_seconds_to_the_rollout_bound_job() -> None:
    # "roll" needs ~51 workers (40 s steps), "learn" ~17 (120 s steps) of 100. Plain turns
    # splits each device by device-seconds whenever both ask; with each weight times its
    # learner's need (required / held), "roll" gets more and "learn" less.
    jobs = [_flat("roll", 40), _flat("learn", 120)]
    turns = compare(multi_from_dict(_data(jobs, policy="turns")))["shared"]["jobs"]
    need = compare(multi_from_dict(_data(jobs, policy="turns-need")))["shared"]["jobs"]
    assert need[0]["worker_s"] > 1.02 * turns[0]["worker_s"]
    assert need[1]["worker_s"] < 0.96 * turns[1]["worker_s"]
    for j in need:
        assert j["staleness_max"] <= j["S"]


def test_turns_needfirst_moves_worker_seconds_to_the_rollout_bound_job() -> None:
    # The same two jobs: "roll" (40 s steps) needs ~51 workers, "learn" (120 s) ~17. Needfirst
    # serves the asking job with the highest need (required / held) first, the books only
    # breaking ties, so "roll" gets more worker-seconds than under plain turns.
    jobs = [_flat("roll", 40), _flat("learn", 120)]
    turns = compare(multi_from_dict(_data(jobs, policy="turns")))["shared"]["jobs"]
    first = compare(multi_from_dict(_data(jobs, policy="turns-needfirst")))["shared"]["jobs"]
    assert first[0]["worker_s"] > 1.02 * turns[0]["worker_s"]
    assert first[0]["steps"] >= turns[0]["steps"]
    for j in first:
        assert j["staleness_max"] <= j["S"]


def test_home_sets_hold_the_own_job_and_spread_the_others() -> None:
    owner = [0] * 30 + [1] * 30 + [2] * 30 + [3] * 30
    sets = home_sets(owner, 4, 2)
    assert all(len(s) == 2 and s[-1] == o for s, o in zip(sets, owner, strict=True))
    partners = [s[0] for s, o in zip(sets, owner, strict=True) if o == 0]
    assert sorted(partners.count(k) for k in (1, 2, 3)) == [10, 10, 10]


def test_home_reach_never_cold_loads_with_more_jobs_than_K() -> None:
    jobs = [_job("a", 3, 0), _job("b", 2, 200), _job("c", 2, 400)]
    res = compare(multi_from_dict(_data(jobs, reach="home")))
    assert sum(j["cold_loads"] for j in res["shared"]["jobs"]) == 0
    anyr = compare(multi_from_dict(_data(jobs, reach="any")))
    assert sum(j["cold_loads"] for j in anyr["shared"]["jobs"]) > 0


@pytest.mark.parametrize(
    "mutate, words",
    [
        (
            lambda d: d["jobs"][0].update(stalenes=2),
            ["unknown key", "jobs.0.stalenes", "staleness"],
        ),
        (lambda d: d["jobs"][1].update(staleness=-1), ["jobs.1.staleness", "-1", "fix it"]),
        (lambda d: d.update(jobs=[]), ["no jobs", "[[jobs]]"]),
        (lambda d: d.pop("jobs"), ["jobs is required"]),
        (lambda d: d["fleet"].update(worker=10), ["unknown key 'fleet.worker'", "fleet.workers"]),
        (lambda d: d["jobs"][0].update(phases=[]), ["jobs.0.phases"]),
        (lambda d: d["jobs"][1].update(name="a"), ["repeat", "distinct name"]),
    ],
)
def test_bad_scenario_names_the_key_and_the_fix(mutate: Any, words: list[str]) -> None:
    data = copy.deepcopy(_data(OFFSET))
    mutate(data)
    with pytest.raises(ScenarioError) as err:
        multi_from_dict(data)
    for w in words:
        assert w in str(err.value), str(err.value)


def test_missing_file_is_a_scenario_error(tmp_path: Path) -> None:
    with pytest.raises(ScenarioError, match="not found"):
        load_multi(tmp_path / "nope.toml")


@pytest.mark.parametrize("name", ["multirun-2", "multirun-2-inphase", "multirun-3", "multirun-4"])
def test_example_scenarios_load(name: str) -> None:
    sc = load_multi(EXAMPLES / f"{name}.toml")
    assert sc.fleet.workers == 1000 and 2 <= len(sc.jobs) <= 4


@pytest.mark.parametrize("name", ["multirun-2", "multirun-3", "multirun-4"])
def test_contrast_keeps_each_jobs_average_demand(name: str) -> None:
    sc = load_multi(EXAMPLES / f"{name}.toml")
    # The example files are contrast 4: the sweep's c = 4 is the file itself.
    assert with_contrast(sc, 4).jobs == sc.jobs

    def rate(job: Any) -> float:  # steps per cycle if never waiting: demand's time average
        return sum(p.duration_s / p.t_train_s for p in job.phases)

    for c in (1, 2, 8):
        out = with_contrast(sc, c)
        for a, b in zip(sc.jobs, out.jobs, strict=True):
            ts = sorted({p.t_train_s for p in b.phases})
            assert len(ts) == (1 if c == 1 else 2)
            assert ts[-1] == pytest.approx(c * ts[0])
            assert rate(b) == pytest.approx(rate(a))
            assert [p.duration_s for p in b.phases] == [p.duration_s for p in a.phases]
            assert b.phase_offset_s == a.phase_offset_s
    assert {j.phase_offset_s for j in with_contrast(sc, 8, aligned=True).jobs} == {0.0}
    with pytest.raises(ValueError, match="contrast"):
        with_contrast(sc, 0.5)


def test_sharing_pays_with_offset_phases_and_more_the_stronger_their_contrast() -> None:
    # The 2-job scenario a tenth the size: 100 workers, 600-s phases half a cycle apart.
    def job(name: str, S: int, offset: float) -> dict[str, Any]:
        j = _job(name, S, offset)
        for p in j["phases"]:
            p["duration_s"] = 600
        return j

    data = _data([job("a", 3, 0), job("b", 2, 600)])
    data["run"]["horizon_s"] = 2400
    base = multi_from_dict(data)
    scs = {c: with_contrast(base, c) for c in (1, 2, 4, 8)}
    rows = [sweep_row(compare(sc), c, False, sc) for c, sc in scs.items()]
    # No phases (c = 1): nothing to reclaim, sharing is dedicated within a few %.
    assert rows[0]["ratio_whole_bill"] == pytest.approx(1.0, abs=0.03)
    # Offset phases: the worst job's ratio and the whole bill's grow with the contrast.
    for lo, hi in zip(rows, rows[1:]):
        assert hi["ratio_min"] > lo["ratio_min"] + 0.02, (lo, hi)
        assert hi["ratio_whole_bill"] > lo["ratio_whole_bill"] + 0.02, (lo, hi)
    # Aligned phases (both rollout-bound at once): the idle time is idle for both jobs, and
    # sharing is dedicated within a few % on the whole bill (per job it moves a few steps).
    for c in (4, 8):
        sc = with_contrast(base, c, aligned=True)
        al = sweep_row(compare(sc), c, True, sc)
        # The offline bound sees it too: aligned, the fleet caps both jobs at once.
        assert al["every_job_bound"] < rows[2 if c == 4 else 3]["every_job_bound"]
        assert al["ratio_whole_bill"] <= al["bill_bound"] + 1e-9
        assert al["ratio_whole_bill"] == pytest.approx(1.0, abs=0.03)
        assert 0.85 < al["ratio_min"] <= al["ratio_max"] < 1.15
        assert al["idle_shared"] > al["idle_dedicated"] - 0.1
    # The offline bounds hold: what the simulated policy reached is within them (no schedule
    # keeping S beats the relaxation), and the worst job is within the every-job bound.
    for r in rows:
        assert r["ratio_whole_bill"] <= r["bill_bound"] + 1e-9 <= r["ceiling_bound"] + 2e-9, r
        assert r["steps_shared"] <= r["steps_ceiling"], r
        assert r["every_job_bound"] <= r["bill_bound"] + 1e-9, r
    assert rows[-1]["bill_bound"] > rows[0]["bill_bound"]
    assert "ratio min" in sweep_table(rows) and "bound" in sweep_table(rows)


def test_the_offline_bound_is_the_learner_or_the_fleet_whichever_binds() -> None:
    """echo_rl/provisioning/sim/multijob_bound.py on cases worked by hand: one job without phases,
    steps of 30 s over 1,200 s (40 steps at most), each needing 204 x 16 / 1.6 = 2,040
    worker-seconds."""
    from echo_rl.provisioning.sim.multijob_bound import offline_bound

    job = _job("a", 3, 0)
    job["phases"] = [{"duration_s": 600, "t_train_s": 30}]
    sc = multi_from_dict(_data([job]))
    # Fleet to spare (100 workers need 2,040 / 100 = 20.4 s a batch): the learner binds.
    roomy = offline_bound(sc, [20], capacity=100.0)
    assert roomy["steps_most"][0] == pytest.approx(40.0)
    assert roomy["bill_bound"] == pytest.approx(2.0) and roomy["every_job_bound"] == pytest.approx(
        2.0
    )
    # 17 workers: 1,200 x 17 / 2,040 = 10 batches, plus none ahead (they would be trained).
    tight = offline_bound(sc, [5], capacity=17.0)
    assert tight["steps_most"][0] == pytest.approx(10.0)
    # Two jobs on a fleet for one: the every-job bound splits it, the bill's does not care.
    b = _job("b", 3, 0)
    b["phases"] = job["phases"]
    two = multi_from_dict(_data([job, b]))
    res = offline_bound(two, [5, 5], capacity=17.0)
    assert sum(res["steps_most"]) == pytest.approx(10.0)
    assert res["every_job_bound"] == pytest.approx(1.0)  # 5 each at most


def test_the_benchmarks_settings_reach_every_job_and_bad_ones_are_named() -> None:
    """benchmarks/sim_multirun.py --warm-s and --set: every job's switch time, and a fleet
    setting on top of each scenario's own overrides (the worker's rule, docs/multirun.md)."""
    from benchmarks import sim_multirun as bench

    sc = bench.load("multirun-4.toml", warm_s=0.5)
    assert [j.warm_s for j in sc.jobs] == [0.5] * 4
    bench.EXTRA.update({"fleet.reach": "any", "fleet.resident_models": 1})
    try:
        sc = bench.load("multirun-4.toml", {"fleet.policy": "turns-need"})
    finally:
        bench.EXTRA.clear()
    assert (sc.fleet.reach, sc.fleet.resident_models, sc.fleet.policy) == ("any", 1, "turns-need")
    with pytest.raises(SystemExit):
        bench.main(["--set", "fleet.reach", "--no-sweep", "--only", "none"])
