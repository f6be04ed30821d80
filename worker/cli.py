"""``echo-worker``: the volunteer's entry point. Heavy imports happen after parsing."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="echo-worker", description="Run an Echo rollout worker.")
    sub = p.add_subparsers(dest="cmd", required=True)
    j = sub.add_parser("join", help="join a learner and generate rollouts until told to stop")
    j.add_argument(
        "learner",
        help="the join line the learner printed: echo://HOST:PORT/KEY[?token=T] "
        "(or tcp://HOST:PORT with --insecure, for a plaintext learner)",
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
        choices=["transformers", "vllm"],
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


def main(argv: list[str] | None = None, make_worker: Callable[..., Any] | None = None) -> int:
    """``make_worker`` (default ``worker.agent.Worker``) builds the worker from the parsed
    arguments: the security drill passes one that lies (benchmarks/drill_workers.py)."""
    args = build_parser().parse_args(argv)
    if args.cmd == "status":
        return _status(args)
    if args.cmd == "preempt":
        return _preempt(args)
    if args.cmd == "doctor":
        return _doctor(args)
    from echo.security import JoinLine, KeyPair, SecurityError, default_identity_path

    try:
        line = JoinLine.parse(args.learner)
        if line.server_key is None and not args.insecure:
            raise SecurityError(
                f"{args.learner!r} carries no learner key: use the join line the "
                f"learner printed (echo://HOST:PORT/KEY), or --insecure for a "
                f"plaintext learner"
            )
        if args.token:
            line = JoinLine(line.endpoint, line.server_key, args.token)
        keys = KeyPair.load_or_create(args.identity or default_identity_path())
    except SecurityError as exc:
        print(f"echo-worker: {exc}", file=sys.stderr)
        return 2
    if args.device is not None:
        from echo.config import check_device

        try:
            check_device(args.device)
        except ValueError as exc:
            print(f"echo-worker: --device: {exc}", file=sys.stderr)
            return 2
    for flag, port in (("--relay-port", args.relay_port), ("--punch-port", args.punch_port)):
        if port is not None and not 0 <= port <= 65535:
            print(
                f"echo-worker: {flag} {port} is not a port: give 1-65535, or 0 to let the OS pick",
                file=sys.stderr,
            )
            return 2
    if args.give_up_after is not None and not args.give_up_after > 0:
        print(
            f"echo-worker: --give-up-after {args.give_up_after:g}: give a number of seconds "
            f"> 0, or leave it out to keep trying",
            file=sys.stderr,
        )
        return 2
    if args.price < 0:
        print("echo-worker: --price must be >= 0 (USD per hour)", file=sys.stderr)
        return 2
    import asyncio
    import logging
    from pathlib import Path

    from rich.console import Console

    from worker import status as st

    live = sys.stdout.isatty() and not args.plain
    console = Console()
    if live:  # log lines scroll above the live view instead of tearing it
        from rich.logging import RichHandler

        logging.basicConfig(
            level=args.log_level.upper(),
            format="%(name)s: %(message)s",
            handlers=[RichHandler(console=console, show_path=False)],
        )
    else:
        logging.basicConfig(
            level=args.log_level.upper(),
            stream=sys.stderr,
            format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        )
    from broadcast.relay import RelayConfig
    from worker.agent import Worker, WorkerError

    relay_port, punch_port = relay_ports(args.relay_host, args.relay_port, args.punch_port)
    relay = RelayConfig(
        bind_host=args.relay_host,
        port=relay_port,
        serve=not args.no_relay,
        punch_host=args.punch_host or _punch_host(args.relay_host, line.endpoint),
        punch_port=punch_port,
        down_mbit=args.down_mbit,
        up_mbit=args.up_mbit,
        spill_dir="" if args.no_spill else str(_spill_dir(args.spill_dir)),
    )

    make = make_worker or Worker
    owner = None
    if args.yield_to_owner:
        from worker.owner import make_signal

        try:
            owner = make_signal(
                args.owner_signal,
                quiet_s=args.owner_quiet_s,
                cpu_cores=args.owner_cpu_cores,
                path=args.owner_file,
            )
        except ValueError as exc:
            print(f"echo-worker: {exc}", file=sys.stderr)
            return 2
    view = st.LiveView(console) if live else st.PlainView(logging.getLogger("echo.worker.status"))
    board = st.StatusBoard(args.worker_id or "", line.endpoint, args.price, None)
    worker = make(
        line,
        worker_id=args.worker_id,
        price=args.price,
        threads=args.threads,
        ledger=args.ledger,
        relay=relay,
        keys=keys,
        backend=args.backend,
        device=args.device,
        status=board,
        show=view.show,
        migrate=not args.no_migrate,
        owner=owner,
        give_up_after_s=args.give_up_after,
        host_memory_gb=args.host_memory_gb,
    )
    # The worker settled its id (from its key, unless --id): the file is named after it.
    board.path = (
        Path(args.status_file)
        if args.status_file
        else st.default_status_dir() / f"{board.doc.worker_id or 'worker'}.json"
    )
    if make_worker is None:  # the worker this module builds loads its model with them
        from worker.backends import warm

        # Torch and transformers load while the worker joins: started once this thread's own
        # imports are done, so the two do not take turns on the GIL (on a busy machine that
        # made both slower), and this thread mostly waits on the network from here on.
        warm(args.backend)
    try:
        with view:
            reason = asyncio.run(worker.run())
    except (WorkerError, BaseExceptionGroup) as eg:  # a group: out of the worker's TaskGroup
        if isinstance(eg, WorkerError):
            eg = BaseExceptionGroup("worker", [eg])
        fatal, rest = eg.split(WorkerError)
        if rest is not None or fatal is None:
            raise
        errors = [str(e) for e in _leaves(fatal)]
        board.update(exit=errors[0])
        board.flush(force=True)
        _summary(console, board)
        for e in errors:
            print(f"echo-worker: {e}", file=sys.stderr)
        if _loading():
            _leave_now(1)
        return 1
    logging.getLogger("echo.worker").info("exited: %s", reason or "done")
    _summary(console, board)
    if _loading():
        _leave_now(0)
    return 0


def _doctor(args: argparse.Namespace) -> int:
    """``echo-worker doctor LINE``: each check's verdict and fix; 1 when any failed."""
    import asyncio
    from pathlib import Path

    from echo.addresses import is_loopback
    from echo.doctor import show
    from echo.security import JoinLine, KeyPair, SecurityError, default_identity_path

    try:
        line = JoinLine.parse(args.learner)
        if line.server_key is None and not args.insecure:
            raise SecurityError(
                f"{args.learner!r} carries no learner key: give the join line "
                f"the learner printed (echo://HOST:PORT/KEY), or --insecure"
            )
        if args.token:
            line = JoinLine(line.endpoint, line.server_key, args.token)
        path = Path(args.identity) if args.identity else default_identity_path()
        keys = KeyPair.load(path) if path.exists() else KeyPair.generate()
    except SecurityError as exc:
        print(f"echo-worker doctor: {exc}", file=sys.stderr)
        return 2
    if args.relay_port is not None and not 0 <= args.relay_port <= 65535:
        print(
            f"echo-worker doctor: --relay-port {args.relay_port} is not a port: give "
            f"1-65535, or 0 to let the OS pick",
            file=sys.stderr,
        )
        return 2
    from worker.doctor import diagnose

    relay_port = args.relay_port
    if relay_port is None and not is_loopback(args.relay_host):
        relay_port = relay_ports(args.relay_host, None, None)[0]
    punch = args.punch_host or _punch_host(args.relay_host, line.endpoint)
    checks = asyncio.run(
        diagnose(line, keys if line.server_key else None, args.relay_host, relay_port, punch)
    )
    return show(checks)


