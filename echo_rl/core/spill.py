"""Snapshot payloads kept on disk and read through memory maps (docs/memory.md).

A learner keeps several whole versions for later (the delta encoder's base, the versions the
auditor may still be asked about, the full versions workers rebuild deltas against); a worker
keeps the version it relays. Held as ``bytes`` each costs its size in RAM for as long as it is
kept. ``spill`` writes the bytes to a file and returns a read-only ``mmap`` of it: the kernel's
page cache holds what is read often and drops the rest under memory pressure, and the process's
anonymous memory does not grow. The file is unlinked at once: the mapping keeps it alive, and
nothing is left on disk when the process ends, however it ends.

``Spill.drop_pages`` tells the kernel this process is done reading for now (``MADV_DONTNEED``:
its resident set shrinks; the pages stay in the page cache for the next read).
"""

from __future__ import annotations

import mmap
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing_extensions import Buffer


def spill_dir(root: str | Path | None = None) -> Path:
    """Where spilled payloads go: ``root``, else ``$ECHO_SPILL_DIR``, else
    ``$ECHO_HOME/spill`` or ``~/.cache/echo/spill`` (never /tmp, often a RAM disk)."""
    if root is not None:
        path = Path(root)
    elif os.environ.get("ECHO_SPILL_DIR"):
        path = Path(os.environ["ECHO_SPILL_DIR"])
    else:
        path = Path(os.environ.get("ECHO_HOME", Path.home() / ".cache" / "echo")) / "spill"
    path.mkdir(parents=True, exist_ok=True)
    return path


class SpillWriter:
    """Bytes written piece by piece to an unlinked file, then mapped read-only (``finish``):
    a payload built tensor by tensor never exists whole in RAM."""

    def __init__(self, directory: Path):
        fd, name = tempfile.mkstemp(prefix="payload-", suffix=".bin", dir=directory)
        os.unlink(name)  # the mapping keeps the file alive; nothing outlives the process
        self.fd, self.size = fd, 0

    def write(self, data: Buffer) -> None:
        view = memoryview(data).cast("B")
        done = 0
        while done < view.nbytes:
            done += os.write(self.fd, view[done : done + (64 << 20)])
        self.size += view.nbytes

    def read_into(self, buf: Buffer, offset: int) -> None:
        """Bytes written at ``offset`` read back straight into ``buf`` (a writable buffer):
        no mapped or intermediate copy."""
        view = memoryview(buf).cast("B")
        if view.nbytes and os.preadv(self.fd, [view], offset) != view.nbytes:
            raise OSError(f"spill file: {view.nbytes} bytes at {offset} came back short")

    def close(self) -> None:
        """Done without a map (``read_into`` users): the file goes with the descriptor."""
        os.close(self.fd)

    def finish(self) -> mmap.mmap | bytes:
        """The bytes written, as a read-only map (``b""`` when none: nothing maps zero bytes)."""
        try:
            return mmap.mmap(self.fd, self.size, access=mmap.ACCESS_READ) if self.size else b""
        finally:
            os.close(self.fd)


def spill(data: bytes | bytearray | memoryview, directory: Path) -> mmap.mmap | bytes:
    """``data`` as a read-only memory map of an unlinked file in ``directory``."""
    w = SpillWriter(directory)
    try:
        w.write(data)
    except BaseException:
        w.close()
        raise
    return w.finish()


def drop_pages(buf: object, start: int = 0, end: int | None = None) -> None:
    """Done reading ``buf`` (or bytes ``start:end`` of it) for now: a spilled map's pages leave
    this process's resident set (they stay in the page cache, and a later read faults them
    back in, the same bytes: the map is of a file). Anything else: nothing happens."""
    if not (isinstance(buf, mmap.mmap) and hasattr(mmap, "MADV_DONTNEED")):
        return
    end = len(buf) if end is None else min(end, len(buf))
    start -= start % mmap.PAGESIZE  # madvise starts on a page boundary
    if end > start:
        buf.madvise(mmap.MADV_DONTNEED, start, end - start)
