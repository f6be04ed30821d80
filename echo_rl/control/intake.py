"""Admission of one trajectory batch: what a worker delivers is checked before it is stored.

Per record (``echo_rl.data.records``): schema, vocabulary, bounds on rewards and log-probs, and
that it speaks for its sender. Then per group, in this order, each failure refusing the whole
group with a counted reason:

  * ``unknown_group``: not a group the learner handed out (or already fulfilled and forgotten);
  * ``learner_restarted``: a group of this run granted by an earlier instance of the learner
    whose lease the restart did not keep (``echo_rl.control.grants``; kept leases are admitted);
  * ``not_your_group``: leased to another worker or key (grants are bound to the key's worker; a
    late delivery after the lease moved on is refused, not credited);
  * ``prompt_mismatch``: the prompt is not the one granted;
  * ``partial_group``: groups come back whole, every sample index once, in one batch; a
    worker that drops the samples it does not like shows up here (a strike);
  * ``prefix_mismatch``: a continued sample (docs/preemption.md) must start with exactly the
    prefix the learner handed out, tokens, log-probs and versions (a strike);
  * ``reward_mismatch``: the learner recomputed a reward (``Adapter.recomputes_rewards``)
    and the worker reported another (a strike).

A group that passes is admitted sample by sample into the buffer (duplicates of a finished
group are acknowledged, not stored again) and, once whole, may be chosen for an audit
(``echo_rl.control.auditor``): always during a worker's probation and once a check of it has failed
(a strike), then at a rate that falls with the key's age, ``probation_groups / delivered``,
down to ``security.audit_rate`` (a young key is looked at more: with the defaults half its
8th group, a tenth of its 40th); drawn after receipt from the OS's randomness so a worker
cannot tell which of its groups will be looked at. Only the control-plane thread calls this
object.
"""

from __future__ import annotations

import logging
import random
from collections import Counter, defaultdict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol

from echo_rl.control.faults import FAULTS, FaultBook
from echo_rl.control.handback import expand
from echo_rl.control.reputation import Quarantine, Reputation, Verdict
from echo_rl.control.reward_audit import RewardAuditor, RewardJob
from echo_rl.control.work import WorkQueue
from echo_rl.core import wire
from echo_rl.data.buffer import ACCEPTED, COMPLETED, DUPLICATE, STALE, ReplayBuffer
from echo_rl.data.durable import BufferLog
from echo_rl.data.records import Limits, Record, RecordError, parse_record

if TYPE_CHECKING:
    from echo_rl.data.adapter import Adapter

log = logging.getLogger("echo.intake")

NOT_COUNTED = (STALE, "future_version", "buffer_full")  # the buffer counts these itself


@dataclass
class AuditJob:
    worker_id: str
    key: str
    records: list[Record]  # one whole group
    probation: bool

    @property
    def group_id(self) -> str:
        return self.records[0].group_id

    at_version: int | None = None  # a continued group: the continuing worker's version
    # A handed-back group's prefixes (``echo_rl.control.handbacks``), checked before anyone continues
    # them: its verdicts are named ``handback_<check>`` and go first in the auditor's queue.
    prefix: bool = False
    # A group the step-start screen left out (echo_rl/control/screen.py): checked at once, before its
    # snapshot is dropped, in the auditor's debt if need be.
    screened: bool = False

    @property
    def version(self) -> int:
        return (
            self.at_version if self.at_version is not None else min(r.version for r in self.records)
        )


@dataclass
class Outcome:
    """What one batch came to."""

    accepted: list[Record] = field(default_factory=list)
    duplicates: int = 0
    rejected: Counter[str] = field(default_factory=Counter)
    rejected_idx: list[int] = field(default_factory=list)
    details: dict[str, str] = field(default_factory=dict)  # one example per reason
    # the buffer log's future for the accepted records (None: nothing to wait for)
    durable: Future[None] | None = None
    # the sender's quarantine, when a check of this batch was its last strike: the caller
    # carries it out (echo_rl.control.deliveries)
    quarantine: Quarantine | None = None

    def refuse(self, reason: str, idx: list[int], detail: str = "") -> None:
        self.rejected[reason] += len(idx)
        self.rejected_idx.extend(idx)
        if detail:
            self.details.setdefault(reason, detail)


def own_tokens(recs: list[Record], cut: dict[int, int]) -> tuple[list[Record], int]:
    """A continued group as an audit sees it: prefix tokens (another worker's) masked out,
    and the version the continuing worker generated under (the newest run)."""
    version = max((r.versions or [[r.version, 1]])[-1][0] for r in recs)
    out = []
    for r in recs:
        left = cut.get(r.sample_idx, 0)  # the first ``left`` policy tokens are the prefix
        mask = list(r.loss_mask or [1] * len(r.completion_ids))
        for j, m in enumerate(mask):
            if left == 0:
                break
            if m:
                mask[j], left = 0, left - 1
        out.append(replace(r, loss_mask=mask))
    return out, version


