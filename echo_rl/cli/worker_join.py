"""``echo-worker join``: check the flags, build the worker, run it until told to stop, and
print its summary. ``echo_rl/cli/worker.py`` parses the command line and calls ``join`` here; the heavy
imports happen inside it, after parsing."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import logging

    from rich.console import Console

    from echo_rl.broadcast.relay import RelayConfig
    from echo_rl.core.security import KeyPair
    from echo_rl.worker.agent import Worker, WorkerSettings
    from echo_rl.worker.multirun import RunSpec
    from echo_rl.worker.owner.base import OwnerSignal
    from echo_rl.worker.sharing import Turns
    from echo_rl.worker.status import StatusBoard


def join(args: argparse.Namespace, make_worker: Callable[..., Worker] | None = None) -> int:
    """``make_worker`` (default ``echo_rl.worker.agent.Worker``) builds the worker from the parsed
    arguments: the security drill passes one that lies (benchmarks/drill_workers.py)."""
    from echo_rl.core.security import SecurityError

    lines = list(args.learner)
    if args.runs is None and len(lines) == 1:
        return _join_one(args, lines[0], make_worker)
    if args.token:
        print(
            "echo-worker join: --token is for one run; with several, put each run's token in "
            "its join line (echo://HOST:PORT/KEY?token=T) or its [[run]] line",
            file=sys.stderr,
        )
        return 2
    if (args.runs is None) == (not lines) or (args.runs is not None and lines):
        print(
            "echo-worker join: give the join line the learner printed (several to serve "
            "several runs), or --runs FILE, not both",
            file=sys.stderr,
        )
        return 2
    from echo_rl.worker.multirun import specs_from_args, specs_from_file

    try:
        specs = (
            specs_from_file(Path(args.runs))
            if args.runs is not None
            else specs_from_args(lines, args.share, args.price)
        )
    except SecurityError as exc:
        print(f"echo-worker: {exc}", file=sys.stderr)
        return 2
    return _join_many(args, specs, make_worker)


def _join_one(
    args: argparse.Namespace, text: str, make_worker: Callable[..., Worker] | None
) -> int:
    from echo_rl.core.security import JoinLine, SecurityError

    try:
        line = JoinLine.parse(text)
        if line.server_key is None and not args.insecure:
            raise SecurityError(
                f"{text!r} carries no learner key: use the join line the "
                f"learner printed (echo://HOST:PORT/KEY), or --insecure for a "
                f"plaintext learner"
            )
        if args.token:
            line = JoinLine(line.endpoint, line.server_key, args.token)
    except SecurityError as exc:
        print(f"echo-worker: {exc}", file=sys.stderr)
        return 2
    keys, owner, rc = _common(args)
    if rc is not None:
        return rc
    import asyncio

    from rich.console import Console

    from echo_rl.worker import status as st
    from echo_rl.worker.agent import StatusOut, Worker, WorkerError

    live = sys.stdout.isatty() and not args.plain
    console = Console()
    _logging(args, live, console)
    view = st.LiveView(console) if live else st.PlainView(logging_status())
    board = st.StatusBoard(args.worker_id or "", line.endpoint, args.price, None)
    worker = (make_worker or Worker)(
        line,
        settings=_settings(args, args.price, args.ledger),
        relay=_relay(args, line.endpoint, 0),
        keys=keys,
        owner=owner,
        status=StatusOut(board, view.show),
    )
    # The worker settled its id (from its key, unless --id): the file is named after it.
    board.path = (
        Path(args.status_file)
        if args.status_file
        else st.default_status_dir() / f"{board.doc.worker_id or 'worker'}.json"
    )
    _warm(args, make_worker)
    try:
        with view:
            reason = asyncio.run(worker.run())
    except (WorkerError, BaseExceptionGroup) as eg:  # a group: out of the worker's TaskGroup
        errors = _worker_errors(eg)
        board.update(exit=errors[0])
        board.flush(force=True)
        _summary(console, board)
        for e in errors:
            print(f"echo-worker: {e}", file=sys.stderr)
        if _loading():
            _leave_now(1)
        return 1
    import logging

    logging.getLogger("echo.worker").info("exited: %s", reason or "done")
    _summary(console, board)
    if _loading():
        _leave_now(0)
    return 0


def _worker_errors(eg: BaseException) -> list[str]:
    """The WorkerErrors' messages (what the volunteer must read); anything else is raised."""
    from echo_rl.worker.agent import WorkerError

    if isinstance(eg, WorkerError):
        eg = BaseExceptionGroup("worker", [eg])
    assert isinstance(eg, BaseExceptionGroup)
    fatal, rest = eg.split(WorkerError)
    if rest is not None or fatal is None:
        raise eg
    return [str(e) for e in _leaves(fatal)]


