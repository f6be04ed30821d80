"""Hand-backs are work products (docs/preemption.md, "Hand-backs are checked"; issue 31).

A preempted or yielding worker gives its leases back with prefixes, the samples it had started
(``echo_rl.control.handback`` checks their form). This object decides what they are worth and who
answers for them. Only the control-plane thread calls it.

* **Checked before anyone continues them.** The sender's own tokens of each new prefix (those
  after an earlier prefix of the sample, which were checked when that one came back) are
  recomputed under the version they name, with the auditor's own computation
  (``echo_rl.control.auditor``: the same forward pass, temperature and restricted answer set;
  its ``logprob`` and ``sampling`` checks, reported as ``handback_logprob`` and
  ``handback_sampling``). Which groups: all of a key's hand-backs until
  ``security.handback_probation`` of its groups passed, then ``security.handback_audit_rate``
  of them, drawn from the OS's randomness after receipt. A group drawn is *held* off the
  queue (``WorkQueue.hand_back(..., hold_until)``) until its verdicts are back: passed, it
  goes to the head of the queue with its new prefixes; failed, without them, and each failed
  check is a strike against the prefix's **author** (``echo_rl.control.reputation``). A worker that
  continues a prefix is never blamed for it: no drawn prefix is continued before it passed.
  Held, not sent out at once without its prefixes: then nearly every checked prefix would be
  wasted (the group is granted at the next work request, the check comes between two trainer
  steps). The auditor runs in the trainer thread within its time budget, prefix jobs first, so
  the control loop never waits on a model. A check not back within
  ``security.handback_hold_s`` (its job dropped, its snapshot gone, its author quarantined)
  releases the group without the new prefixes: that costs tokens, never correctness.
  Multi-turn prefixes are decisions without the environment's replies between them, which
  this check cannot rebuild: they are kept unchecked and counted (``unchecked_multi_turn``).
  Refusing them instead made migration at turn boundaries (docs/preemption.md) impossible
  for every new worker; checking them needs the episode replayed on the learner (not built).
* **Counted and bounded.** Per worker: groups handed back, prefixes kept and refused, groups
  whose prefixes were forged, groups taken back past the bounds (``WorkQueue`` counts granted
  and returned). A worker may hand back at most ``handback_share`` of the groups it was
  granted plus ``handback_allowance`` (about one preemption's grant), at
  ``handback_groups_per_min`` (burst: the allowance). Past a bound the groups are still taken
  back (its leases would only expire later) but their prefixes are refused (``over_share``,
  ``over_rate``), and the worker gets one group per work request until it is within the
  share again (``capped``).
* **Cherry-picking shows in the counts.** When a group completes (whoever delivers it), its
  mean reward is ranked among the last ``REFERENCE`` completed groups: the mid-rank percentile
  ``u`` in [0, 1]. For every worker that had handed the group back, ``u`` goes into its
  returns; for the deliverer, into its deliveries (shown, not judged: a slow worker's
  deliveries are staler and score lower). An honest hand-back is cut by the clock (a
  preemption, the owner), not by what the group holds, so the percentiles of the groups a
  worker returns are draws with mean 1/2: Hoeffding gives
  ``P(|mean u - 1/2| >= e) <= 2 exp(-2 n e^2)`` for ``n`` of them. The test runs at
  checkpoints ``n_k = ceil(min * 1.25^k)`` (``min``: ``handback_bias_min``), the k-th at level
  ``alpha / ((k + 1) (k + 2))``, so ``e_k = sqrt(ln(2 (k + 1) (k + 2) / alpha) / (2 n_k))``;
  the levels sum to ``alpha``, so the chance that an honest worker is ever flagged, over its
  whole life, stays at most ``alpha`` (``handback_bias_alpha``). Testing at every ``n`` would
  spend the same ``alpha`` on thousands of tests instead of a few dozen: at n = 1,000 the
  threshold is 0.086 from 1/2 instead of 0.104, and a drill's picker whose returns sat at a
  mean of 0.40 went unflagged under it (``benchmarks/results/security_drill.json``). A flag
  comes at most one checkpoint (25 % more returns) after the mean first crosses. A worker that returns only its low (or high) groups
  moves its mean towards 0 (or 1) and is flagged after a few dozen returns. Residual honest
  bias: a rollout batch is handed back whole, and a long batch is likelier to be cut than a
  short one; if length correlates with reward that tilts ``u`` a little, which is why a flag
  costs little: the flagged worker's later prefixes are refused (``biased_returns``, its
  cut work is generated again), never a strike.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypedDict

from echo_rl.control.handback import PrefixLimits, check_prefixes, expand
from echo_rl.control.intake import AuditJob
from echo_rl.control.reputation import Verdict
from echo_rl.control.work import WorkQueue
from echo_rl.core import wire
from echo_rl.core.config import SecurityConfig
from echo_rl.core.security import PeerLimits
from echo_rl.data.records import Record

log = logging.getLogger("echo.handbacks")

REFERENCE = 512  # completed groups' mean rewards a new one is ranked among
REFERENCE_MIN = 32  # fewer than this: no percentile yet
KEEP_BOOKS = 65536  # workers whose hand-back books are kept (least recently used dropped)
CHECKS = ("handback_logprob", "handback_sampling")


def midrank(x: float, ref: deque[float] | list[float]) -> float:
    """Where ``x`` falls among ``ref``: (below + half of the ties) / len, in [0, 1]."""
    below = sum(1 for r in ref if r < x)
    ties = sum(1 for r in ref if r == x)
    return (below + 0.5 * ties) / len(ref)


CHECKPOINT_GROWTH = 1.25  # returns between two tests of one worker's books grow by this factor


def checkpoint(k: int, first: int) -> int:
    """The number of returns at which a worker's books are tested for the k-th time."""
    return math.ceil(first * CHECKPOINT_GROWTH**k)


