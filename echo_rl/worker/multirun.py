"""A volunteer joined to several runs at once: ``echo-worker join LINE1 LINE2 ...`` or
``echo-worker join --runs runs.toml`` (docs/multirun.md).

One ``Worker`` per run, in one process and one event loop, each with everything a run keeps
apart: the learner key it pins, its token, its session and ban, its books, its relay (its
snapshots come down its own chains) and its status file. What they share is the device,
through ``Turns`` (echo_rl/worker/sharing.py): a run whose learner cannot use the worker now leaves
it to the others. A run that ends (its learner stops, it bans this worker) leaves the others
running; the process ends when every run has ended or on SIGTERM/Ctrl-C, which stops all.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from echo_rl.core.security import JoinLine, SecurityError
from echo_rl.worker.sharing import Turns
from echo_rl.worker.status import exit_text

if TYPE_CHECKING:
    from echo_rl.worker.agent import Worker

log = logging.getLogger("echo.worker")

MAX_RUNS = 8  # runs one worker process may join: each holds a model and a relay


@dataclass(frozen=True)
class RunSpec:
    """One run a volunteer joins: its line (key pinned, token), share and price."""

    line: JoinLine
    share: float = 1.0
    price: float = 0.0

    @property
    def name(self) -> str:  # the learner's address: what the volunteer recognises
        return self.line.endpoint.removeprefix("tcp://")


def specs_from_args(lines: list[str], shares: list[float] | None, price: float) -> list[RunSpec]:
    """The runs named on the command line; ``--share`` gives one share per line."""
    if shares is not None and len(shares) != len(lines):
        raise SecurityError(
            f"--share gives {len(shares)} shares for {len(lines)} join lines: give one per "
            f"line, in the same order (e.g. --share 2,1)"
        )
    return _checked(
        [
            RunSpec(JoinLine.parse(x), (shares or [1.0] * len(lines))[i], price)
            for i, x in enumerate(lines)
        ]
    )


def specs_from_file(path: Path) -> list[RunSpec]:
    """``--runs FILE``: ``[[run]]`` tables with ``line`` (required), ``share``, ``price``."""
    try:
        doc = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise SecurityError(f"--runs {path}: {exc}; fix the file (docs/multirun.md)") from exc
    runs = doc.get("run")
    if not isinstance(runs, list) or not runs:
        raise SecurityError(
            f"--runs {path}: no [[run]] table; add one per learner, with line = ..."
        )
    specs = []
    for i, run in enumerate(runs):
        unknown = set(run) - {"line", "share", "price"}
        if unknown or "line" not in run:
            raise SecurityError(
                f"--runs {path}: run[{i}] "
                + (f"has unknown keys {sorted(unknown)}" if unknown else "has no line")
                + "; a run takes line (the join line), share and price"
            )
        share, price = run.get("share", 1.0), run.get("price", 0.0)
        if not all(isinstance(v, int | float) for v in (share, price)) or share <= 0 or price < 0:
            raise SecurityError(f"--runs {path}: run[{i}]: share must be > 0 and price >= 0")
        specs.append(RunSpec(JoinLine.parse(run["line"]), float(share), float(price)))
    return _checked(specs)


def _checked(specs: list[RunSpec]) -> list[RunSpec]:
    if len(specs) > MAX_RUNS:
        raise SecurityError(f"{len(specs)} runs: one worker joins at most {MAX_RUNS}")
    names = [s.name for s in specs]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise SecurityError(f"the learner at {twice[0]} is named twice: join each run once")
    for s in specs:
        if s.line.server_key is None:
            raise SecurityError(
                f"{s.name}: a run joined beside others needs its learner key (echo://HOST:PORT/KEY)"
            )
        if not s.share > 0:
            raise SecurityError(f"{s.name}: share {s.share:g} must be > 0 (--share)")
    return specs


class MultiWorker:
    """The runs' workers and the device they share. ``make(spec, turns, index)`` builds one
    run's ``Worker`` (echo_rl/cli/worker_join.py gives each its own relay ports and status file)."""

    def __init__(
        self,
        specs: list[RunSpec],
        make: Callable[[RunSpec, Turns, int], Worker],
        resident: int = 1,
    ):
        self.turns = Turns(resident, park=self._park, unpark=self._unpark)
        self.workers: dict[str, Worker] = {}
        for i, spec in enumerate(specs):
            self.turns.add(spec.name, spec.share, spec.price)
            self.workers[spec.name] = make(spec, self.turns, i)
        self.ended: dict[str, str] = {}  # run -> why its worker stopped
        self.errors: dict[str, BaseException] = {}  # run -> what ended it badly

    async def run(self) -> dict[str, str]:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop, f"signal {sig.name}")
        loop.add_signal_handler(signal.SIGUSR1, self._preempt_notice)
        async with asyncio.TaskGroup() as tg:
            for name, worker in self.workers.items():
                tg.create_task(self._one(name, worker))
        return self.ended

    async def _one(self, name: str, worker: Worker) -> None:
        """One run to its end; its failure (a ban, a refused key) is its own, not the others'."""
        try:
            self.ended[name] = await worker.run() or "done"
        except (Exception, BaseExceptionGroup) as exc:  # kept for the caller, never dropped
            self.errors[name] = exc
            self.ended[name] = f"error: {exit_text(exc)}"
            if worker.status.doc.exit is None:  # it failed before its run began: say why
                worker.status.update(exit=exit_text(exc))
                worker.status.flush(force=True)
            log.warning("run %s ended: %s; the other runs go on", name, exit_text(exc))

    def stop(self, reason: str) -> None:
        for worker in self.workers.values():
            worker.life.stop(reason)

    def _preempt_notice(self) -> None:
        for worker in self.workers.values():
            worker.life.notice(worker.status.path, worker.generation.grant_rtt)

    def _park(self, name: str) -> None:
        """Off the accelerator into host memory (warm: no reload, no snapshot fetch)."""
        backend = self.workers[name].installer.held.backend
        if backend is not None:  # not loaded yet: nothing on the device
            backend.park()

    def _unpark(self, name: str) -> None:
        backend = self.workers[name].installer.held.backend
        if backend is not None:
            backend.unpark()
