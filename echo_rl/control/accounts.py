"""The learner's books on each worker: what it counted, and what it tells the worker.

A volunteer must be able to see, from their side, whether their work is accepted, what it has
earned at their declared price and why the learner refused or released them (docs/volunteers.md).
The worker's status view shows these books, never its own guess: every heartbeat
acknowledgement carries the worker's ``wire.Account``, ``leave`` is answered with the final one
(``farewell``) and ``shutdown`` carries it too. /metrics exports the same books per worker
(``echo_worker_records_accepted``, ``echo_worker_records_rejected{reason}``,
``echo_worker_earned_usd``, ...), so the two can be compared.

Counting rules:
  * earnings accrue only while the learner counts the worker active (the provisioner activated
    it, or no provisioner runs): declared price x active seconds / 3600, the same rule as the
    fleet cost on the dashboard; a standby worker earns nothing;
  * records are counted as the intake judged them: admitted (``accepted``), resends of records
    already held (``duplicates``: acknowledged, not paid twice), refused by reason; a batch
    refused whole before its records could be read (``malformed``, ``count_mismatch``) counts
    once under its reason;
  * ``message`` is the learner's last word to the worker: join, activation or release with the
    provisioner's reason, refusals with an example, quarantine with its cause.

The control-plane loop writes; the metrics server's threads read through ``export``, under a
lock. Bounded: the books of workers that left are kept for the last ``keep`` of them (oldest
dropped first), so a stream of short-lived keys cannot grow the learner's memory.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TypedDict

from echo_rl.core import wire
from echo_rl.core.jsontypes import JsonObject, JsonValue

KEEP_CLOSED = 4096  # books of departed workers kept (for /metrics and a late look)
MAX_REASONS = 32  # distinct refusal reasons kept per worker (they come from a fixed set)


class BookState(TypedDict):
    """One worker's counts as the run folder keeps them (``fleet.json``'s ``accounts``, by
    worker id): written by ``Accounts.state``, read back by ``Accounts.restore`` and by
    ``echo_rl.control.roster``."""

    key: str
    price: float
    active_s: float
    accepted: int
    duplicates: int
    rejected: dict[str, int]
    granted: int


@dataclass
class Book:
    worker_id: str
    key: str  # the identity the books belong to: an id reused by another key starts afresh
    price: float
    state: str = "standby"  # standby | active | quarantined | left
    active_s: float = 0.0
    accepted: int = 0
    duplicates: int = 0
    rejected: Counter[str] = field(default_factory=Counter)
    message: str = ""
    message_at: float = field(default_factory=time.monotonic)
    mark: float = field(default_factory=time.monotonic)  # active time is counted up to here
    granted: int = 0
    # Copied in from the learner's other objects when the book is refreshed (``refresh``).
    version: int = -1
    install_s: float = 0.0
    checks: int = 0
    check_failures: int = 0
    throughput: float = 0.0
    down_mbit: float = 0.0
    up_mbit: float = 0.0
    nat: str = "unknown"

    @property
    def open(self) -> bool:
        return self.state in ("standby", "active")

    def earned_usd(self) -> float:
        return self.price * self.active_s / 3600.0

    def account(self, now: float) -> wire.Account:
        return wire.Account(
            state=self.state,
            version=self.version,
            install_s=round(self.install_s, 4),
            granted=self.granted,
            accepted=self.accepted,
            duplicates=self.duplicates,
            rejected=dict(self.rejected),
            checks=self.checks,
            check_failures=self.check_failures,
            throughput=round(self.throughput, 4),
            down_mbit=round(self.down_mbit, 3),
            up_mbit=round(self.up_mbit, 3),
            nat=self.nat[:16],
            price=self.price,
            active_s=round(self.active_s, 3),
            earned_usd=round(self.earned_usd(), 8),
            message=self.message[:512],
            message_age_s=round(max(0.0, now - self.message_at), 3),
        )


class Accounts:
    def __init__(self, keep: int = KEEP_CLOSED):
        self.keep = keep
        self._books: OrderedDict[str, Book] = OrderedDict()
        self._lock = threading.Lock()

    def open(
        self,
        worker_id: str,
        key: str,
        price: float,
        active: bool,
        message: str,
        now: float | None = None,
    ) -> None:
        """A join. A worker that joins again (same key, same id) keeps its books."""
        now = time.monotonic() if now is None else now
        with self._lock:
            book = self._books.pop(worker_id, None)
            if book is None or book.key != key:
                book = Book(worker_id, key, price)
            self._books[worker_id] = book  # by join order: eviction takes the oldest closed
            book.price, book.state, book.mark = price, "active" if active else "standby", now
            self._say(book, message)

    def tick(self, active: Iterable[str], now: float | None = None) -> None:
        """Accrue active time since the last tick and follow the provisioner's choices."""
        now = time.monotonic() if now is None else now
        active = set(active)
        with self._lock:
            for book in self._books.values():
                if book.open:
                    self._accrue(book, now)
                    book.state = "active" if book.worker_id in active else "standby"

    def granted(self, worker_id: str, groups: int) -> None:
        with self._lock:
            book = self._books.get(worker_id)
            if book is not None:
                book.granted += groups

    def delivered(
        self,
        worker_id: str,
        accepted: int,
        duplicates: int,
        rejected: Mapping[str, int],
        details: Mapping[str, str] | None = None,
    ) -> None:
        with self._lock:
            book = self._books.get(worker_id)
            if book is None:
                return
            book.accepted += accepted
            book.duplicates += duplicates
            for reason, n in rejected.items():
                if n > 0 and (reason in book.rejected or len(book.rejected) < MAX_REASONS):
                    book.rejected[reason] += n
            if book.open and any(n > 0 for n in rejected.values()):  # a quarantine's word stays
                why = ", ".join(
                    f"{r} x{n}" + (f" ({details[r]})" if details and r in details else "")
                    for r, n in sorted(rejected.items())
                    if n > 0
                )
                self._say(book, f"records refused: {why}")

    def note(self, worker_id: str, message: str) -> None:
        with self._lock:
            book = self._books.get(worker_id)
            if book is not None:
                self._say(book, message)

    def close(self, worker_id: str, state: str, message: str, now: float | None = None) -> None:
        """The worker left, was removed or quarantined: its books stop accruing. A book
        already closed keeps its state (a quarantine is not turned into a plain leave)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            book = self._books.get(worker_id)
            if book is None or not book.open:
                return
            self._accrue(book, now)  # up to this moment, not the last tick
            book.state = state
            self._say(book, message)
            closed = [w for w, b in self._books.items() if not b.open]  # oldest joins first
            for w in closed[: max(0, len(closed) - self.keep)]:
                del self._books[w]

    def refresh(
        self,
        worker_id: str,
        *,
        version: int,
        install_s: float,
        nat: str,
        throughput: float,
        checks: int,
        check_failures: int,
        down_mbit: float,
        up_mbit: float,
    ) -> None:
        """Figures the learner keeps elsewhere (versions, installs, checks, link rates)."""
        with self._lock:
            book = self._books.get(worker_id)
            if book is not None:
                book.version, book.install_s, book.nat = version, install_s, nat
                book.throughput = throughput
                book.checks, book.check_failures = checks, check_failures
                book.down_mbit, book.up_mbit = down_mbit, up_mbit

    def account(self, worker_id: str) -> wire.Account | None:
        with self._lock:
            book = self._books.get(worker_id)
            return book.account(time.monotonic()) if book is not None else None

    def export(self) -> dict[str, JsonObject]:
        """Every book as plain data (for /metrics and the dashboard), from any thread."""
        now = time.monotonic()
        with self._lock:
            return {w: b.account(now).model_dump() for w, b in self._books.items()}

    def state(self) -> dict[str, BookState]:
        """The counts of every book, by worker id, for the run folder (``echo_rl.control.fleet``)."""
        with self._lock:
            return {
                w: {
                    "key": b.key,
                    "price": b.price,
                    "active_s": b.active_s,
                    "accepted": b.accepted,
                    "duplicates": b.duplicates,
                    "rejected": dict(b.rejected),
                    "granted": b.granted,
                }
                for w, b in self._books.items()
            }

    def restore(self, state: JsonObject) -> int:
        """Books of the instance before a restart, closed until their worker re-joins with
        the same id and key (``open`` then continues them). Malformed entries are skipped."""
        n = 0
        with self._lock:
            for wid, obj in list(state.items())[-self.keep :]:
                book = _parse_book(wid, obj)
                if book is not None:
                    self._books[wid] = book
                    n += 1
        return n

    @staticmethod
    def _accrue(book: Book, now: float) -> None:
        if book.state == "active":
            book.active_s += max(0.0, now - book.mark)
        book.mark = max(book.mark, now)

    @staticmethod
    def _say(book: Book, message: str) -> None:
        if message:
            book.message, book.message_at = message, time.monotonic()


def _parse_book(worker_id: str, obj: JsonValue) -> Book | None:
    """One restored book, or None when the entry is not what ``Accounts.state`` writes
    (``BookState``)."""
    try:
        if not isinstance(obj, dict):
            return None
        key = obj["key"]
        if not isinstance(key, str):
            return None
        nums: dict[str, float] = {}
        for k in ("price", "active_s", "accepted", "duplicates", "granted"):
            v = obj[k]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                return None
            nums[k] = v
        rejected = obj["rejected"]
        if not isinstance(rejected, dict):
            return None
        counts: dict[str, int] = {}
        for reason, n in rejected.items():
            if type(n) is not int or n < 0:
                return None
            counts[reason] = n
    except (KeyError, TypeError):
        return None
    return Book(
        worker_id,
        key,
        float(nums["price"]),
        state="left",
        active_s=float(nums["active_s"]),
        accepted=int(nums["accepted"]),
        duplicates=int(nums["duplicates"]),
        granted=int(nums["granted"]),
        rejected=Counter(dict(list(counts.items())[:MAX_REASONS])),
        message="the learner restarted: these books wait for this worker to re-join",
    )
