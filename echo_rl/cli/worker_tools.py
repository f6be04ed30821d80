"""``echo-worker status``, ``preempt`` and ``doctor``: the subcommands that read a worker's
status file or check the way to a learner, each a function of the parsed arguments that returns
the exit code (``echo_rl/cli/worker.py`` parses and dispatches)."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from echo_rl.cli.worker_join import punch_host, relay_ports

if TYPE_CHECKING:
    from pathlib import Path

    from echo_rl.worker.status import WorkerStatus


def doctor(args: argparse.Namespace) -> int:
    """``echo-worker doctor LINE``: each check's verdict and fix; 1 when any failed."""
    import asyncio
    from pathlib import Path

    from echo_rl.core.addresses import is_loopback
    from echo_rl.core.doctor import show
    from echo_rl.core.security import JoinLine, KeyPair, SecurityError, default_identity_path

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
    from echo_rl.worker.doctor import diagnose

    relay_port = args.relay_port
    if relay_port is None and not is_loopback(args.relay_host):
        relay_port = relay_ports(args.relay_host, None, None)[0]
    punch = args.punch_host or punch_host(args.relay_host, line.endpoint)
    checks = asyncio.run(
        diagnose(line, keys if line.server_key else None, args.relay_host, relay_port, punch)
    )
    return show(checks)


def preempt(args: argparse.Namespace) -> int:
    """``echo-worker preempt --in S``: write the deadline next to the worker's status file and
    wake it with SIGUSR1 (the worker's own pid, from its status file)."""
    import json
    import os
    import signal
    import time
    from pathlib import Path

    from echo_rl.worker.status import default_status_dir, latest_status, notice_path, read_status

    try:
        path = Path(args.file) if args.file else latest_status(default_status_dir())
        doc = read_status(path)
    except ValueError as exc:
        print(f"echo-worker preempt: {exc}", file=sys.stderr)
        return 1
    pid = doc.pid
    if doc.exit or not _alive(pid):
        print(f"echo-worker preempt: the worker of {path} is not running", file=sys.stderr)
        return 1
    if not args.seconds >= 0:
        print("echo-worker preempt: --in must be >= 0 seconds", file=sys.stderr)
        return 2
    notice_path(path).write_text(json.dumps({"deadline": time.time() + args.seconds}))
    os.kill(pid, signal.SIGUSR1)
    print(f"told worker {doc.worker_id} (pid {pid}): reclaimed in {args.seconds:g} s")
    return 0


def status(args: argparse.Namespace) -> int:
    """``echo-worker status``: the table from a worker's status file."""
    import json
    import time
    from pathlib import Path

    from rich.console import Console

    from echo_rl.worker.status import ago, default_status_dir, latest_status, read_status, table

    try:
        path = Path(args.file) if args.file else latest_status(default_status_dir())
        docs = [read_status(path)]
        docs += [read_status(p) for p in sibling_runs(path, docs[0])]
    except ValueError as exc:
        print(f"echo-worker status: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(docs[0].to_json(), indent=1))
        return 0
    for doc in docs:  # one table per run the worker process serves (docs/multirun.md)
        age = ago(time.time() - doc.updated_at)
        running = not doc.exit and _alive(doc.pid)
        # an exited worker's last write is its exit
        when = f"exited {age}" if doc.exit else f"updated {age}"
        Console().print(
            table(
                doc,
                title=f"echo-worker {doc.worker_id} "
                f"({'running' if running else 'not running'}; {when})",
            )
        )
    return 0


def sibling_runs(path: Path, doc: WorkerStatus) -> list[Path]:
    """The other status files of the process that wrote ``doc``: a worker joined to several
    runs keeps one per run (``ID@HOST_PORT.json``), all carrying its pid."""
    from echo_rl.worker.status import read_status

    if "@" not in path.name or doc.pid <= 0:  # a worker of one run: one file
        return []
    out: list[Path] = []
    for other in sorted(path.parent.glob("*@*.json")):
        if other == path:
            continue
        try:
            if read_status(other).pid == doc.pid:
                out.append(other)
        except ValueError:
            continue  # another worker's file, being written: not ours to show
    return out


def _alive(pid: int) -> bool:
    import os

    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)  # signal 0: is there such a process (it may be another's by now)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