def one_version(
    recs: list[Record], pick: Callable[[list[int]], int]
) -> tuple[list[Record], int | None]:
    """A group whose samples span versions, all of them its deliverer's own (a sample carried
    across an install by the long-tail cut, echo_rl/worker/tail.py), as an audit sees it: the tokens of
    the version ``pick`` draws among them, the others masked out. The draw comes after
    receipt, so a forger cannot know which run of its tokens will be checked. (None: one
    version, or a multi-turn record: audited as before.)"""
    if any(r.loss_mask is not None for r in recs):
        return recs, None
    vs = sorted({v for r in recs for v, _ in (r.versions or [[r.version, 1]])})
    if len(vs) < 2:
        return recs, None
    at = pick(vs)
    out = []
    for r in recs:
        per = expand(r.versions or [[r.version, len(r.completion_ids)]])
        out.append(replace(r, loss_mask=[int(v == at) for v in per]))
    return out, at


class Completions(Protocol):
    """Who hears of a group that came back whole (``echo_rl.control.handbacks`` ranks its
    reward): its sender, its records, and who had handed it back."""

    def completed(self, sender: str, recs: list[Record], handed_by: tuple[str, ...]) -> None: ...


@dataclass(frozen=True)
class IntakeChecks:
    """How an admitted group is checked beyond its records' own limits (module docstring)."""

    adapter: Adapter | None = None  # recomputes rewards inline (None: no recomputation)
    audit: Callable[[AuditJob], None] | None = None  # where groups chosen for audit go
    audit_rate: float = 0.0  # security.audit_rate: the floor of the audit chance
    probation_groups: int = 0  # security.probation_groups: a key's groups all audited
    reward_audit: RewardAuditor | None = None  # an expensive reward's auditor thread
    reward_audit_rate: float = 0.0  # security.reward_audit_rate


