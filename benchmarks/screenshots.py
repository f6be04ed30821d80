"""Screenshots for docs/observability.md: ``python benchmarks/screenshots.py [--steps N]``.

Runs a short quickstart-like run with the learner in this process (the metrics server wired
the way ``learner/main.py`` is meant to wire it: ``LearnerMetrics.update(row, control.stats())``
after every step, decisions and install times fed as they appear) and 4 worker processes,
screenshots the live dashboard with headless Chromium, then builds ``echo-rl report`` for the
run and screenshots that. Writes docs/img/dashboard.png and docs/img/report.png (and keeps the
run folder given by --run-dir, default /tmp/echo-screenshots-run).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from echo.config import dump_toml, load_config  # noqa: E402
from echo.metrics import LearnerMetrics  # noqa: E402
from echo.procs import ProcessGroup, python_argv  # noqa: E402
from echo.report import make_report  # noqa: E402
from learner.main import Learner  # noqa: E402
from learner.policy import Policy  # noqa: E402


def chromium_shot(url: str, png: Path, size: str = "1400,1000") -> None:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        raise SystemExit("needs chromium (Debian: apt-get install chromium)")
    with tempfile.TemporaryDirectory() as profile:
        subprocess.run([exe, "--headless", "--no-sandbox", "--disable-gpu",
                        "--disable-background-networking", "--disable-component-update",
                        "--no-first-run", "--disable-sync", f"--user-data-dir={profile}",
                        f"--screenshot={png}", f"--window-size={size}",
                        "--virtual-time-budget=5000", url], check=True, capture_output=True, timeout=120)
    print(f"wrote {png}")


def installs(learner: Learner) -> dict[int, dict[str, float]]:
    """Install times of recent versions. Read across threads here (a script); the proposed
    wiring puts them into ControlPlane._stats() on the loop thread instead."""
    coord = learner.control.coordinator if learner.control else None
    if coord is None:
        return {}
    for _ in range(3):
        try:
            return {v: coord.install_times(v) for v in sorted(coord.published)[-20:]}
        except RuntimeError:  # changed size during iteration: try again
            continue
    return {}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--run-dir", type=Path, default=Path("/tmp/echo-screenshots-run"))
    p.add_argument("--img", type=Path, default=ROOT / "docs" / "img")
    args = p.parse_args(argv)
    args.img.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(args.run_dir, ignore_errors=True)
    run_dir = args.run_dir
    run_dir.mkdir(parents=True)
    cfg = load_config(str(ROOT / "examples" / "quickstart.toml"), [f"learner.max_steps={args.steps}"])
    (run_dir / "config.toml").write_text(dump_toml(cfg))
    policy = Policy(cfg)
    learner = Learner(cfg, run_dir, policy)
    metrics = LearnerMetrics(learner_price_per_hour=cfg.learner.price_per_hour, run_id=run_dir.name)
    server = metrics.serve("127.0.0.1", 0)
    print(f"dashboard at {server.url}/")
    group = ProcessGroup()
    seen_decisions = 0
    try:
        learner.start(False)
        assert learner.control is not None
        for i in range(args.workers):
            price = cfg.quickstart.worker_prices[i % len(cfg.quickstart.worker_prices)]
            group.start(f"worker-{i}", python_argv("worker.cli", "join", learner.control.join_line(),
                                                   "--id", f"worker-{i}", "--price", str(price),
                                                   "--identity", str(run_dir / f"worker-{i}.key")),
                        run_dir / f"worker-{i}.log")
        with (run_dir / "metrics.jsonl").open("a") as f:
            while learner.step < cfg.learner.max_steps:
                row = learner._one_step()
                learner.rows.append(row)
                f.write(json.dumps(row) + "\n")
                f.flush()
                metrics.update(row, learner.control.stats(), installs=installs(learner))
                dec = run_dir / "decisions.jsonl"
                lines = dec.read_text().splitlines() if dec.exists() else []
                for line in lines[seen_decisions:]:
                    metrics.add_decision(json.loads(line))
                seen_decisions = len(lines)
                print(f"step {row['step']} reward {row['reward_mean']:.3f}", flush=True)
        chromium_shot(server.url + "/", args.img / "dashboard.png", "1400,1250")
    finally:
        learner.close("run complete")
        group.stop_all()
        server.close()
    out = run_dir / "report"
    paths = make_report([run_dir], out, target=0.1)
    chromium_shot(paths["html"].resolve().as_uri(), args.img / "report.png", "1400,1600")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
