"""``echo-rl report``: HTML, CSV and Parquet from run folders, cost to a target reward."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pd = pytest.importorskip("pandas")
pytest.importorskip("pyarrow")
pytest.importorskip("matplotlib")

from echo_rl.cli.report import main, make_report  # noqa: E402


def fake_run(
    path: Path, *, slope: float, fleet: float, learner_price: float, steps: int = 20
) -> Path:
    path.mkdir(parents=True)
    rows = []
    for s in range(steps):
        t_train, t_wait = 1.0, 0.5
        rows.append(
            {
                "step": s,
                "version": s,
                "reward_mean": slope * s,
                "staleness_max": 1,
                "staleness_mean": 0.5,
                "t_train": t_train,
                "t_wait": t_wait,
                "bubble_ratio": 0.33,
                "admitted": 100 * (s + 1),
                "active_workers": 2,
                "standby_workers": 0,
                "fleet_price_per_hour": fleet,
                "cost_step_usd": fleet * (t_train + t_wait) / 3600,
                "rejected": {"bad_signature": s % 2},
                "learner_bytes_sent": 10 * s,
                "t_bcast": None if s == 0 else 0.2,
                "wall_s": 1.5 * (s + 1),
            }
        )
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (path / "decisions.jsonl").write_text(
        json.dumps(
            {
                "step": 3,
                "action": "activate",
                "worker": "w1",
                "reason": "short of capacity",
                "c_eff": 1.0,
                "target": 2.0,
                "mu_req": 1.8,
            }
        )
        + "\n"
    )
    (path / "summary.json").write_text(json.dumps({"steps": steps}))
    (path / "config.toml").write_text(f"[learner]\nprice_per_hour = {learner_price}\n")
    return path


def test_report_two_runs(tmp_path):
    fast = fake_run(tmp_path / "fast", slope=0.1, fleet=0.7, learner_price=3.06)
    slow = fake_run(tmp_path / "slow", slope=0.02, fleet=0.35, learner_price=0.0)
    out = tmp_path / "report"
    assert main([str(fast), str(slow), "--out", str(out), "--target-reward", "0.5"]) == 0
    html = (out / "index.html").read_text()
    assert "fast" in html and "slow" in html and html.count("data:image/png;base64,") == 4
    for name in (
        "steps.csv",
        "steps.parquet",
        "summary.csv",
        "summary.parquet",
        "decisions.csv",
        "reward.png",
    ):
        assert (out / name).stat().st_size > 0, name
    steps = pd.read_parquet(out / "steps.parquet")
    assert len(steps) == 40 and set(steps["run"]) == {"fast", "slow"}
    assert (
        pd.read_csv(out / "steps.csv")["cost_usd"].round(10) == steps["cost_usd"].round(10)
    ).all()
    summary = pd.read_parquet(out / "summary.parquet").set_index("run")
    # fast: rolling mean over 5 of 0.1*s reaches 0.5 at s=7 (mean of 3..7 = 0.5)
    assert summary.at["fast", "target_step"] == 7
    per_step = (0.7 + 3.06) * 1.5 / 3600
    assert summary.at["fast", "cost_to_target_usd"] == pytest.approx(8 * per_step)
    assert summary.at["fast", "cost_usd"] == pytest.approx(20 * per_step)
    assert summary.at["fast", "cost_per_1k_admitted_usd"] == pytest.approx(
        1000 * 20 * per_step / 2000
    )
    assert pd.isna(summary.at["slow", "target_step"])  # max reward 0.38: never reached
    assert summary.at["slow", "cost_usd"] == pytest.approx(20 * 0.35 * 1.5 / 3600)
    assert "rejected_bad_signature" in steps.columns


def test_same_folder_twice_gets_distinct_names(tmp_path):
    run = fake_run(tmp_path / "a", slope=0.1, fleet=0.7, learner_price=0.0)
    make_report([run, run], tmp_path / "out")
    assert list(pd.read_csv(tmp_path / "out" / "summary.csv")["run"]) == ["a", "a-2"]


def test_missing_run_is_an_error(tmp_path, capsys):
    assert main([str(tmp_path / "nope"), "--out", str(tmp_path / "o")]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err
