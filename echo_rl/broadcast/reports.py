"""What the coordinator makes of a worker's report against its snapshot source (issue 31).

A report ("relay R timed out", "R disconnected", "R sent a corrupt chunk") is evidence about
one link, not a verdict on either end: the reporter may be right, may have a bad link itself,
or may be lying to get an honest relay removed. So (docs/security.md, "Relay reports"):

* only a relay's **assigned children** may report on it (the child's source in the current
  plan or in one of the last plans kept): anyone else's report moves the reporter, nothing
  else, and is counted ``unassigned``;
* the reporter is routed around the accused **at once and for a while** (``avoid_s``): the
  next plans never put it under that relay again in that time (before, a child reported a
  corrupting relay three times in six seconds because every re-plan put it back);
* a report counts only from a child the planner placed there for its own reasons: a child
  that was just moved onto a relay because it reported another (``placed_by_report``, until
  the next plan) is no witness against it (issue 52: two keys walked the relays that way);
* the accused is **convicted** of ``corrupt`` by reports from ``convict_after`` independent
  witnesses (``group``: the token a reporter joined with, so one token's keys are one
  witness; in open mode, where keys are free, nobody is a witness, ``NO_WITNESS``), or by the
  learner's own probe (``confirm``: the learner fetched from it like a child and got corrupt
  bytes, or nothing). A ``timeout`` or ``disconnected`` is never convicted on reports alone:
  a reporter's own bad link, or a lie, says the same, so it takes the learner's failed probe. A conviction keeps
  the relay out of parent positions (corrupt) or out of the plan (unreachable) for
  ``mark_s`` seconds, doubled at each repeat; when the mark expires the relay is due for a
  re-probe (``due``) and comes back only if that probe passes (``clear``);
* a child is never struck for a report: the only proof of a false report would be a reply the
  relay signed over the very bytes it sent, and a corrupting relay chooses what it signs. A
  reporter's unconfirmed reports are counted; past a bound the coordinator stops counting its
  reports as evidence (the caller decides, ``echo_rl.control.routes``).

Pure bookkeeping on an injectable clock; the coordinator calls it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

CORRUPT, UNREACHABLE = "corrupt", "unreachable"
NO_WITNESS = ""  # a reporter whose word is nobody's independent witness (open mode)
KIND = {"corrupt": CORRUPT, "suspect": CORRUPT, "timeout": UNREACHABLE, "disconnected": UNREACHABLE}


@dataclass
class Mark:
    kind: str
    until: float
    strikes: int  # convictions so far: the next mark lasts mark_s * 2**strikes


@dataclass
class ReportBook:
    convict_after: int = 2  # independent witnesses whose corrupt reports convict a relay
    avoid_s: float = 600.0  # a reporter is kept off the accused this long
    mark_s: float = 60.0  # first conviction's length; doubled at each repeat
    max_mark_s: float = 3600.0
    # endpoint -> kind -> the children that reported it (distinct keys/ids)
    reporters: dict[str, dict[str, set[str]]] = field(default_factory=dict)
    avoid: dict[str, dict[str, float]] = field(default_factory=dict)  # child -> endpoint -> until
    marks: dict[str, Mark] = field(default_factory=dict)
    strikes: Counter[str] = field(default_factory=Counter)  # endpoint -> convictions
    counts: Counter[str] = field(default_factory=Counter)  # "reason:outcome" -> n

    def report(
        self,
        child: str,
        endpoint: str,
        reason: str,
        assigned: bool,
        now: float,
        group: str | None = None,
    ) -> str:
        """Record one report; returns its outcome: ``unassigned``, ``counted`` (the caller
        probes the accused) or ``convicted`` (this report made the count). ``group``: the
        witness the reporter is (None: itself)."""
        kind = KIND.get(reason)
        if kind is not None:  # a refusal (say, a version the relay does not hold yet) is no failure
            self.avoid.setdefault(child, {})[endpoint] = now + self.avoid_s
        if kind is None:
            outcome = "other"
        elif not assigned:
            outcome = "unassigned"
        else:
            seen = self.reporters.setdefault(endpoint, {}).setdefault(kind, set())
            witness = child if group is None else group
            if witness != NO_WITNESS:
                seen.add(witness)
            outcome = "counted"
            if (
                kind == CORRUPT
                and len(seen) >= self.convict_after
                and not self.marked(endpoint, kind, now)
            ):
                self.convict(endpoint, kind, now)
                outcome = "convicted"
        self.counts[f"{reason}:{outcome}"] += 1
        return outcome

    def convict(self, endpoint: str, kind: str, now: float) -> Mark:
        n = self.strikes[endpoint]
        self.strikes[endpoint] += 1
        mark = Mark(kind, now + min(self.max_mark_s, self.mark_s * 2**n), n + 1)
        self.marks[endpoint] = mark
        self.reporters.pop(endpoint, None)  # a fresh count after the mark
        return mark

    def marked(self, endpoint: str, kind: str | None, now: float) -> bool:
        """Held by an unexpired mark (of ``kind``; any kind for None). An expired mark holds
        until ``clear`` (a passed re-probe) too: it is due, not lifted."""
        m = self.marks.get(endpoint)
        return m is not None and (kind is None or m.kind == kind)

    def due(self, now: float) -> list[str]:
        """Marked relays whose mark has expired: re-probe them."""
        return [ep for ep, m in self.marks.items() if m.until <= now]

    def clear(self, endpoint: str) -> None:
        """A re-probe passed: the relay may be planned again (its strikes stay)."""
        self.marks.pop(endpoint, None)

    def extend(self, endpoint: str, now: float) -> None:
        """A re-probe failed: marked again, for longer."""
        m = self.marks.get(endpoint)
        if m is not None:
            self.convict(endpoint, m.kind, now)

    def avoided(self, child: str, now: float) -> set[str]:
        mine = self.avoid.get(child)
        if not mine:
            return set()
        for ep in [ep for ep, until in mine.items() if until <= now]:
            del mine[ep]
        return set(mine)

    def forget(self, worker: str, endpoint: str = "") -> None:
        """A worker left: its avoid list goes; a relay endpoint's reports go with it."""
        self.avoid.pop(worker, None)
        if endpoint:
            self.reporters.pop(endpoint, None)
            for mine in self.avoid.values():
                mine.pop(endpoint, None)
