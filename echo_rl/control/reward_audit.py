"""Audits of expensive rewards, off the learner's step.

Workers score their own samples (``Adapter.reward`` runs on the worker). For most adapters the
learner recomputes every delivered reward inline, at intake (``echo_rl.control.intake``): cheap, and a
worker that lies about one is refused at once. An adapter whose reward is expensive (it declares
``expensive_reward``: the code adapter runs a sandboxed program per sample) would make that
recompute the learner's bottleneck, so for it the learner instead recomputes a sample of groups
on a thread of its own: every group of a worker on probation (``security.probation_groups``),
then ``security.reward_audit_rate`` of them. A mismatch is a strike (``echo_rl.control.reputation``;
strikes lead to quarantine, whose groups are dropped), as a failed log-prob audit is. The group
itself was admitted already: the same trade as log-prob audits (docs/security.md).

A reward that differs from the worker's is recomputed once more: if the two recomputes differ
too, the reward is not deterministic (a program that reads the clock, one near its time limit),
the worker is not blamed, and it is counted (``nondeterministic``).

Bounded: at most ``security.audit_queue`` groups wait; past it the oldest group not on
probation is dropped and counted (``dropped``). The thread starts with ``start`` and ends with
``close`` (the learner's shutdown). Verdicts leave through ``report``: in the learner, the
server's, which records them on its loop (a strike, and a quarantine's ban and dropped groups,
are the loop's to apply, as for the trainer thread's log-prob audits).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from echo_rl.control.reputation import Verdict
from echo_rl.data.records import Record

if TYPE_CHECKING:
    from echo_rl.data.adapter import Adapter

log = logging.getLogger("echo.reward_audit")


@dataclass
class RewardJob:
    worker_id: str
    key: str
    task: dict[str, Any]
    records: list[Record]  # one whole group
    probation: bool


class RewardAuditor:
    def __init__(self, adapter: Adapter, max_jobs: int, report: Callable[[Verdict], None]):
        self.adapter, self.max_jobs, self.report = adapter, max_jobs, report
        self._jobs: deque[RewardJob] = deque()
        self._cv = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None
        self.audited = 0  # groups recomputed
        self.samples = 0  # rewards recomputed
        self.failed = 0  # groups with a reward the worker misreported
        self.nondeterministic = 0  # rewards that two recomputes disagreed on
        self.dropped = 0  # jobs dropped because the queue was full
        self.seconds = 0.0  # time spent recomputing

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="echo-reward-audit", daemon=True)
        self._thread.start()

    def close(self, timeout_s: float = 5.0) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def submit(self, job: RewardJob) -> None:
        with self._cv:
            if len(self._jobs) >= self.max_jobs:
                victim = next((j for j in self._jobs if not j.probation), self._jobs[0])
                self._jobs.remove(victim)
                self.dropped += 1
            self._jobs.append(job)
            self._cv.notify()

    @property
    def waiting(self) -> int:
        with self._cv:
            return len(self._jobs)

    def stats(self) -> dict[str, float]:
        """For the step row's ``reward_audit`` (echo_rl.learner.rows)."""
        return {
            "audited": self.audited,
            "samples": self.samples,
            "failed": self.failed,
            "nondeterministic": self.nondeterministic,
            "dropped": self.dropped,
            "waiting": self.waiting,
            "seconds": round(self.seconds, 3),
        }

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._jobs and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                job = self._jobs.popleft()
            try:
                self.check(job)
            except Exception:  # an adapter bug costs this audit, not the thread
                log.exception("reward audit of group %s failed", job.records[0].group_id)

    def check(self, job: RewardJob) -> bool:
        """Recompute the group's rewards; record the verdict; True if they matched."""
        t0 = time.monotonic()
        bad, unsure = [], []
        for r in job.records:
            want = self._score(job.task, r)
            if _same(r.reward, want):
                continue
            if not _same(want, self._score(job.task, r)):
                unsure.append(r.sample_idx)
            else:
                bad.append([r.sample_idx, r.reward, want])
        self.seconds += time.monotonic() - t0
        self.audited += 1
        self.samples += len(job.records)
        self.nondeterministic += len(unsure)
        self.failed += bool(bad)
        first = job.records[0]
        stats = {"mismatched": bad[:8], "nondeterministic": unsure[:8]}
        version = min(r.version for r in job.records)
        ok = not bad
        self.report(Verdict(job.worker_id, job.key, first.group_id, version, "reward", ok, stats))
        return ok

    def _score(self, task: dict[str, object], r: Record) -> float:
        text = self.adapter.tokenizer.decode(r.completion_ids, skip_special_tokens=True)
        assert isinstance(text, str)  # one sequence decodes to one string
        return float(self.adapter.reward(task, r.completion_ids, text))


def _same(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-6 * (1.0 + abs(b))