def bias_threshold(n: int, alpha: float, k: int) -> float:
    """How far from 1/2 the mean of ``n`` percentiles may stray at the k-th test (module doc)."""
    return math.sqrt(math.log(2 * (k + 1) * (k + 2) / alpha) / (2 * n))


@dataclass
class Pending:
    """A held group: its new prefixes wait for their check."""

    author: str
    key: str
    keep: list[wire.Prefix]  # the group's prefixes if the check passes
    fallback: list[wire.Prefix]  # ... if it fails or never comes
    new: int  # prefixes under check
    verdicts: dict[str, bool] = field(default_factory=dict)


class ReturnsView(TypedDict):
    """One worker's hand-back books as its row in the stats shows them (``WorkerRow``)."""

    handed_back: int
    prefixes_kept: int
    prefixes_refused: int
    forged: int
    limited: int
    returns_pct: float | None
    returns_n: int
    delivered_pct: float | None
    cherry_pick: str


@dataclass
class Returns:
    """One worker's hand-back books."""

    handed_back: int = 0  # groups
    kept: int = 0  # prefixes kept (checked, or not drawn)
    refused: int = 0  # prefixes refused, any reason
    forged: int = 0  # groups whose prefixes failed the check
    limited: int = 0  # groups taken back past a bound
    returns_n: int = 0  # groups it handed back that were completed since
    returns_u: float = 0.0  # ... the sum of their reward percentiles
    delivered_n: int = 0
    delivered_u: float = 0.0
    flagged: str = ""  # "low" | "high": it returns the groups it does not like
    tests: int = 0  # checkpoints tested so far

    def view(self) -> ReturnsView:
        def mean(s: float, n: int) -> float | None:
            return round(s / n, 4) if n else None

        return {
            "handed_back": self.handed_back,
            "prefixes_kept": self.kept,
            "prefixes_refused": self.refused,
            "forged": self.forged,
            "limited": self.limited,
            "returns_pct": mean(self.returns_u, self.returns_n),
            "returns_n": self.returns_n,
            "delivered_pct": mean(self.delivered_u, self.delivered_n),
            "cherry_pick": self.flagged,
        }


