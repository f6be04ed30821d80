"""SIGTERM and Ctrl-C as exceptions in the learner's main thread, held back while a critical
section runs.

The learner ends a run on SIGTERM as on Ctrl-C: an exception raised wherever the main thread
is, so workers are told, sockets closed and the summary written. A few steps must not be cut in
the middle: the write-ahead log's compaction swaps its file under a writer thread, and a stop
between the rename and the reopening left that thread writing to a closed file (acknowledged
records refused, a traceback instead of the summary). Inside ``uninterrupted()`` a stop is
remembered and raised when the section ends.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

_held = 0  # nesting depth of uninterrupted() sections (the main thread's; handlers run there)
_pending: type[KeyboardInterrupt] | None = None


class Terminated(KeyboardInterrupt):
    """SIGTERM, handled as Ctrl-C is (the summary tells the two apart)."""


def on_signal(signum: int, frame: FrameType | None = None) -> None:
    """The handler for SIGTERM and SIGINT: raise at once, or at the end of the critical
    section running now."""
    global _pending
    stop = Terminated if signum == signal.SIGTERM else KeyboardInterrupt
    if _held:
        _pending = _pending or stop
        return
    raise stop


def install() -> None:
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, on_signal)


@contextmanager
def uninterrupted() -> Iterator[None]:
    """Run the body whole; a SIGTERM or Ctrl-C that came meanwhile is raised after it."""
    global _held, _pending
    _held += 1
    try:
        yield
    finally:
        _held -= 1
        if not _held and _pending is not None:
            stop, _pending = _pending, None
            raise stop
