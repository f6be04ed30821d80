"""Screenshots for docs/observability.md: ``python benchmarks/screenshots.py [--steps N]``.

Runs a short quickstart-like run with the learner in this process (the metrics server wired
the way ``echo_rl/learner/main.py`` is meant to wire it: ``LearnerMetrics.update(row, control.stats())``
after every step, decisions and install times fed as they appear) and 4 worker processes,
screenshots the live dashboard with headless Chromium, then builds ``echo-rl report`` for the
run and screenshots that. Writes docs/img/dashboard.png and docs/img/report.png (and keeps the
run folder given by --run-dir, default /tmp/echo-screenshots-run), and docs/img/relay-tree.png,
the dashboard's relay tree cropped out of the same page: the workers declare 100 Mbit/s and the
learner 200, so the plan is two chains of two (a head and a tail each).
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

from echo_rl.cli.report import make_report  # noqa: E402
from echo_rl.core.config import dump_toml, load_config  # noqa: E402
from echo_rl.core.metrics import LearnerMetrics, LiveSources  # noqa: E402
from echo_rl.core.procs import ProcessGroup, python_argv  # noqa: E402
from echo_rl.learner.main import Learner  # noqa: E402
from echo_rl.learner.policy import Policy  # noqa: E402


def chromium_shot(url: str, png: Path, size: str = "1400,1000") -> None:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        raise SystemExit("needs chromium (Debian: apt-get install chromium)")
    with tempfile.TemporaryDirectory() as profile:
        subprocess.run(
            [
                exe,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-component-update",
                "--no-first-run",
                "--disable-sync",
                f"--user-data-dir={profile}",
                f"--screenshot={png}",
                f"--window-size={size}",
                "--virtual-time-budget=5000",
                url,
            ],
            check=True,
            capture_output=True,
            timeout=120,
        )
    print(f"wrote {png}")


def crop_tree(page_png: Path, png: Path, x: int = 22) -> None:
    """The relay tree card cut out of a dashboard screenshot 1400 px wide. Cards are white on
    a grey page: the white runs down column ``x`` (inside the cards' padding) are the boxes of
    the left column, and the tree's is the first that also covers the gaps between the grid's
    three columns (the first full-width card)."""
    from PIL import Image

    img = Image.open(page_png).convert("RGB")

    def white(px: int, y: int) -> bool:
        return img.getpixel((px, y)) == (255, 255, 255)

    runs, start = [], None
    for y in range(img.height):
        if white(x, y) and start is None:
            start = y
        elif not white(x, y) and start is not None:
            runs.append((start, y))
            start = None
    gaps = (img.width // 3, 2 * img.width // 3, img.width - 30)
    wide = [(a, b) for a, b in runs if b - a > 100 and all(white(g, (a + b) // 2) for g in gaps)]
    if not wide:
        raise SystemExit(f"{page_png}: no full-width card (white runs {runs})")
    top, bottom = wide[0]
    img.crop((8, top - 8, img.width - 8, bottom + 8)).save(png)
    print(f"wrote {png}")


def installs(learner: Learner) -> dict[int, dict[str, float]]:
    """Install times of recent versions. Read across threads here (a script); the proposed
    wiring puts them into LearnerServer.stats() on the loop thread instead."""
    coord = learner.server.coordinator if learner.server else None
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
    cfg = load_config(
        str(ROOT / "examples" / "quickstart.toml"),
        [f"learner.max_steps={args.steps}", "broadcast.uplink_mbit=200", "broadcast.link_mbit=100"],
    )
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
        assert learner.server is not None
        metrics.live = LiveSources(
            tree=learner.server.relay_tree
        )  # as echo_rl/learner/startup.py does
        for i in range(args.workers):
            price = cfg.quickstart.worker_prices[i % len(cfg.quickstart.worker_prices)]
            group.start(
                f"worker-{i}",
                python_argv(
                    "echo_rl.cli.worker",
                    "join",
                    learner.server.join_line(),
                    "--id",
                    f"worker-{i}",
                    "--price",
                    str(price),
                    "--down-mbit",
                    "100",
                    "--up-mbit",
                    "100",
                    "--identity",
                    str(run_dir / f"worker-{i}.key"),
                ),
                run_dir / f"worker-{i}.log",
            )
        with (run_dir / "metrics.jsonl").open("a") as f:
            while learner.step < cfg.learner.max_steps:
                row = learner._one_step()
                learner.rows.append(row)
                f.write(json.dumps(row.to_json()) + "\n")
                f.flush()
                metrics.update(row, learner.server.stats(), installs=installs(learner))
                dec = run_dir / "decisions.jsonl"
                lines = dec.read_text().splitlines() if dec.exists() else []
                for line in lines[seen_decisions:]:
                    metrics.add_decision(json.loads(line))
                seen_decisions = len(lines)
                print(f"step {row.step} reward {row.reward_mean:.3f}", flush=True)
        chromium_shot(server.url + "/", args.img / "dashboard.png", "1400,1900")
        crop_tree(args.img / "dashboard.png", args.img / "relay-tree.png")
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
