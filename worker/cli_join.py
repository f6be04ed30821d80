"""``echo-worker join``: check the flags, build the worker, run it until told to stop, and
print its summary. ``worker/cli.py`` parses the command line and calls ``join`` here; the heavy
imports happen inside it, after parsing."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


def join(args: argparse.Namespace, make_worker: Callable[..., Any] | None = None) -> int:
    """``make_worker`` (default ``worker.agent.Worker``) builds the worker from the parsed
    arguments: the security drill passes one that lies (benchmarks/drill_workers.py)."""
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
        punch_host=args.punch_host or punch_host(args.relay_host, line.endpoint),
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


def _spill_dir(given: str | None) -> Path:
    from echo.spill import spill_dir

    return spill_dir(given)


def punch_host(relay_host: str, learner: str) -> str:
    """Probes must reach the learner: a loopback relay host (the default) only serves when the
    learner is local too; otherwise probe and punch from every interface (docs/nat.md)."""
    local = ("127.", "localhost", "::1")
    learner_host = learner.removeprefix("tcp://").rpartition(":")[0]
    if relay_host.startswith(local) and not learner_host.startswith(local):
        return "0.0.0.0"
    return relay_host