def _loading() -> bool:
    """A stop came while the model's libraries were still loading (worker.agent's threads)."""
    import threading

    return any(t.name in ("echo-load", "echo-warm") and t.is_alive() for t in threading.enumerate())


def _leave_now(code: int) -> None:
    """Exit without unwinding a half-imported torch: the interpreter's teardown of it, beside
    a thread still importing, took seconds of a stop that must end within 5 (issue 30). The
    status file is written and the summary printed by now; the logs and streams are flushed."""
    import logging
    import os

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _summary(console: Any, board: Any) -> None:
    from worker.status import table

    console.print(table(board.doc, title=f"echo-worker {board.doc.worker_id}: summary"))
    if board.path is not None:
        console.print(f"status file: {board.path}")


def _preempt(args: argparse.Namespace) -> int:
    """``echo-worker preempt --in S``: write the deadline next to the worker's status file and
    wake it with SIGUSR1 (the worker's own pid, from its status file)."""
    import json
    import os
    import signal
    import time
    from pathlib import Path

    from worker.status import default_status_dir, latest_status, notice_path, read_status

    try:
        path = Path(args.file) if args.file else latest_status(default_status_dir())
        doc = read_status(path)
    except ValueError as exc:
        print(f"echo-worker preempt: {exc}", file=sys.stderr)
        return 1
    pid = doc.pid
    if doc.exit or not _alive(pid, os):
        print(f"echo-worker preempt: the worker of {path} is not running", file=sys.stderr)
        return 1
    if not args.seconds >= 0:
        print("echo-worker preempt: --in must be >= 0 seconds", file=sys.stderr)
        return 2
    notice_path(path).write_text(json.dumps({"deadline": time.time() + args.seconds}))
    os.kill(pid, signal.SIGUSR1)
    print(f"told worker {doc.worker_id} (pid {pid}): reclaimed in {args.seconds:g} s")
    return 0


