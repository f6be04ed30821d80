"""``echo-worker``: the volunteer's entry point. Heavy imports happen after parsing."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from echo_rl.cli.worker_join import relay_ports  # noqa: F401  (tests import it from here)

if TYPE_CHECKING:
    from echo_rl.worker.agent import Worker


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="echo-worker", description="Run an Echo rollout worker.")
    sub = p.add_subparsers(dest="cmd", required=True)
    j = sub.add_parser("join", help="join a learner and generate rollouts until told to stop")
    j.add_argument(
        "learner",
        nargs="*",
        help="the join line the learner printed: echo://HOST:PORT/KEY[?token=T] "
        "(or tcp://HOST:PORT with --insecure, for a plaintext learner); several lines: "
        "serve several runs, sharing this machine (docs/multirun.md)",
    )
    j.add_argument(
        "--runs",
        default=None,
        metavar="FILE",
        help="the runs to serve, as [[run]] tables (line, share, price) in a TOML file, "
        "instead of join lines (docs/multirun.md)",
    )
    j.add_argument(
        "--share",
        type=_shares,
        default=None,
        metavar="W1,W2,...",
        help="with several join lines: each run's share of this machine, in their order "
        "(default: equal)",
    )
    j.add_argument(
        "--resident",
        type=int,
        default=1,
        metavar="K",
        help="with several runs: models kept on the GPU at once; the others wait in host "
        "memory (default 1)",
    )
    j.add_argument(
        "--identity",
        default=None,
        metavar="FILE",
        help="this worker's key pair (made on first use; default $ECHO_HOME/worker.key "
        "or ~/.config/echo/worker.key): the learner knows this worker by it",
    )
    j.add_argument(
        "--token",
        default="",
        help="join token from the learner's operator (same as ?token= in the join line)",
    )
    j.add_argument(
        "--insecure",
        action="store_true",
        help="talk plaintext to a learner started with security.curve off",
    )
    j.add_argument("--price", type=float, default=0.0, help="what this worker costs, USD per hour")
    j.add_argument("--id", dest="worker_id", default=None, help="worker id (default: random)")
    j.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (default: learner's)"
    )
    j.add_argument(
        "--ledger",
        default=None,
        metavar="FILE",
        help="append one JSON line per acknowledged batch: what the learner stored",
    )
    j.add_argument(
        "--relay-host",
        default="127.0.0.1",
        help="address this worker serves snapshot chunks on, for its chain child "
        "(public workers: an address others can reach; behind a home router "
        "any local address works, children come through punched links, "
        "docs/nat.md; default loopback)",
    )
    j.add_argument(
        "--relay-port",
        type=int,
        default=None,
        metavar="PORT",
        help="TCP port the relay listens on: open it to others if this worker is "
        "public (default 5560 when --relay-host is not loopback, else the OS "
        "picks; 0: the OS picks; docs/ports.md)",
    )
    j.add_argument(
        "--punch-port",
        type=int,
        default=None,
        metavar="PORT",
        help="TCP port NAT probes and punched links use (default: relay port + 1 "
        "when the relay port is fixed, else the OS picks; 0: the OS picks)",
    )
    j.add_argument(
        "--punch-host",
        default=None,
        help="address NAT probes and punched links leave from (default: the relay "
        "host, or 0.0.0.0 when that is loopback and the learner is not)",
    )
    j.add_argument(
        "--no-relay",
        action="store_true",
        help="never relay, even through punched links (placed at a chain tail)",
    )
    j.add_argument(
        "--spill-dir",
        default=None,
        metavar="DIR",
        help="where whole snapshot versions kept for later live, as files read "
        "through memory maps (default $ECHO_HOME/spill or ~/.cache/echo/spill; "
        "docs/memory.md)",
    )
    j.add_argument(
        "--host-memory-gb",
        type=_gigabytes,
        default=0.0,
        metavar="GB",
        help="host memory this worker may use, in GiB (default: no budget). It says at "
        "start-up what serving the run needs; over budget it generates in "
        "bfloat16 (unless the run fixes worker.dtype), and a run that cannot "
        "fit is refused with what it needs (docs/memory.md)",
    )
    j.add_argument(
        "--no-spill",
        action="store_true",
        help="keep those versions in RAM instead (faster disks are not needed; more memory is)",
    )
    j.add_argument("--down-mbit", type=float, default=0.0, help="declared download rate, Mbit/s")
    j.add_argument("--up-mbit", type=float, default=0.0, help="declared upload rate, Mbit/s")
    j.add_argument(
        "--backend",
        choices=["engine", "transformers", "vllm"],
        default=None,
        help="generation backend (default: the learner's worker.backend); vllm needs "
        "a CUDA GPU and pip install -e '.[vllm]' (docs/worker.md)",
    )
    j.add_argument(
        "--device",
        default=None,
        help="auto, cpu, cuda or cuda:N (default: the learner's worker.device)",
    )
    j.add_argument(
        "--status-file",
        default=None,
        metavar="FILE",
        help="where the worker keeps its status as JSON, for `echo-worker status` "
        "(default $ECHO_STATUS_DIR/ID.json or ~/.local/state/echo/workers/ID.json)",
    )
    j.add_argument(
        "--plain",
        action="store_true",
        help="no live view: one status line a minute in the log (the default without a terminal)",
    )
    j.add_argument(
        "--no-migrate",
        action="store_true",
        help="on SIGTERM finish the current groups instead of handing back what was "
        "generated (docs/preemption.md; the drill's baseline)",
    )
    j.add_argument(
        "--yield-to-owner",
        action="store_true",
        help="stop generating within a second when the machine's owner needs it, "
        "hand the work back, resume when it has been quiet (docs/preemption.md)",
    )
    j.add_argument(
        "--owner-signal",
        choices=["auto", "cpu", "nvml", "file"],
        default="auto",
        help="how the owner's work is seen: GPU processes (nvml; auto where there "
        "is one), other processes' CPU load (cpu), or a flag file (file)",
    )
    j.add_argument(
        "--owner-quiet-s",
        type=float,
        default=30.0,
        help="seconds without the owner's work before generating again",
    )
    j.add_argument(
        "--owner-cpu-cores",
        type=float,
        default=0.5,
        help="cpu signal: other processes using more than this many cores is the owner",
    )
    j.add_argument(
        "--owner-file",
        default="",
        metavar="PATH",
        help="file signal: the owner is busy while this file exists",
    )
    j.add_argument(
        "--give-up-after",
        type=float,
        default=None,
        metavar="SECONDS",
        help="stop when the learner has not answered a join this long (default: keep "
        "trying; after 30 s the worker says what to check either way)",
    )
    j.add_argument("--log-level", default="INFO")
    d = sub.add_parser(
        "doctor",
        help="check this host against a learner before joining: its "
        "ports, its key, this host's NAT, the relay port (docs/volunteers.md)",
    )
    d.add_argument("learner", help="the join line, as for join (quote it)")
    d.add_argument("--token", default="", help="join token (same as ?token= in the join line)")
    d.add_argument(
        "--identity",
        default=None,
        metavar="FILE",
        help="this worker's key pair, as for join (not created if missing: a "
        "throwaway key is used)",
    )
    d.add_argument("--insecure", action="store_true", help="a plaintext learner (tcp://HOST:PORT)")
    d.add_argument(
        "--relay-host",
        default="127.0.0.1",
        help="as for join: a public relay's address is checked from the learner",
    )
    d.add_argument(
        "--relay-port",
        type=int,
        default=None,
        metavar="PORT",
        help="as for join (default 5560 when --relay-host is not loopback)",
    )
    d.add_argument("--punch-host", default=None, help="as for join")
    s = sub.add_parser(
        "status", help="show a running (or finished) worker's status, from the file it keeps"
    )
    s.add_argument(
        "file",
        nargs="?",
        default=None,
        help="its status file (default: the newest in $ECHO_STATUS_DIR or "
        "~/.local/state/echo/workers)",
    )
    s.add_argument("--json", action="store_true", help="print the file's JSON as it is")
    n = sub.add_parser(
        "preempt",
        help="tell a running worker its machine goes away in SECONDS "
        "(a spot notice): it generates until just before, then hands its work "
        "back and leaves (docs/preemption.md)",
    )
    n.add_argument(
        "file",
        nargs="?",
        default=None,
        help="the worker's status file (default: the newest, as for status)",
    )
    n.add_argument(
        "--in",
        dest="seconds",
        type=float,
        required=True,
        metavar="SECONDS",
        help="seconds until the machine is reclaimed",
    )
    return p


def main(argv: list[str] | None = None, make_worker: Callable[..., Worker] | None = None) -> int:
    """``make_worker`` (default ``echo_rl.worker.agent.Worker``) builds the worker from the parsed
    arguments: the security drill passes one that lies (benchmarks/drill_workers.py)."""
    args = build_parser().parse_args(argv)
    from echo_rl.cli import worker_tools as cli_tools
    from echo_rl.cli.worker_join import join
    from echo_rl.core.errors import EchoError, describe

    try:
        if args.cmd == "status":
            return cli_tools.status(args)
        if args.cmd == "preempt":
            return cli_tools.preempt(args)
        if args.cmd == "doctor":
            return cli_tools.doctor(args)
        return join(args, make_worker)
    except EchoError as err:  # any of Echo's own errors not handled nearer: one line, its code
        print(f"echo-worker: {describe(err)}", file=sys.stderr)
        return 1


def _shares(text: str) -> list[float]:
    try:
        shares = [float(x) for x in text.split(",")]
    except ValueError:
        shares = []
    if not shares or not all(s > 0 for s in shares):
        raise argparse.ArgumentTypeError(f"{text!r}: give shares > 0, comma-separated (e.g. 2,1)")
    return shares


def _gigabytes(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:  # NaN too
        raise argparse.ArgumentTypeError(f"{text!r}: give a number of GB, 0 or more (0: no budget)")
    return value


if __name__ == "__main__":
    sys.exit(main())