def _join_many(
    args: argparse.Namespace, specs: list[RunSpec], make_worker: Callable[..., Worker] | None
) -> int:
    """Several runs in one process (echo_rl/worker/multirun.py): one plain status line per run."""
    import asyncio

    from rich.console import Console

    from echo_rl.worker import status as st
    from echo_rl.worker.agent import SharedRun, StatusOut, Worker
    from echo_rl.worker.multirun import MultiWorker
    from echo_rl.worker.sharing import DeviceSeat

    keys, owner, rc = _common(args)
    if rc is not None:
        return rc
    console = Console()
    _logging(args, False, console)
    boards = []
    from echo_rl.core.memplan import HostBudget

    budget = HostBudget(args.host_memory_gb)  # one machine: the runs share its memory

    def make(spec: RunSpec, turns: Turns, i: int) -> Worker:
        board = st.StatusBoard(args.worker_id or "", spec.line.endpoint, spec.price, None)
        boards.append(board)
        ledger = (  # each run's books apart
            str(Path(args.ledger).with_name(f"{Path(args.ledger).stem}@{i}.jsonl"))
            if args.ledger
            else args.ledger
        )
        worker = (make_worker or Worker)(
            spec.line,
            settings=_settings(args, spec.price, ledger),
            relay=_relay(args, spec.line.endpoint, i),
            keys=keys,
            owner=owner,
            status=StatusOut(board, st.PlainView(logging_status()).show),
            shared=SharedRun(DeviceSeat(turns, spec.name), budget),
        )
        stem = f"{board.doc.worker_id or 'worker'}@{spec.name.replace(':', '_')}"
        board.path = (
            Path(args.status_file).with_name(f"{Path(args.status_file).stem}@{i}.json")
            if args.status_file
            else st.default_status_dir() / f"{stem}.json"
        )
        return worker

    try:
        many = MultiWorker(specs, make, resident=args.resident)
    except ValueError as exc:
        print(f"echo-worker: {exc}", file=sys.stderr)
        return 2
    _warm(args, make_worker)
    ended = asyncio.run(many.run())
    for board in boards:
        _summary(console, board)
    for name, err in many.errors.items():
        for e in _worker_errors(err):
            print(f"echo-worker: {name}: {e}", file=sys.stderr)
    if _loading():
        _leave_now(1 if many.errors else 0)
    return 1 if len(many.errors) == len(ended) else 0


def logging_status() -> logging.Logger:
    import logging

    return logging.getLogger("echo.worker.status")


def _common(
    args: argparse.Namespace,
) -> tuple[KeyPair | None, OwnerSignal | None, int | None]:
    """Checks shared by one run and several: the identity, flags, the owner watch."""
    from echo_rl.core.security import KeyPair, SecurityError, default_identity_path

    try:
        keys = KeyPair.load_or_create(args.identity or default_identity_path())
    except SecurityError as exc:
        print(f"echo-worker: {exc}", file=sys.stderr)
        return None, None, 2
    problem = _flag_problem(args)
    if problem:
        print(f"echo-worker: {problem}", file=sys.stderr)
        return None, None, 2
    owner: OwnerSignal | None = None
    if args.yield_to_owner:
        from echo_rl.worker.owner import make_signal

        try:
            owner = make_signal(
                args.owner_signal,
                quiet_s=args.owner_quiet_s,
                cpu_cores=args.owner_cpu_cores,
                path=args.owner_file,
            )
        except ValueError as exc:
            print(f"echo-worker: {exc}", file=sys.stderr)
            return None, None, 2
    return keys, owner, None