def _status(args: argparse.Namespace) -> int:
    """``echo-worker status``: the table from a worker's status file."""
    import json
    import os
    import time
    from pathlib import Path

    from rich.console import Console

    from worker.status import default_status_dir, latest_status, read_status, table

    try:
        path = Path(args.file) if args.file else latest_status(default_status_dir())
        doc = read_status(path)
    except ValueError as exc:
        print(f"echo-worker status: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(doc.to_json(), indent=1))
        return 0
    age = time.time() - doc.updated_at
    running = not doc.exit and _alive(doc.pid, os)
    Console().print(
        table(
            doc,
            title=f"echo-worker {doc.worker_id} "
            f"({'running' if running else 'not running'}; "
            f"updated {age:.0f} s ago)",
        )
    )
    return 0


def _alive(pid: int, os: Any) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)  # signal 0: is there such a process (it may be another's by now)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _leaves(eg: BaseExceptionGroup) -> list[BaseException]:
    """The errors inside ``eg``, however deeply nested: a refusal met by a delivery task arrives
    inside the deliveries' own TaskGroup, and its message must reach the user."""
    return [
        leaf
        for e in eg.exceptions
        for leaf in (_leaves(e) if isinstance(e, BaseExceptionGroup) else [e])
    ]


def relay_ports(relay_host: str, relay_port: int | None, punch_port: int | None) -> tuple[int, int]:
    """The relay's and the punch socket's ports (docs/ports.md): fixed (5560 and 5561) when
    the relay listens beyond loopback, so a public volunteer knows what to open; on loopback
    (several workers on one machine, tests) the OS picks. 0 always means the OS picks."""
    from echo.addresses import is_loopback
    from echo.config import DEFAULT_RELAY_PORT

    if relay_port is None:
        relay_port = 0 if is_loopback(relay_host) else DEFAULT_RELAY_PORT
    if punch_port is None:
        punch_port = relay_port + 1 if 0 < relay_port < 65535 else 0
    return relay_port, punch_port


def _gigabytes(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:  # NaN too
        raise argparse.ArgumentTypeError(f"{text!r}: give a number of GB, 0 or more (0: no budget)")
    return value


def _spill_dir(given: str | None) -> Path:
    from echo.spill import spill_dir

    return spill_dir(given)


def _punch_host(relay_host: str, learner: str) -> str:
    """Probes must reach the learner: a loopback relay host (the default) only serves when the
    learner is local too; otherwise probe and punch from every interface (docs/nat.md)."""
    local = ("127.", "localhost", "::1")
    learner_host = learner.removeprefix("tcp://").rpartition(":")[0]
    if relay_host.startswith(local) and not learner_host.startswith(local):
        return "0.0.0.0"
    return relay_host


if __name__ == "__main__":
    sys.exit(main())
