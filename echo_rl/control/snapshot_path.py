"""Is the learner's snapshot port reachable? What the workers' failed fetches say about it.

A firewall that opens the control port (5555) but not the snapshot port (5556) lets every
worker join and then starves it: each fetch from the learner times out, the worker asks for
another source, the learner names itself again, and training stops on stale drops while the
learner's own advice ("raise kappa ... speed up the broadcast") points elsewhere (issue 55).

The learner cannot test its port from outside, but its workers tell it: a source request whose
failed source is the learner's own snapshot endpoint, for a timeout or a dropped connection,
is a report about the path to that port. ``SnapshotPathWatch`` keeps the reporters of the last
``WINDOW_S`` seconds, one per key. The learner says the port looks closed when two keys report
it (one, with a single worker in session), or when one key reports it and the learner's
snapshot socket has served no byte since, ``CORROBORATE_S`` or more later: in a chain only the
heads pull from the learner, often one worker, and what the learner did not serve is evidence no
reporter can arrange. A worker could still arrange a report, so nothing is decided on it and the
words say whose report it is: the cost of a false one is a misleading line in the operator's
log. The verdict is a log line at most every ``SAY_EVERY_S`` naming
the port, the reporters and the fix, the ``snapshot_path`` field of the learner's stats
(``/api/state``, the gauge ``echo_snapshot_path_reporters``) and the advice that replaces
"raise kappa" while it holds (``echo_rl/learner/provision.py``). Nothing is decided on it: the
learner only says what its workers report.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from urllib.parse import urlsplit

log = logging.getLogger("echo.control")

WINDOW_S = 30.0  # reports older than this are forgotten (a fixed port stops them)
SAY_EVERY_S = 60.0  # the log line at most this often while the reports go on
MAX_REPORTERS = 256  # reporters kept (overflow: the oldest report goes first)
REASONS = ("timeout", "disconnected")  # what a closed or filtered port looks like
CORROBORATE_S = 3.0  # one report, and nothing served by the learner for this long since


class SnapshotPathWatch:
    """``served``: bytes the learner's snapshot socket has sent so far."""

    def __init__(self, clock: Callable[[], float], served: Callable[[], int]):
        self.clock, self.served = clock, served
        self.endpoint = ""  # the learner's snapshot endpoint as workers are told it
        # reporter's key -> (first report of its streak, last report, worker id, bytes served
        # at the first): a streak ends when a key has not reported for WINDOW_S
        self._last: dict[str, tuple[float, float, str, int]] = {}
        self._said = -float("inf")
        self.reports = 0  # reports about the learner's own port, so far

    def attach(self, endpoint: str) -> None:
        self.endpoint = endpoint

    def report(self, key: str, worker_id: str, bad_source: str, reason: str) -> bool:
        """Record a source request from the worker with session key ``key``; True when it
        was about this learner's snapshot port."""
        if not self.endpoint or bad_source != self.endpoint or reason not in REASONS:
            return False
        self.reports += 1
        self.reporters()  # ends streaks past the window
        now = self.clock()
        first, _, _, served = self._last.pop(key, (now, now, worker_id, self.served()))
        self._last[key] = (first, now, worker_id, served)
        while len(self._last) > MAX_REPORTERS:
            del self._last[next(iter(self._last))]
        return True

    def reporters(self) -> list[str]:
        """Workers that reported the port within the window, one per key."""
        now = self.clock()
        for k in [k for k, (_, last, _, _) in self._last.items() if now - last > WINDOW_S]:
            del self._last[k]
        return sorted(worker for _, _, worker, _ in self._last.values())

    def _corroborated(self) -> bool:
        """The learner served nothing since a reporter's streak began, CORROBORATE_S ago or
        more (its later reports keep the streak's start: a worker reporting every 1.5 s)."""
        if not self._last:
            return False
        first, _, _, served = min(self._last.values())
        return self.clock() - first >= CORROBORATE_S and self.served() == served

    def verdict(self, workers: int) -> str | None:
        """The port is unreachable for the fleet, in words (None: no such evidence). ``workers``:
        workers in session now (with two or more, one reporter is not enough)."""
        who = self.reporters()
        if not who or (len(who) < min(2, max(1, workers)) and not self._corroborated()):
            return None
        port = urlsplit(self.endpoint.replace("tcp://", "http://", 1)).port
        return (
            f"{len(who)} worker(s) ({', '.join(who[:5])}) report that they cannot fetch "
            f"snapshots from this learner's snapshot port {port} ({self.endpoint}): their "
            f"fetches timed out or dropped in the last {WINDOW_S:g} s. Training then waits on data made with old versions "
            f"(stale drops), however fast it trains. Open TCP {port} to the workers in the "
            f"firewall as docs/ports.md says, and check learner.public_host; `echo-worker "
            f"doctor` on a worker's machine tests the path"
        )

    def say(self, workers: int) -> str | None:
        """The verdict, logged at most every ``SAY_EVERY_S``; returned whenever it holds."""
        text = self.verdict(workers)
        now = self.clock()
        if text is not None and now - self._said >= SAY_EVERY_S:
            self._said = now
            log.error("%s", text)
        return text
