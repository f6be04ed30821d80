"""``echo-rl quickstart``: a learner and N workers as separate OS processes on loopback.

Shows live progress (step, reward, staleness, bubble ratio, workers) read from the run's
``metrics.jsonl``, ends with a summary table and the run folder. Ctrl-C stops every child.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from echo_rl.core.config import EchoConfig, dump_toml
from echo_rl.core.procs import ProcessGroup, python_argv, wait_ready
from echo_rl.core.steprow import StepRow

if TYPE_CHECKING:
    from echo_rl.learner.evaluation import HeldoutScoreJson

console = Console()


class MetricsTail:
    """Reads the lines appended to metrics.jsonl since the last call."""

    def __init__(self, path: Path):
        self.path = path
        self.offset = 0
        self.rows: list[StepRow] = []

    def poll(self) -> list[StepRow]:
        if not self.path.exists():
            return []
        with self.path.open() as f:
            f.seek(self.offset)
            data = f.read()
        complete = data[: data.rfind("\n") + 1]
        self.offset += len(complete.encode())
        new = [
            StepRow.from_json(json.loads(line)) for line in complete.splitlines() if line.strip()
        ]
        self.rows.extend(new)
        return new


def _describe(row: StepRow) -> str:
    held = (
        ""
        if row.heldout_mean is None
        else f"  held-out {row.heldout_mean:.3f} [{row.heldout_lo:.3f}, {row.heldout_hi:.3f}] "
        f"@{row.heldout_step} (best @{row.best_step})"
    )
    return (
        f"reward {row.reward_mean:.3f}{held}  staleness {row.staleness_max}  "
        f"bubble {row.bubble_ratio:.2f}  workers {row.active_workers} active "
        f"/ {row.standby_workers} standby"
        + (f"  cut {100 * row.completions_cut:.0f}%" if row.completions_cut else "")
        # an episode adapter's info numbers, step means (docs/adapters.md); the first 8
        + "".join(f"  {k} {v:.3g}" for k, v in list((row.episode_stats or {}).items())[:8])
        + (f"  COLLAPSING: {row.collapse}" if row.collapse else "")
    )


def _mean(values: Sequence[float | None]) -> float:
    """The mean of the numbers (a row without one left out); NaN when there are none."""
    nums = [v for v in values if v is not None]
    return sum(nums) / len(nums) if nums else float("nan")


def summary_table(cfg: EchoConfig, rows: list[StepRow], run_dir: Path) -> Table:
    t = Table(title=f"Echo quickstart: {run_dir}")
    t.add_column("metric")
    t.add_column("value", justify="right")
    first, last = rows[:10], rows[-10:]
    t.add_row("learner steps", str(len(rows)))
    t.add_row("reward, mean of first 10 steps", f"{_mean([r.reward_mean for r in first]):.3f}")
    t.add_row("reward, mean of last 10 steps", f"{_mean([r.reward_mean for r in last]):.3f}")
    t.add_row(
        "max staleness (budget S)",
        f"{max((r.staleness_max or 0 for r in rows), default=0)} ({cfg.learner.staleness})",
    )
    if rows:
        r = rows[-1]
        t.add_row("bubble ratio", f"{r.bubble_ratio:.3f}")
        t.add_row("admitted samples", str(r.admitted))
        t.add_row("dropped stale samples", str(r.dropped_stale))
        t.add_row("rejected records", str(sum((r.rejected or {}).values())))
        t.add_row(
            "learner bytes sent (snapshots)", f"{(r.learner_bytes_sent or 0) / 2**20:.1f} MiB"
        )
        t.add_row("workers at the end", f"{r.active_workers} active, {r.standby_workers} standby")
        t.add_row("fleet cost of the run", f"${sum(x.cost_step_usd or 0.0 for x in rows):.4f}")
        decisions = run_dir / "decisions.jsonl"
        if decisions.exists():
            t.add_row("provisioner decisions", str(len(decisions.read_text().splitlines())))
        t.add_row("wall time", f"{r.wall_s:.1f} s")
    for name, score in _heldout(run_dir).items():
        t.add_row(name, score)
    return t


def _heldout(run_dir: Path) -> dict[str, str]:
    """The in-run held-out scores (learner.heldout): the first, the last and the best."""
    path = run_dir / "heldout.jsonl"
    if not path.exists():
        return {}
    scores: list[HeldoutScoreJson] = [
        json.loads(line) for line in path.read_text().splitlines() if line.strip()
    ]
    if not scores:
        return {}
    best = max(scores, key=lambda s: s["mean"])

    def say(s: HeldoutScoreJson) -> str:
        return f"{s['mean']:.3f} [{s['lo']:.3f}, {s['hi']:.3f}] after {s['steps']} steps"

    return {
        "held-out, first": say(scores[0]),
        "held-out, last": say(scores[-1]),
        "held-out, best (checkpoints/best.pt)": say(best),
    }


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def run_quickstart(
    cfg: EchoConfig,
    config_path: str | None,
    overrides: list[str],
    run_dir: Path,
    workers: int | None,
) -> int:
    # Explicit handlers: a shell that starts us in the background ignores SIGINT, and SIGTERM
    # from a supervisor must stop the children just like Ctrl-C.
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    run_dir.mkdir(parents=True, exist_ok=True)
    n = workers or cfg.quickstart.workers
    prices = cfg.quickstart.worker_prices
    group = ProcessGroup()
    # The learner gets the config exactly as resolved here (file plus overrides).
    resolved = run_dir / "quickstart.toml"
    resolved.write_text(dump_toml(cfg))
    learn_args = ["learn", str(resolved), "--run-dir", str(run_dir)]
    tail = MetricsTail(run_dir / "metrics.jsonl")
    try:
        learner = group.start(
            "learner",
            python_argv("echo_rl.cli.rl", *learn_args),
            run_dir / "learner.stderr.log",
            pipe_stdout=True,
        )
        console.print(
            f"[bold]Echo quickstart[/] run folder [cyan]{run_dir}[/]; starting learner..."
        )
        try:
            endpoint = wait_ready(learner, timeout=180)
        except RuntimeError as err:  # a start-up error: one line with its fix, no traceback
            print(f"echo-rl quickstart: {_startup_error(run_dir, err)}", file=sys.stderr)
            return 1
        # soft_wrap: the join line must stay one line (a volunteer copies it whole)
        console.print(f"learner at [cyan]{endpoint}[/]; starting {n} workers", soft_wrap=True)
        info = json.loads((run_dir / "learner.json").read_text())
        if "metrics" in info:
            console.print(
                f"dashboard: [cyan]{info['metrics']}/[/]  (Prometheus: {info['metrics']}/metrics)"
            )
        plain = [] if cfg.security.curve else ["--insecure"]  # security.curve=false: plaintext
        line = workers_line(cfg, endpoint, run_dir, n)
        for i in range(n):
            price = prices[i % len(prices)]
            # Each worker is its own identity: one key pair per worker, kept in the run folder.
            group.start(
                f"worker-{i}",
                python_argv(
                    "echo_rl.cli.worker",
                    "join",
                    line,
                    "--id",
                    f"worker-{i}",
                    "--price",
                    str(price),
                    *plain,
                    "--identity",
                    str(run_dir / "keys" / f"worker-{i}.key"),
                    "--status-file",
                    str(run_dir / "status" / f"worker-{i}.json"),
                ),
                run_dir / f"worker-{i}.log",
            )
        _follow(cfg, learner, tail)
        code = learner.wait()
    except KeyboardInterrupt:
        console.print("[yellow]interrupted: stopping learner and workers[/]")
        code = 130
    finally:
        group.stop_all()
    tail.poll()
    console.print(summary_table(cfg, tail.rows, run_dir))
    if code not in (0, 130):
        console.print(f"[red]learner exited with code {code}; see {run_dir}/learner.log[/]")
    console.print(f"metrics: {run_dir / 'metrics.jsonl'}")
    return code


def workers_line(cfg: EchoConfig, endpoint: str, run_dir: Path, n: int) -> str:
    """The join line the quickstart's own workers use: with ``security.join = "token"`` (a
    public config such as examples/public-try.toml, tried on one machine) a token for just
    these ``n`` workers, made as ``echo-rl token create`` makes one (before, its workers were
    refused ``token_required`` and the run never stepped); an allow-list names keys the
    quickstart cannot know, so it says how to run that config instead."""
    join = cfg.security.join
    if join == "open":
        return endpoint
    if join == "allowlist":
        raise SystemExit(
            "echo-rl quickstart: security.join = allowlist admits only listed keys: start the "
            "learner with echo-rl learn and workers with echo-worker join, or add "
            "--set 'security.join=\"token\"' to try this config here"
        )
    from echo_rl.core.security import TokenStore

    store = TokenStore(run_dir / "security" / "tokens.json")
    token = store.create(n, 7 * 24 * 3600.0, note="echo-rl quickstart's own workers")
    return f"{endpoint}?token={token}"


def _startup_error(run_dir: Path, err: Exception) -> str:
    """What stopped the learner before it was ready: the last line it wrote on stderr (its
    start-up errors are one line that names the fix), else ``err``; and where its log is."""
    log = run_dir / "learner.stderr.log"
    try:
        lines = [x for x in log.read_text(errors="replace").splitlines() if x.strip()]
    except OSError:
        lines = []
    last = (lines[-1].strip() if lines else str(err)).removeprefix("echo-rl learn: ")
    return f"the learner stopped at start-up: {last} (log: {log})"


PLAIN_EVERY_S = 10.0  # without a terminal: one progress line this often


def _follow(cfg: EchoConfig, learner: subprocess.Popen[bytes], tail: MetricsTail) -> None:
    """A live progress bar on a terminal; without one (a pipe, CI, a log file) a bar would be
    cut to the terminal width rich assumes, so plain lines instead, every 10 s and at the end."""
    if not console.is_terminal:
        return _follow_plain(cfg, learner, tail)
    columns = [
        TextColumn("[bold]step"),
        MofNCompleteColumn(),
        BarColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.description}"),
    ]
    with Progress(*columns, console=console, refresh_per_second=4) as progress:
        task = progress.add_task("waiting for workers...", total=cfg.learner.max_steps)
        while True:
            done = learner.poll() is not None
            for row in tail.poll():
                progress.update(task, completed=(row.step or 0) + 1, description=_describe(row))
            if done:
                return
            _wait(learner, 0.5)  # wake on exit, or redraw twice a second


def _follow_plain(cfg: EchoConfig, learner: subprocess.Popen[bytes], tail: MetricsTail) -> None:
    last, shown, row = time.monotonic(), None, None
    while True:
        done = learner.poll() is not None
        row = ([row, *tail.poll()])[-1]  # the newest row, if any came
        if (
            row is not None
            and row is not shown
            and (done or time.monotonic() - last >= PLAIN_EVERY_S)
        ):
            print(
                f"step {(row.step or 0) + 1}/{cfg.learner.max_steps}  {_plain(_describe(row))}",
                flush=True,
            )
            last, shown = time.monotonic(), row
        if done:
            return
        _wait(learner, 0.5)


def _plain(text: str) -> str:
    """A rich markup line as plain text."""
    from rich.text import Text

    return Text.from_markup(text).plain


def _wait(learner: subprocess.Popen[bytes], seconds: float) -> None:
    try:
        learner.wait(seconds)
    except subprocess.TimeoutExpired:
        pass