def _flag_problem(args: argparse.Namespace) -> str | None:
    if args.device is not None:
        from echo_rl.core.config import check_device

        try:
            check_device(args.device)
        except ValueError as exc:
            return f"--device: {exc}"
    for flag, port in (("--relay-port", args.relay_port), ("--punch-port", args.punch_port)):
        if port is not None and not 0 <= port <= 65535:
            return f"{flag} {port} is not a port: give 1-65535, or 0 to let the OS pick"
    if args.give_up_after is not None and not args.give_up_after > 0:
        return (
            f"--give-up-after {args.give_up_after:g}: give a number of seconds "
            f"> 0, or leave it out to keep trying"
        )
    if args.price < 0:
        return "--price must be >= 0 (USD per hour)"
    if args.resident < 1:
        return f"--resident {args.resident}: keep at least 1 model on the GPU"
    return None


def _logging(args: argparse.Namespace, live: bool, console: Console) -> None:
    import logging

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


def _relay(args: argparse.Namespace, endpoint: str, index: int) -> RelayConfig:
    """Run ``index``'s relay (docs/ports.md): with several runs, each its own pair of ports,
    two above the previous run's."""
    from echo_rl.broadcast.relay import RelayConfig

    relay_port, punch_port = relay_ports(args.relay_host, args.relay_port, args.punch_port)
    step = 2 * index
    return RelayConfig(
        bind_host=args.relay_host,
        port=relay_port + step if relay_port else 0,
        serve=not args.no_relay,
        punch_host=args.punch_host or punch_host(args.relay_host, endpoint),
        punch_port=punch_port + step if punch_port else 0,
        down_mbit=args.down_mbit,
        up_mbit=args.up_mbit,
        spill_dir="" if args.no_spill else str(_spill_dir(args.spill_dir)),
    )


def _settings(args: argparse.Namespace, price: float, ledger: str | None) -> WorkerSettings:
    from echo_rl.worker.agent import WorkerSettings

    return WorkerSettings(
        worker_id=args.worker_id,
        price=price,
        ledger=ledger,
        migrate=not args.no_migrate,
        give_up_after_s=args.give_up_after,
        threads=args.threads,
        backend=args.backend,
        device=args.device,
        host_memory_gb=args.host_memory_gb,
    )


def _warm(args: argparse.Namespace, make_worker: Callable[..., Worker] | None) -> None:
    if make_worker is None:  # the worker this module builds loads its model with them
        from echo_rl.worker.backends import warm

        # Torch and transformers load while the worker joins: started once this thread's own
        # imports are done, so the two do not take turns on the GIL (on a busy machine that
        # made both slower), and this thread mostly waits on the network from here on.
        warm(args.backend)


def _loading() -> bool:
    """A stop came while the model's libraries were still loading (echo_rl.worker.agent's threads)."""
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


def _summary(console: Console, board: StatusBoard) -> None:
    from echo_rl.worker.status import table

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
    from echo_rl.core.addresses import is_loopback
    from echo_rl.core.config import DEFAULT_RELAY_PORT

    if relay_port is None:
        relay_port = 0 if is_loopback(relay_host) else DEFAULT_RELAY_PORT
    if punch_port is None:
        punch_port = relay_port + 1 if 0 < relay_port < 65535 else 0
    return relay_port, punch_port


def _spill_dir(given: str | None) -> Path:
    from echo_rl.core.spill import spill_dir

    return spill_dir(given)


def punch_host(relay_host: str, learner: str) -> str:
    """Probes must reach the learner: a loopback relay host (the default) only serves when the
    learner is local too; otherwise probe and punch from every interface (docs/nat.md)."""
    local = ("127.", "localhost", "::1")
    learner_host = learner.removeprefix("tcp://").rpartition(":")[0]
    if relay_host.startswith(local) and not learner_host.startswith(local):
        return "0.0.0.0"
    return relay_host
