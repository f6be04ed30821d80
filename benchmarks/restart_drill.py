"""Restart drill (issue 39): SIGKILL the learner, ``--resume`` it, the same workers carry on.

Each round, as an operator would meet it: a learner with provisioning on (the quickstart's
3-second windows) and two volunteers (``echo-worker join LINE --price 0.3``, real processes on
loopback); the learner is SIGKILLed once it has written ``kill_at`` metrics lines, then started
again with ``--resume`` on the same port; the same worker processes notice, re-join and go on.
Per round it records:

  * ``restart_to_step_s``: from the resumed learner's start (process spawned) to its first new
    metrics line, and ``ready_to_step_s`` from its ready line;
  * ``releases_after_restart``: provisioner releases in the resumed run (``decisions.jsonl``),
    and how many of them were failed probations;
  * ``restored_leases`` / ``restored_admitted``: leases kept from before the crash and the
    samples admitted under them (``echo_rl.control.grants``);
  * ``lost``: samples a worker saw acknowledged that were neither trained, buffered nor a
    counted stale drop (``echo_rl.learner.run_audit``), and ``trained_twice``: groups trained twice; both
    must be 0.

    python benchmarks/restart_drill.py --rounds 20 --out benchmarks/results/restart_drill.json

prints a table and writes the rounds with the machine they ran on. ``tests/test_restart.py``
runs one round.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from echo_rl.core.config import EchoConfig, dump_toml  # noqa: E402
from echo_rl.core.procs import ProcessGroup, pin_learner_port, python_argv, wait_ready  # noqa: E402
from echo_rl.core.steprow import COL  # noqa: E402

BATCHES = {  # (prompts_per_step, group_size, max_outstanding_groups, buffer capacity)
    "small": (4, 4, 0, 16),  # fast rounds (tests/test_restart.py)
    "quickstart": (32, 16, 40, 256),  # examples/quickstart.toml's batch: a first step longer
    # than the 3-second probation window
}


def drill_config(batch: str = "small") -> EchoConfig:
    """The quickstart's provisioning (3-second windows) on the toy task; the learner's port is
    pinned by the drill (pin_learner_port), so the resumed learner comes back on it."""
    prompts, group, outstanding, capacity = BATCHES[batch]
    return EchoConfig.model_validate(
        {
            "learner": {
                "prompts_per_step": prompts,
                "group_size": group,
                "max_steps": 10_000,
                "staleness": 2,
                "wait_timeout_s": 120,
                "lease_timeout_s": 30.0,
                "max_outstanding_groups": outstanding,
            },
            "buffer": {"capacity_groups": capacity},
            "worker": {"groups_per_request": 2, "heartbeat_s": 0.3},
            "transport": {
                "heartbeat_timeout_s": 3.0,
                "request_timeout_s": 3.0,
                "max_message_mib": 1.0,
            },
            "broadcast": {"dtype": "float32", "chunk_mib": 0.0625},
            "provisioning": {
                "enabled": True,
                "initial_active": 2,
                "window_s": 3.0,
                "tau_s": 3.0,
                "warmup_s": 2.0,
            },
        }
    )


@dataclass
class Round:
    kill_at: int
    killed_after_step: int
    resumed_at_step: int
    restart_to_step_s: float
    ready_to_step_s: float
    steps_after_restart: int
    releases_after_restart: int
    failed_probations_after_restart: int
    restored_leases: int
    restored_admitted: int
    acked: int
    lost: int
    trained_twice: int
    workers_exit: list[int | None]


def _rows(run: Path) -> list[dict]:
    p = run / "metrics.jsonl"
    return [json.loads(x) for x in p.read_text().splitlines() if x.strip()] if p.exists() else []


def _wait(pred, timeout: float, what: str, poll: float = 0.05):
    """Polls files the learner appends to (it has no other progress signal)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(poll)
    raise TimeoutError(f"{what} within {timeout:.0f} s")