class Handbacks:
    def __init__(
        self,
        sc: SecurityConfig,
        work: WorkQueue,
        submit: Callable[[AuditJob], None] | None,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ):
        """``submit``: where prefix checks go (the auditor's queue); None: prefixes are kept
        unchecked (``security.audit = false``, or a protocol test without an auditor)."""
        self.sc, self.work, self.submit, self.clock = sc, work, submit, clock
        self._rng = rng or random.SystemRandom()
        self.pending: dict[str, Pending] = {}  # group id -> its check (bounded by in-flight groups)
        self.books: OrderedDict[str, Returns] = OrderedDict()
        self.passed: Counter[str] = Counter()  # key -> groups whose prefixes passed a check
        self.rate = PeerLimits(
            sc.handback_groups_per_min / 60.0, float(sc.handback_allowance), clock=clock
        )
        self.recent: deque[float] = deque(maxlen=REFERENCE)
        self.counts: Counter[str] = Counter()

    # ------------------------------------------------------------------ a hand-back

    def receive(
        self, worker_id: str, key: str, msg: wire.Handback, version: int, lim: PrefixLimits
    ) -> wire.HandbackAck:
        """Take the sender's leases back; keep, hold for a check, or refuse their prefixes."""
        refused: Counter[str] = Counter()
        for gid in set(msg.prefixes) - set(msg.groups):
            refused["not_handed_back"] += len(msg.prefixes[gid])
        mine = []
        for gid in dict.fromkeys(msg.groups):
            if self.work.leased_to(gid, worker_id):
                mine.append(gid)
            else:
                refused["not_your_group"] += max(1, len(msg.prefixes.get(gid, [])))
        book = self._book(worker_id)
        over = self._over(worker_id, book, len(mine))
        kept = 0
        for gid in mine:
            group = self.work.lookup(gid)
            assert group is not None  # leased_to
            given = msg.prefixes.get(gid, [])
            if over:
                refused[over] += len(given)
                self.work.hand_back(gid, list(group.prefixes))
                continue
            merged = (
                check_prefixes(group, given, version, lim, refused)
                if given
                else list(group.prefixes)
            )
            kept += self._one(worker_id, key, group, merged, refused)
        book.handed_back += len(mine)
        book.kept += kept
        book.refused += sum(refused.values())
        book.limited += len(mine) if over else 0
        self.counts.update(
            {
                "groups": len(mine),
                "prefixes": kept,
                **{f"refused_{k}": v for k, v in refused.items()},
            }
        )
        if refused:
            log.info(
                "handback from %s: %d groups, %d prefixes kept, refused %s",
                worker_id,
                len(mine),
                kept,
                dict(refused),
            )
        return wire.HandbackAck(groups=len(mine), prefixes=kept, refused=dict(refused))

    def _over(self, worker_id: str, book: Returns, n: int) -> str:
        """Why this hand-back's prefixes are refused whole ("" : they are not)."""
        if book.flagged:
            return "biased_returns"
        if book.handed_back + n > self._share(worker_id):
            return "over_share"
        if n and not self.rate.take(worker_id, float(min(n, self.sc.handback_allowance))):
            return "over_rate"
        return ""

    def _share(self, worker_id: str) -> float:
        return self.sc.handback_share * self.work.granted[worker_id] + self.sc.handback_allowance

    def capped(self, worker_id: str) -> bool:
        """Past its share of hand-backs: one group per work request until it delivers more."""
        book = self.books.get(worker_id)
        return book is not None and book.handed_back >= self._share(worker_id)

    def _one(
        self,
        worker_id: str,
        key: str,
        group: wire.Group,
        merged: list[wire.Prefix],
        refused: Counter[str],
    ) -> int:
        """One group back on the queue (or held for its check); the new prefixes kept."""
        gid = group.group_id
        new = [p for p in merged if p not in group.prefixes]
        multi = any(p.turns for p in new)  # decisions without the replies between: no check
        drawn = (
            bool(new)
            and not multi
            and self.submit is not None
            and (
                self.passed[key] < self.sc.handback_probation
                or self._rng.random() < self.sc.handback_audit_rate
            )
        )
        if not drawn:
            self.counts["unchecked_multi_turn" if multi else "unchecked_groups"] += bool(new)
            self.work.hand_back(gid, merged)
            return len(new)
        job, why = self._job(worker_id, key, group, new)
        if job is None:
            refused[why] += len(new)
            self.work.hand_back(gid, list(group.prefixes))
            return 0
        self.work.hand_back(gid, merged, hold_until=self.clock() + self.sc.handback_hold_s)
        self.pending[gid] = Pending(worker_id, key, merged, list(group.prefixes), len(new))
        self.counts["checks_started"] += 1
        assert self.submit is not None
        self.submit(job)
        return len(new)

    def _job(
        self, worker_id: str, key: str, group: wire.Group, new: list[wire.Prefix]
    ) -> tuple[AuditJob | None, str]:
        """The sender's own tokens as an audit sees them: earlier prefixes masked out."""
        if any(p.turns for p in new):
            return None, "unverifiable"
        recs, versions = [], set()
        for p in new:
            old = next((q for q in group.prefixes if q.sample_idx == p.sample_idx), None)
            start = len(old.ids) if old else 0
            own = expand(p.versions)
            versions.update(own[start:])
            recs.append(
                Record(
                    group_id=group.group_id,
                    sample_idx=p.sample_idx,
                    prompt_ids=list(group.prompt_ids),
                    completion_ids=list(p.ids),
                    logprobs=list(p.logprobs),
                    reward=0.0,
                    version=min(own),
                    worker_id=worker_id,
                    loss_mask=[0] * start + [1] * (len(p.ids) - start),
                )
            )
        if len(versions) != 1:  # one rollout, one snapshot: an honest sender never mixes
            return None, "bad_versions"
        return AuditJob(
            worker_id, key, recs, probation=True, at_version=versions.pop(), prefix=True
        ), ""

    # ------------------------------------------------------------------ verdicts and time

    def verdict(self, v: Verdict) -> None:
        """A prefix check came back (the reputation has recorded it: a failure is already a
        strike against the author). Release the held group with or without its prefixes."""
        p = self.pending.get(v.group_id)
        if v.check not in CHECKS or p is None or p.author != v.worker_id:
            return
        p.verdicts[v.check] = v.ok
        if v.ok and len(p.verdicts) < len(CHECKS):
            return
        del self.pending[v.group_id]
        if v.ok:
            self.passed[p.key] += 1
            self.counts["checks_passed"] += 1
            self.work.release(v.group_id, p.keep)
            return
        self.counts["checks_failed"] += 1
        self.counts["refused_forged"] += p.new
        book = self._book(p.author)
        book.forged += 1
        book.kept -= p.new
        book.refused += p.new
        log.warning(
            "handback of %s from %s: prefixes failed the %s check: refused, the author struck",
            v.group_id,
            p.author,
            v.check,
        )
        self.work.release(v.group_id, p.fallback)

    def expire(self) -> int:
        """Held groups whose check is overdue go out without the prefixes under check."""
        late = self.work.held_past(self.clock())
        for gid in late:
            p = self.pending.pop(gid, None)
            group = self.work.lookup(gid)
            self.counts["checks_timed_out"] += 1
            self.work.release(gid, p.fallback if p else list(group.prefixes) if group else [])
        return len(late)

    def forget(self, worker_id: str) -> None:
        """The author was quarantined: its held groups go out without its prefixes now."""
        for gid, p in [(g, p) for g, p in self.pending.items() if p.author == worker_id]:
            del self.pending[gid]
            self.counts["checks_dropped"] += 1
            self.work.release(gid, p.fallback)

    # ------------------------------------------------------------------ cherry-picking

    def completed(self, sender: str, recs: list[Record], handed_by: tuple[str, ...]) -> None:
        """A group came back whole: its reward percentile goes into the books of whoever
        handed it back (judged) and of its deliverer (shown)."""
        reward = sum(r.reward for r in recs) / len(recs)
        u = midrank(reward, self.recent) if len(self.recent) >= REFERENCE_MIN else None
        self.recent.append(reward)
        if u is None:
            return
        d = self._book(sender)
        d.delivered_n += 1
        d.delivered_u += u
        for author in set(handed_by):
            b = self._book(author)
            b.returns_n += 1
            b.returns_u += u
            self._judge(author, b)

    def _judge(self, worker_id: str, b: Returns) -> None:
        n, k = b.returns_n, b.tests
        if b.flagged or n < checkpoint(k, self.sc.handback_bias_min):
            return
        b.tests += 1
        dev = b.returns_u / n - 0.5
        if abs(dev) >= bias_threshold(n, self.sc.handback_bias_alpha, k):
            b.flagged = "low" if dev < 0 else "high"
            self.counts["cherry_pick_flagged"] += 1
            log.warning(
                "worker %s hands back its %s-reward groups: mean percentile %.3f over %d "
                "returns; its prefixes are no longer kept",
                worker_id,
                b.flagged,
                b.returns_u / n,
                n,
            )

    # ------------------------------------------------------------------ books

    def _book(self, worker_id: str) -> Returns:
        book = self.books.pop(worker_id, None) or Returns()
        self.books[worker_id] = book
        while len(self.books) > KEEP_BOOKS:
            self.books.popitem(last=False)
        return book

    def per_worker(self, worker_id: str) -> ReturnsView:
        book = self.books.get(worker_id)
        return (book or Returns()).view()
