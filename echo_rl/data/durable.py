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
never acknowledged. An intact entry that cannot be replayed (it does not decode, or a record
fails today's admission checks, e.g. a reward past ``learner.max_abs_reward``) is set aside
into ``buffer.log.rejected`` with its reason (``scan_log``, ``quarantine``) and the resume
goes on: it is never replayed into the crash it may have caused. ``compact`` rewrites the
log with only what is still live (atomic rename).

Group commit (the default): appends go to a writer thread, which writes every frame waiting
and then fsyncs once for all of them; each append returns a future that resolves when its
frame is durable. The learner server acknowledges a batch only when that future has resolved,
so the guarantee is unchanged (nothing acknowledged before it is durable), but a slow disk no
longer stalls the event loop that serves heartbeats and snapshot chunks. Frames are written in
the order they were appended, so a ``consume`` never becomes durable before the ``admit`` of
the records it names; ``compact`` (at a checkpoint) first waits for every pending frame, so a
checkpoint never contains training on records whose admission could still be lost. The queue
is unbounded here and bounded by what feeds it: the learner server's pending acknowledgements
(``echo_rl.control.listen.ACK_QUEUE``) and one ``consume`` per learner step.
"""

from __future__ import annotations

import base64
import json
import os
import queue
import struct
import threading
import zlib
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import asdict, dataclass
from pathlib import Path

import msgpack

from echo_rl.core.stopping import uninterrupted
from echo_rl.data.records import Limits, Record, RecordError, parse_record

_HEADER = struct.Struct("<II")


class BufferLog:
    def __init__(self, path: Path, fsync: bool = True):
        """Frames go to a writer thread that makes everything waiting durable in one fsync
        (group commit), so a slow disk delays acknowledgements, never the control loop."""
        self.path = path
        self.fsync = fsync
        self._lock = threading.Lock()
        self._f = open(path, "ab")
        self.bytes_written = 0
        self.commits = 0  # fsyncs (or flushes) that made appended frames durable
        self._pending: queue.Queue[tuple[bytes, Future[None]] | None] = queue.Queue()
        self._error: BaseException | None = None
        self._writer = threading.Thread(target=self._write_loop, name="echo-wal", daemon=True)
        self._writer.start()

    def _append(self, kind: str, payload: object) -> Future[None]:
        """Queue a frame; the future resolves when it is durable."""
        body = msgpack.packb([kind, payload], use_bin_type=True)
        frame = _HEADER.pack(len(body), zlib.crc32(body)) + body
        done: Future[None] = Future()
        if self._error is not None:
            raise RuntimeError(f"buffer log writer failed: {self._error!r}") from self._error
        self._pending.put((frame, done))
        return done

    def _commit(self, frames: list[bytes]) -> None:
        with self._lock:
            for frame in frames:
                self._f.write(frame)
                self.bytes_written += len(frame)
            self._f.flush()
            if self.fsync:
                self._sync()
            self.commits += 1

    def _sync(self) -> None:
        """The fsync of one commit: the seam a slow-disk double overrides (labs/doubles.py)."""
        os.fsync(self._f.fileno())

    def _write_loop(self) -> None:
        while True:
            batch = [self._pending.get()]
            while True:  # everything already waiting goes into this one fsync
                try:
                    batch.append(self._pending.get_nowait())
                except queue.Empty:
                    break
            items = [b for b in batch if b is not None]
            try:
                self._commit([frame for frame, _ in items if frame])
            except BaseException as exc:  # every waiter hears of it; later appends raise
                self._error = exc
                for _, done in items:
                    _settle(done, exc)
            else:
                for _, done in items:
                    _settle(done, None)
            if len(items) < len(batch):  # close() asked the writer to stop
                return

    def flush(self) -> None:
        """Wait until every frame appended so far is durable."""
        if self._writer.is_alive():
            done: Future[None] = Future()
            self._pending.put((b"", done))
            done.result()

    def admitted(self, records: list[Record]) -> Future[None] | None:
        """Durable when the returned future resolves (None: nothing to log)."""
        if records:
            return self._append("admit", [asdict(r) for r in records])
        return None

    def consumed(self, step: int, group_ids: list[str]) -> Future[None]:
        # Not waited for: frames are written in order, and the checkpoint flushes (compact).
        return self._append("consume", [step, group_ids])

    def compact(self, live: Callable[[], list[Record]]) -> None:
        """Rewrite the log as just the records ``live()`` returns: call it right after a
        checkpoint, when everything consumed is inside the checkpoint.

        ``live`` runs under the log's lock, so no admission can be appended to the old file
        after the snapshot of the buffer was taken and then vanish with the rename. A record
        admitted in memory but not yet logged may end up written twice; replay dedupes.
        """
        tmp = self.path.with_suffix(".log.tmp")
        self.flush()  # every admit and consume so far durable before the checkpoint counts
        # A stop (SIGTERM, Ctrl-C) waits for the swap: cut between the rename and the reopen,
        # it left the writer thread a closed file.
        with uninterrupted(), self._lock:
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
        if self._writer.is_alive():
            self.flush()
            self._pending.put(None)
            self._writer.join(30)
        with self._lock:
            self._f.close()


def _settle(done: Future[None], exc: BaseException | None) -> None:
    """Resolve a waiter's future. One its waiter cancelled (an acknowledgement task that ended
    with the learner server) is skipped: setting it would raise in the writer thread, which
    then died and left every later append, the learner's own included, waiting forever."""
    if done.cancelled():
        return
    try:
        if exc is None:
            done.set_result(None)
        else:
            done.set_exception(exc)
    except InvalidStateError:  # cancelled between the check and the set
        pass


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass
class SetAside:
    """A log entry that cannot be replayed: why, and its bytes (msgpack) for inspection."""

    reason: str
    detail: str
    body: bytes


