"""The replay buffer's write-ahead log: nothing acknowledged is lost across a learner crash.

File ``buffer.log`` in the run folder: a sequence of frames
``[u32 length][u32 crc32][msgpack [kind, payload]]`` with kinds

  * ``admit``   a list of records, appended and fsynced *before* the batch is acknowledged
                (one fsync per trajectory batch: "fsynced in batches");
  * ``consume`` ``[step, [group ids]]``, appended when the trainer takes groups for a step.

Replay is order-independent: the live buffer after a restart is every admitted record whose
group was not consumed by a step that the restored checkpoint contains. Groups consumed by
steps after the checkpoint (trained, but the training was lost with the crash) come back.
A torn frame at the tail (crash mid-write) is detected by length or CRC and ignored: it was
never acknowledged. ``compact`` rewrites the log with only what is still live (atomic rename).
"""

from __future__ import annotations

import os
import struct
import threading
import zlib
from dataclasses import asdict
from pathlib import Path
from collections.abc import Callable
from typing import Any

import msgpack

from dataplane.records import Record

_HEADER = struct.Struct("<II")


class BufferLog:
    def __init__(self, path: Path, fsync: bool = True):
        self.path = path
        self.fsync = fsync
        self._lock = threading.Lock()
        self._f = open(path, "ab")
        self.bytes_written = 0

    def _append(self, kind: str, payload: Any) -> None:
        body = msgpack.packb([kind, payload], use_bin_type=True)
        frame = _HEADER.pack(len(body), zlib.crc32(body)) + body
        with self._lock:
            self._f.write(frame)
            self._f.flush()
            if self.fsync:
                os.fsync(self._f.fileno())
            self.bytes_written += len(frame)

    def admitted(self, records: list[Record]) -> None:
        if records:
            self._append("admit", [asdict(r) for r in records])

    def consumed(self, step: int, group_ids: list[str]) -> None:
        self._append("consume", [step, group_ids])

    def compact(self, live: Callable[[], list[Record]]) -> None:
        """Rewrite the log as just the records ``live()`` returns: call it right after a
        checkpoint, when everything consumed is inside the checkpoint.

        ``live`` runs under the log's lock, so no admission can be appended to the old file
        after the snapshot of the buffer was taken and then vanish with the rename. A record
        admitted in memory but not yet logged may end up written twice; replay dedupes.
        """
        tmp = self.path.with_suffix(".log.tmp")
        with self._lock:
            with open(tmp, "wb") as f:
                body = msgpack.packb(["admit", [asdict(r) for r in live()]], use_bin_type=True)
                f.write(_HEADER.pack(len(body), zlib.crc32(body)) + body)
                f.flush()
                os.fsync(f.fileno())
            self._f.close()
            os.replace(tmp, self.path)
            _fsync_dir(self.path.parent)
            self._f = open(self.path, "ab")

    def close(self) -> None:
        with self._lock:
            self._f.close()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_log(path: Path) -> tuple[list[Record], dict[int, list[str]]]:
    """All intact frames: (admitted records, {step: consumed group ids})."""
    admitted: list[Record] = []
    consumed: dict[int, list[str]] = {}
    if not path.exists():
        return admitted, consumed
    data = path.read_bytes()
    pos = 0
    while pos + _HEADER.size <= len(data):
        length, crc = _HEADER.unpack_from(data, pos)
        body = data[pos + _HEADER.size : pos + _HEADER.size + length]
        if len(body) < length or zlib.crc32(body) != crc:
            break  # torn tail: written during the crash, never acknowledged
        kind, payload = msgpack.unpackb(body, raw=False)
        if kind == "admit":
            admitted.extend(Record(**r) for r in payload)
        elif kind == "consume":
            consumed.setdefault(payload[0], []).extend(payload[1])
        pos += _HEADER.size + length
    return admitted, consumed


def live_after(admitted: list[Record], consumed: dict[int, list[str]],
               checkpoint_step: int) -> tuple[list[Record], set[str]]:
    """Records still owed to training after restoring the checkpoint taken after
    ``checkpoint_step`` (-1: none), and the groups the checkpoint already trained on."""
    trained = {g for s, gids in consumed.items() if s <= checkpoint_step for g in gids}
    seen: set[tuple[str, int]] = set()
    live = []
    for r in admitted:
        key = (r.group_id, r.sample_idx)
        if r.group_id not in trained and key not in seen:
            seen.add(key)
            live.append(r)
    return live, trained
