"""What a volunteer is told while the learner does not answer its join (docs/volunteers.md).

A silent learner looks the same whatever the cause: a wrong address or port, a learner not
running, a firewall dropping the connection, a join line cut short by the shell (a wrong key
the learner answers is reported by ``echo_rl.core.client`` in its own words). After ``HINT_AFTER_S`` the
worker says so and names each thing to check, again every ``REPEAT_S``; it keeps trying unless
``--give-up-after`` set a limit, and says which. Pure bookkeeping on an injected clock.
"""

from __future__ import annotations

import time
from collections.abc import Callable

HINT_AFTER_S = 30.0
REPEAT_S = 300.0


def checks(endpoint: str) -> str:
    """The things to check, for a learner at ``endpoint`` (tcp://HOST:PORT)."""
    host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    return (
        f"check (1) that {host} port {port} is the address in the operator's join line and "
        f"the learner is running there; (2) that no firewall or router on either side drops "
        f"TCP to {host}:{port} (the learner's operator opens TCP {port} and the three ports "
        f"after it: docs/ports.md); (3) that the join line was pasted whole, quoted, with the "
        f"learner's key as it printed it (once the learner is reached, a key that is not its "
        f"own is reported as such); echo-worker doctor with the same join line checks each "
        f"of these"
    )


class Unreachable:
    """Since when the learner has been silent, and what to say about it."""

    def __init__(
        self,
        endpoint: str,
        give_up_after_s: float | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        hint_after_s: float = HINT_AFTER_S,
        repeat_s: float = REPEAT_S,
    ):
        self.endpoint, self.give_up_after_s, self.clock = endpoint, give_up_after_s, clock
        self.hint_after_s, self.repeat_s = hint_after_s, repeat_s
        self.since: float | None = None
        self._next_hint = 0.0

    def trying(self) -> None:
        """A join is sent: the silence counts from the first one."""
        if self.since is None:
            self.since = self.clock()
            self._next_hint = self.since + self.hint_after_s

    def answered(self) -> None:
        self.since = None

    def silent(self) -> str:
        """One more request went unanswered: a hint to log now, or ""."""
        self.trying()
        now = self.clock()
        since = now if self.since is None else self.since  # trying() has set it
        if now < self._next_hint:
            return ""
        self._next_hint = now + self.repeat_s
        then = (
            f"giving up {self.give_up_after_s:g} s after the first try (--give-up-after)"
            if self.give_up_after_s is not None
            else "still trying, and will until stopped (--give-up-after SECONDS sets a limit)"
        )
        return (
            f"no answer from the learner at {self.endpoint} for {now - since:.0f} s: "
            f"{checks(self.endpoint)}. {then}"
        )

    def given_up(self) -> str:
        """The reason to stop, once ``give_up_after_s`` has passed without an answer; else ""."""
        if self.give_up_after_s is None or self.since is None:
            return ""
        waited = self.clock() - self.since
        if waited < self.give_up_after_s:
            return ""
        return (
            f"gave up after {waited:.0f} s without an answer from the learner at "
            f"{self.endpoint} (--give-up-after {self.give_up_after_s:g}): "
            f"{checks(self.endpoint)}"
        )