def read_log(path: Path, limits: Limits | None = None) -> tuple[list[Record], dict[int, list[str]]]:
    """All intact frames: (admitted records, {step: consumed group ids}); entries that cannot
    be replayed are left out (see ``scan_log``)."""
    admitted, consumed, _ = scan_log(path, limits)
    return admitted, consumed


def scan_log(
    path: Path, limits: Limits | None = None
) -> tuple[list[Record], dict[int, list[str]], list[SetAside]]:
    """Like ``read_log``, plus the entries set aside: a frame whose body does not decode, and
    each record that is not a valid record (or, with ``limits``, fails today's admission
    bounds). Nothing in the log can make the replay raise, so a poisoned entry cannot crash
    every resume."""
    admitted: list[Record] = []
    consumed: dict[int, list[str]] = {}
    aside: list[SetAside] = []
    if not path.exists():
        return admitted, consumed, aside
    data = path.read_bytes()
    pos = 0
    while pos + _HEADER.size <= len(data):
        length, crc = _HEADER.unpack_from(data, pos)
        body = data[pos + _HEADER.size : pos + _HEADER.size + length]
        if len(body) < length or zlib.crc32(body) != crc:
            break  # torn tail: written during the crash, never acknowledged
        pos += _HEADER.size + length
        try:
            kind, payload = msgpack.unpackb(body, raw=False)
            if kind == "consume":
                step, gids = payload
                if (
                    type(step) is not int
                    or not isinstance(gids, list)
                    or not all(isinstance(g, str) for g in gids)
                ):
                    raise ValueError("a consume entry is [int step, [str group ids]]")
                consumed.setdefault(step, []).extend(gids)
                continue
            if kind != "admit" or not isinstance(payload, list):
                raise ValueError(f"unknown entry kind {kind!r}")
        except Exception as exc:
            aside.append(SetAside("unparseable", f"{type(exc).__name__}: {exc}", body))
            continue
        for obj in payload:
            rec = _replayed(obj, limits, aside)
            if rec is not None:
                admitted.append(rec)
    return admitted, consumed, aside


def _replayed(obj: object, limits: Limits | None, aside: list[SetAside]) -> Record | None:
    try:
        if limits is not None:
            return parse_record(obj, limits)
        if not isinstance(obj, dict):
            raise TypeError(f"a record is a map, not {type(obj).__name__}")
        return Record(**obj)
    except RecordError as err:
        aside.append(SetAside(err.reason, err.detail, _pack(obj)))
    except Exception as exc:
        aside.append(SetAside("unreplayable", f"{type(exc).__name__}: {exc}", _pack(obj)))
    return None


def _pack(obj: object) -> bytes:
    try:
        packed: bytes = msgpack.packb(obj, use_bin_type=True)
        return packed
    except Exception:
        return repr(obj).encode()


def quarantine(log_path: Path, entries: list[SetAside]) -> Path:
    """Append ``entries`` to ``<log>.rejected`` next to the log (JSON lines: reason, detail,
    the entry's msgpack bytes in base64), fsynced: the compaction that follows removes them
    from the log itself."""
    out = log_path.with_name(log_path.name + ".rejected")
    if entries:
        with open(out, "a") as f:
            for e in entries:
                f.write(
                    json.dumps(
                        {
                            "reason": e.reason,
                            "detail": e.detail,
                            "msgpack_b64": base64.b64encode(e.body).decode(),
                        }
                    )
                    + "\n"
                )
            f.flush()
            os.fsync(f.fileno())
    return out


def live_after(
    admitted: list[Record], consumed: dict[int, list[str]], checkpoint_step: int
) -> tuple[list[Record], set[str]]:
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