class Intake:
    def __init__(
        self,
        *,
        limits: Limits,
        buffer: ReplayBuffer,
        work: WorkQueue,
        reputation: Reputation,
        buffer_log: BufferLog | None = None,
        checks: IntakeChecks = IntakeChecks(),
        faults: FaultBook | None = None,
        completions: Completions | None = None,
    ):
        """``completions``: told of every group that came back whole (None: nobody listens)."""
        adapter, reward_audit = checks.adapter, checks.reward_audit
        self.limits, self.buffer, self.work = limits, buffer, work
        self.faults = (
            faults  # the run's own limits told from a worker's lie (echo_rl.control.faults)
        )
        self._faulted: dict[str, tuple[str, str]] = {}  # this batch: group id -> limit refusal
        self.reputation, self.buffer_log = reputation, buffer_log
        # The reward is recomputed only where the adapter says it can be; an expensive one
        # on the reward auditor's thread, for a sample of groups (echo_rl.control.reward_audit).
        recomputes = getattr(adapter, "recomputes_rewards", False)
        self.reward_audit = reward_audit if recomputes else None
        self.reward_audit_rate = checks.reward_audit_rate
        self.adapter = adapter if recomputes and self.reward_audit is None else None
        self.audit, self.audit_rate = checks.audit, checks.audit_rate
        self.probation_groups = checks.probation_groups
        self.delivered: Counter[str] = Counter()  # worker id -> whole groups admitted
        self.continued = 0  # samples admitted that continued a handed-back prefix
        self.restored_admitted = 0  # samples admitted under leases from before a restart
        self.completions = completions
        self._rng = random.SystemRandom()

    def batch(self, sender: str, key: str, raw: list[object]) -> Outcome:
        """Check and admit the records of one batch; durable before the caller acknowledges.
        A check that quarantines the sender leaves the quarantine in the outcome, for the
        caller to carry out."""
        out = Outcome()
        groups: dict[str, list[tuple[int, Record]]] = defaultdict(list)
        self._faulted = {}
        for i, obj in enumerate(raw):
            try:
                rec = parse_record(obj, self.limits)
            except RecordError as err:
                out.refuse(err.reason, [i], err.detail)
                gid = obj.get("group_id") if isinstance(obj, dict) else None
                if err.reason in FAULTS and isinstance(gid, str):
                    self._faulted[gid] = (err.reason, err.detail)
                continue
            if rec.worker_id != sender:  # a record speaks for the worker that sent it, no other
                out.refuse("identity_mismatch", [i], f"record names {rec.worker_id!r}")
                continue
            groups[rec.group_id].append((i, rec))
        for gid, members in groups.items():
            if sender in self.reputation.quarantined:  # a strike in this very batch
                out.refuse("quarantined", [i for i, _ in members])
                continue
            self._group(sender, key, gid, members, out)
        if sender in self.reputation.quarantined:
            out.accepted = []  # what was admitted before is out of the buffer again
        if self.buffer_log is not None:  # the caller acknowledges once this is durable
            out.durable = self.buffer_log.admitted(out.accepted)
        return out

    def _group(
        self, sender: str, key: str, gid: str, members: list[tuple[int, Record]], out: Outcome
    ) -> None:
        idx = [i for i, _ in members]
        recs = [r for _, r in members]
        if self.buffer.is_done(gid):
            for (
                i,
                r,
            ) in members:  # a resend of a finished group: counted by the buffer, acknowledged
                self._store(i, r, out)
            return
        reason, detail = self._refusal(sender, key, gid, recs, out)
        if reason:
            out.refuse(reason, idx, detail)
            return
        group = self.work.lookup(gid)
        prefixes = list(group.prefixes) if group is not None else []
        before = len(out.accepted)
        returners = self.work.handed_by(gid)  # read before the group is fulfilled and forgotten
        stored = [self._store(i, r, out) for i, r in members]
        started = {p.sample_idx for p in prefixes}
        self.continued += sum(1 for r in out.accepted[before:] if r.sample_idx in started)
        if gid in self.work.restored:
            self.restored_admitted += len(out.accepted) - before
        if COMPLETED in stored:
            self._maybe_audit(sender, key, recs, prefixes)
            if self.reward_audit is not None and group is not None:
                self._maybe_audit_reward(self.reward_audit, sender, key, group.task, recs)
            if self.completions is not None:
                self.completions.completed(sender, recs, returners)

    def _refusal(
        self, sender: str, key: str, gid: str, recs: list[Record], out: Outcome
    ) -> tuple[str, str]:
        holder = self.work.holder(gid)
        if holder is None:
            if self.work.past_instance(gid):
                return "learner_restarted", (
                    f"group {gid} was granted before the learner "
                    f"restarted and its lease was not kept (or it went "
                    f"to another worker); new work follows"
                )
            return "unknown_group", f"group {gid} was not handed out (or is finished)"
        held_by = self.work.holder_key(gid)
        if holder != sender or (held_by and held_by != key):
            return "not_your_group", f"group {gid} is leased to another worker"
        group = self.work.lookup(gid)
        assert group is not None
        if any(r.prompt_ids != group.prompt_ids for r in recs):
            return "prompt_mismatch", f"group {gid}: a prompt is not the one granted"
        got = sorted(r.sample_idx for r in recs)
        if got != list(range(group.n)):
            if not self._runs_own(sender, key, self._faulted.get(gid)):
                self._verdict(out, sender, key, recs, "whole_group", False, {"samples": got[:64]})
            return "partial_group", (
                f"group {gid}: samples {got[:16]} of {group.n}; deliver every "
                f"sample of a group, once, in one batch"
            )
        over = _over_budget(group, recs)
        if over:
            # a worker of this release stops there (echo_rl/worker/backends/base.py group_budget)
            detail = f"{len(over)} sample(s) past {group.max_new_tokens} tokens"
            if not self._runs_own(sender, key, ("over_budget", detail)):
                self._verdict(out, sender, key, recs, "budget", False, {"samples": over[:8]})
            return "over_budget", (
                f"group {gid}: samples {over[:8]} run past the task's budget of "
                f"{group.max_new_tokens} tokens; generate at most that many for it"
            )
        if group.prefixes:
            bad = [r.sample_idx for r in recs if not self._continues(group, r)]
            self._verdict(out, sender, key, recs, "prefix", not bad, {"mismatched": bad[:8]})
            if bad:
                return "prefix_mismatch", (
                    f"group {gid}: samples {bad[:8]} do not start with "
                    f"the prefix handed out (tokens, log-probs, versions)"
                )
        if self.adapter is not None:
            lies = self._reward_lies(self.adapter, group.task, recs)
            self._verdict(out, sender, key, recs, "reward", not lies, {"mismatched": lies[:8]})
            if lies:
                return "reward_mismatch", (
                    f"group {gid}: reported rewards differ from the "
                    f"adapter's for samples {[int(b[0]) for b in lies[:8]]}"
                )
        return "", ""

    def _continues(self, group: wire.Group, rec: Record) -> bool:
        p = next((q for q in group.prefixes if q.sample_idx == rec.sample_idx), None)
        if p is None:
            return True
        k = len(p.ids)
        versions = expand(rec.versions or [[rec.version, len(rec.completion_ids)]])
        # the policy's tokens in order: the whole completion, or a multi-turn record's masked
        # ones (its decisions, with the environment's replies between them)
        keep = [j for j, m in enumerate(rec.loss_mask or [1] * len(rec.completion_ids)) if m]
        return (
            [rec.completion_ids[j] for j in keep[:k]] == p.ids
            and [rec.logprobs[j] for j in keep[:k]] == p.logprobs
            and [versions[j] for j in keep[:k]] == expand(p.versions)
        )

    def _reward_lies(
        self, adapter: Adapter, task: dict[str, object], recs: list[Record]
    ) -> list[list[float]]:
        """[sample index, reported, recomputed] for every reward the adapter scores otherwise."""
        tok = adapter.tokenizer
        bad: list[list[float]] = []
        for r in recs:
            text = tok.decode(r.completion_ids, skip_special_tokens=True)
            assert isinstance(text, str)  # one sequence decodes to one string
            want = float(adapter.reward(task, r.completion_ids, text))
            if abs(r.reward - want) > 1e-6 * (1.0 + abs(want)):
                bad.append([r.sample_idx, r.reward, want])
        return bad

    def _store(self, i: int, rec: Record, out: Outcome) -> str:
        outcome = self.buffer.admit(rec)
        if outcome in (ACCEPTED, COMPLETED):
            out.accepted.append(rec)
        elif outcome == DUPLICATE:
            out.duplicates += 1
        else:  # stale ones are counted by the buffer as dropped_stale, the rest here
            out.refuse(outcome, [i])
        if outcome == COMPLETED:
            self.work.fulfilled(rec.group_id)
        elif outcome == STALE:
            self.work.drop_prefixes(rec.group_id)  # a stale prefix would make stale records
            self.work.requeue(rec.group_id)  # regenerate it under a fresh snapshot
        return outcome

    def _maybe_audit_reward(
        self,
        auditor: RewardAuditor,
        sender: str,
        key: str,
        task: dict[str, object],
        recs: list[Record],
    ) -> None:
        probation = self.delivered[sender] <= self.probation_groups  # counted by _maybe_audit
        if probation or self._rng.random() < self.reward_audit_rate:
            job = RewardJob(sender, key, task, sorted(recs, key=lambda r: r.sample_idx), probation)
            auditor.submit(job)

    def audit_chance(self, sender: str) -> float:
        """The chance that ``sender``'s next whole group is audited (module docstring)."""
        delivered = self.delivered[sender]
        if delivered <= self.probation_groups or self.reputation.strikes[sender] > 0:
            return 1.0
        return max(self.audit_rate, self.probation_groups / delivered)

    def _maybe_audit(
        self, sender: str, key: str, recs: list[Record], prefixes: list[wire.Prefix]
    ) -> None:
        self.delivered[sender] += 1
        probation = self.delivered[sender] <= self.probation_groups
        chance = self.audit_chance(sender)
        if self.audit is not None and (chance >= 1.0 or self._rng.random() < chance):
            recs = sorted(recs, key=lambda r: r.sample_idx)
            at = None
            if prefixes:  # audit the sender's own tokens, under the sender's version
                recs, at = own_tokens(recs, {p.sample_idx: len(p.ids) for p in prefixes})
            else:  # its own tokens of two versions (a tail carried across an install)
                recs, at = one_version(recs, self._rng.choice)
            self.audit(AuditJob(sender, key, recs, probation, at))

    def _runs_own(self, sender: str, key: str, fault: tuple[str, str] | None) -> bool:
        """Was this refusal the run's own limit, seen alike from independent workers?"""
        return (
            fault is not None
            and self.faults is not None
            and self.faults.owns(fault[0], sender, key, fault[1])
        )

    def _verdict(
        self,
        out: Outcome,
        sender: str,
        key: str,
        recs: list[Record],
        check: str,
        ok: bool,
        stats: dict[str, object],
    ) -> None:
        q = self.reputation.record(
            Verdict(sender, key, recs[0].group_id, min(r.version for r in recs), check, ok, stats)
        )
        if q is not None:
            out.quarantine = q  # the caller's to carry out


def _over_budget(group: wire.Group, recs: list[Record]) -> list[int]:
    """Samples of a single-turn group with a budget of its own (``wire.Group.max_new_tokens``)
    whose completion is longer than it."""
    most = group.max_new_tokens
    if most is None:
        return []
    return [r.sample_idx for r in recs if not r.loss_mask and len(r.completion_ids) > most]