class Drill:
    def __init__(self, tmp: Path, steps_after: int = 8, batch: str = "small"):
        self.tmp, self.steps_after = tmp, steps_after
        self.group = ProcessGroup()
        self.cfg = drill_config(batch)
        pin_learner_port(self.cfg)
        self.run = tmp / "run"

    def learner(self, name: str, resume: bool, max_steps: int) -> tuple[float, float]:
        cfg = self.cfg.model_copy(deep=True)
        cfg.learner.max_steps = max_steps
        conf = self.tmp / f"{name}.toml"
        conf.write_text(dump_toml(cfg))
        where = ["--resume", str(self.run)] if resume else ["--run-dir", str(self.run)]
        t0 = time.monotonic()
        proc = self.group.start(
            name,
            python_argv("echo_rl.cli.rl", "learn", str(conf), *where),
            self.tmp / f"{name}.err",
            pipe_stdout=True,
        )
        self.endpoint = wait_ready(proc, timeout=120)
        return t0, time.monotonic()

    def worker(self, name: str) -> None:
        self.group.start(
            name,
            python_argv(
                "echo_rl.cli.worker",
                "join",
                self.endpoint,
                "--id",
                name,
                "--price",
                "0.3",
                "--ledger",
                str(self.tmp / f"{name}.ledger"),
                "--identity",
                str(self.tmp / f"{name}.key"),
            ),
            self.tmp / f"{name}.log",
        )

    def round(self, kill_at: int) -> Round:
        from echo_rl.learner.checkpoint import load_checkpoint
        from echo_rl.learner.run_audit import audit_run

        self.learner("first", False, 10_000)
        workers = ["w0", "w1"]
        for w in workers:
            self.worker(w)
        _wait(lambda: len(_rows(self.run)) >= kill_at, 180, f"{kill_at} learner steps")
        self.group.stop("first", sig=signal.SIGKILL)
        killed_after = _rows(self.run)[-1]["step"]
        decisions = self.run / "decisions.jsonl"
        before = len(decisions.read_text().splitlines()) if decisions.exists() else 0
        resumed_at = load_checkpoint(self.run)["step"] + 1
        t0, ready = self.learner("second", True, resumed_at + self.steps_after)
        n_before = resumed_at  # the resume trims metrics to the checkpoint
        first = _wait(lambda: len(_rows(self.run)) > n_before, 120, "a step after the restart")
        t_step = time.monotonic()
        assert first
        code = self.group.procs["second"].wait(180)
        exits = [self.group.procs[w].wait(60) for w in workers]
        rows = _rows(self.run)
        after = (
            [json.loads(x) for x in decisions.read_text().splitlines()[before:]]
            if decisions.exists()
            else []
        )
        releases = [d for d in after if d["action"] == "release"]
        audit = audit_run(
            self.run, [self.tmp / f"{w}.ledger" for w in workers], self.cfg.learner.group_size
        )
        if code != 0:
            raise RuntimeError(f"resumed learner exited {code}: see {self.tmp / 'second.err'}")
        return Round(
            kill_at=kill_at,
            killed_after_step=killed_after,
            resumed_at_step=resumed_at,
            restart_to_step_s=round(t_step - t0, 3),
            ready_to_step_s=round(t_step - ready, 3),
            steps_after_restart=len(rows) - n_before,
            releases_after_restart=len(releases),
            failed_probations_after_restart=sum("probation over" in d["reason"] for d in releases),
            restored_leases=rows[-1].get(COL.restored_leases, 0),
            restored_admitted=rows[-1].get(COL.restored_admitted, 0),
            acked=len(audit.acked),
            lost=len(audit.lost),
            trained_twice=audit.groups_trained_twice,
            workers_exit=exits,
        )

    def close(self) -> None:
        self.group.stop_all()


def one_round(tmp: Path, kill_at: int, batch: str = "small") -> Round:
    drill = Drill(tmp, batch=batch)
    try:
        return drill.round(kill_at)
    finally:
        drill.close()


def table(rounds: list[Round]) -> str:
    head = (
        "| # | killed after step | resumed at | restart -> next step (s) | ready -> step (s) | "
        "releases after | leases kept | samples admitted under them | acked | lost |\n"
        "|---|---|---|---|---|---|---|---|---|---|\n"
    )
    return head + "".join(
        f"| {i} | {r.killed_after_step} | {r.resumed_at_step} | {r.restart_to_step_s:.1f} | "
        f"{r.ready_to_step_s:.1f} | {r.releases_after_restart} | {r.restored_leases} | "
        f"{r.restored_admitted} | {r.acked} | {r.lost} |\n"
        for i, r in enumerate(rounds)
    )


def main(argv: list[str] | None = None) -> int:
    import tempfile

    from echo_rl.core.machine import write_result

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument(
        "--batch",
        choices=sorted(BATCHES),
        default="small",
        help="small (4 prompts x 4) or quickstart (32 x 16, as examples/quickstart.toml)",
    )
    ap.add_argument("--max-kill", type=int, default=30, help="kills land at steps 3 .. 3 + this")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/restart_drill.json")
    args = ap.parse_args(argv)
    rounds: list[Round] = []
    failures: list[str] = []
    for i in range(args.rounds):
        kill_at = 3 + (i * 7) % args.max_kill  # varied: 3, 10, 17, 24, 31, 8, ...
        with tempfile.TemporaryDirectory(prefix="echo-restart-") as tmp:
            try:
                r = one_round(Path(tmp), kill_at, args.batch)
            except (TimeoutError, RuntimeError) as err:
                failures.append(f"round {i} (kill at {kill_at}): {err}")
                print(f"round {i}: FAILED: {err}", flush=True)
                continue
        rounds.append(r)
        print(
            f"round {i}: killed after step {r.killed_after_step}, next step "
            f"{r.restart_to_step_s:.1f} s after the restart, {r.releases_after_restart} "
            f"releases, {r.restored_admitted} samples admitted under kept leases, "
            f"{r.lost} lost",
            flush=True,
        )
    ok = [
        r
        for r in rounds
        if r.restart_to_step_s <= 30
        and r.lost == 0
        and r.trained_twice == 0
        and r.failed_probations_after_restart == 0
        and r.steps_after_restart >= 1
    ]
    summary = {
        "rounds": args.rounds,
        "passed": len(ok),
        "failures": failures,
        "restart_to_step_s_max": max((r.restart_to_step_s for r in rounds), default=None),
        "restored_admitted_total": sum(r.restored_admitted for r in rounds),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_result(
        args.out,
        {
            "command": "python benchmarks/restart_drill.py " + " ".join(argv or sys.argv[1:]),
            "summary": summary,
            "rounds": [asdict(r) for r in rounds],
        },
    )
    print(table(rounds))
    print(
        f"{len(ok)} of {args.rounds} rounds: training went on within 30 s of the restart, "
        f"no failed probation, nothing acknowledged lost"
    )
    return 0 if len(ok) == args.rounds else 1


if __name__ == "__main__":
    sys.exit(main())
