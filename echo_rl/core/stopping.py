"""SIGTERM and Ctrl-C in the learner's main thread: a stop taken at a safe point.

The learner ends a run on SIGTERM as on Ctrl-C: workers are told, sockets closed and the
summary written. An exception raised wherever the main thread happens to be is not safe: the
write-ahead log's compaction cut between its rename and its reopen left the writer thread a
closed file, and a stop landing inside a step's bookkeeping (the log's ``consumed`` record, the
metrics row, a checkpoint) can leave a half-done step behind or an error instead of the
summary (the README lab saw the learner exit 1 instead of 130 under CI load).

So a stop is raised at once only where nothing is half done: inside ``interruptible()`` (the
wait for the next batch, the start-up's model load). Anywhere else it is remembered and
raised by ``check()`` at the next step boundary, or when an ``interruptible()`` section
begins. A second signal while one is pending is raised at once (the operator insists), except
inside ``uninterrupted()``, whose body always runs whole.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

# The main thread's state (signal handlers run there, between two bytecodes of its code).
_held = 0  # nesting depth of uninterrupted() sections
_open = 0  # nesting depth of interruptible() sections
_pending: type[KeyboardInterrupt] | None = None


class Terminated(KeyboardInterrupt):
    """SIGTERM, handled as Ctrl-C is (the summary tells the two apart)."""


def on_signal(signum: int, frame: FrameType | None = None) -> None:
    """The handler for SIGTERM and SIGINT: raise now where that is safe (or insisted on),
    else at the next safe point."""
    global _pending
    stop = Terminated if signum == signal.SIGTERM else KeyboardInterrupt
    insisted = _pending is not None
    _pending = _pending or stop
    if _held or not (_open or insisted):
        # os.write, not print or logging: the main thread may be inside a write to the same
        # stream, and a buffered writer refuses a reentrant call.
        os.write(2, b"echo-rl learn: stopping at the end of this step (again: stop now)\n")
        return
    check()


def check() -> None:
    """Raise the stop that came meanwhile, if any (a safe point: between two steps)."""
    global _pending
    if _pending is not None and not _held:
        stop, _pending = _pending, None
        raise stop


def reset() -> None:
    """Forget a stop not yet raised (a new run in the same process, tests)."""
    global _pending
    _pending = None


def install() -> None:
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, on_signal)


@contextmanager
def interruptible() -> Iterator[None]:
    """A section a stop may cut at any point (a wait, a load): one pending is raised first."""
    global _open
    check()
    _open += 1
    try:
        yield
    finally:
        _open -= 1


@contextmanager
def uninterrupted() -> Iterator[None]:
    """Run the body whole; a stop that came meanwhile is raised after it if this section was
    itself interruptible, else at the next safe point."""
    global _held
    _held += 1
    try:
        yield
    finally:
        _held -= 1
        if _open and not _held:
            check()
