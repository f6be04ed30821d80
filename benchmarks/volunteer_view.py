"""The volunteer's live view, captured from a real terminal (docs/volunteers.md).

    python benchmarks/volunteer_view.py [--seconds 45] [--out docs/img/volunteer-live.txt]

Starts a quickstart learner on loopback, then ``echo-worker join`` inside a tmux session of
100 x 40 (a real pseudo-terminal, so the worker draws its live table), waits, captures the pane
as text, stops the worker with SIGTERM (its exit summary is captured too) and the learner.
Needs tmux (Debian package ``tmux``).
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from echo_rl.core.procs import ProcessGroup, python_argv, wait_ready  # noqa: E402


def tmux(*args: str) -> str:
    return subprocess.run(["tmux", *args], check=True, capture_output=True, text=True).stdout


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=45.0, help="how long the worker runs first")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "img" / "volunteer-live.txt")
    args = p.parse_args(argv)
    if shutil.which("tmux") is None:
        print("volunteer_view.py: needs tmux (apt-get install tmux)", file=sys.stderr)
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="echo-volunteer-"))
    group = ProcessGroup()
    session = f"echo-volunteer-{tmp.name[-8:]}"
    try:
        learner = group.start(
            "learner",
            python_argv(
                "echo_rl.cli.rl",
                "learn",
                str(ROOT / "examples" / "quickstart.toml"),
                "--run-dir",
                str(tmp / "run"),
                "--set",
                "learner.max_steps=100000",
            ),
            tmp / "learner.log",
            pipe_stdout=True,
        )
        line = wait_ready(learner, timeout=120)
        worker = python_argv(
            "echo_rl.cli.worker",
            "join",
            line,
            "--price",
            "0.35",
            "--id",
            "volunteer-1",
            "--identity",
            str(tmp / "w.key"),
            "--status-file",
            str(tmp / "status.json"),
            "--log-level",
            "WARNING",
        )
        tmux(
            "new-session",
            "-d",
            "-s",
            session,
            "-x",
            "100",
            "-y",
            "40",
            f"cd {shlex.quote(str(ROOT))} && {shlex.join(worker)}; sleep 600",
        )
        time.sleep(args.seconds)  # the view is looked at after a while of work, not an event
        live = tmux("capture-pane", "-p", "-t", session)
        pane_pid = tmux("list-panes", "-t", session, "-F", "#{pane_pid}").strip()
        subprocess.run(
            ["pkill", "-TERM", "-P", pane_pid], check=False
        )  # the worker: the pane's child
        time.sleep(8)  # the worker finishes its group, says leave, prints its summary
        summary = tmux("capture-pane", "-p", "-t", session)
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], check=False, capture_output=True)
        group.stop_all()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        "# live view, after %.0f s\n%s\n# after SIGTERM: the exit summary\n%s"  # noqa: UP031
        % (args.seconds, live.rstrip(), summary.rstrip() + "\n")
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
