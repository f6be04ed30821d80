"""The auditor's time budget (echo_rl/control/auditor.py ``Auditor.run``, docs/security.md): a credit
each step adds to. A round dearer than one step's share (borrowing the trainer's model, one long
group) still runs once steps have paid for it, and over many steps audits keep their share.

CI once met a LoRA run whose three steps had no audit at all: the borrow alone cost more than a
short step's share, and each round ended before its first job. A fake clock stands in for the
work here: each job and each borrow advances it by what it costs."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
from fakes import FakeClock

from echo_rl.control.auditor import Auditor
from echo_rl.control.intake import AuditJob

pytestmark = pytest.mark.timeout(30)


def _auditor(cfg, clock: FakeClock, job_s: float, borrow_s: float | None = None) -> Auditor:
    aud = Auditor(cfg, tokenizer=None, report=lambda v: None, clock=clock)

    def audit(job: AuditJob) -> None:
        clock.t += job_s
        aud.done += 1

    aud._audit = audit  # the work itself is tests/test_answers.py's and the live tests'
    if borrow_s is not None:

        @contextmanager
        def borrowed():
            clock.t += borrow_s  # spilling the trainer's weights
            yield

        aud._borrow, aud._borrowed = object(), borrowed
    return aud


def _fill(aud: Auditor, n: int) -> None:
    for i in range(n):
        aud.submit(AuditJob(f"w{i % 3}", "key", [], probation=False))


def test_a_round_dearer_than_a_step_s_share_still_runs(small_cfg):
    clock = FakeClock()
    aud = _auditor(small_cfg, clock, job_s=0.005, borrow_s=0.02)  # the borrow: 2 steps' share
    _fill(aud, 4)
    used = [aud.run(0.01) for _ in range(40)]
    assert aud.done == 4 and aud.waiting == 0  # every job audited
    # ... and paid for: rounds ran only on credit, so the total is the steps' budget plus at
    # most the one round that overspent last
    assert sum(used) <= 40 * 0.01 + 0.02 + 0.005 + 1e-9
    assert sum(u > 0 for u in used) == 4  # one job a round: each round's borrow paid back first


def test_over_many_steps_audits_keep_their_share(small_cfg):
    clock = FakeClock()
    aud = _auditor(small_cfg, clock, job_s=0.05)  # one job: 5 steps' share
    _fill(aud, small_cfg.security.audit_queue)
    steps = 100
    used = sum(aud.run(0.01) for _ in range(steps))
    assert used <= steps * 0.01 + 0.05 + 1e-9  # the share, give or take one job
    assert aud.done >= steps * 0.01 / 0.05 - 1  # and not starved either


def test_an_idle_queue_banks_no_burst(small_cfg):
    clock = FakeClock()
    aud = _auditor(small_cfg, clock, job_s=0.01)
    for _ in range(50):
        assert aud.run(0.01) == 0.0  # nothing waits: nothing runs, nothing is saved up
    _fill(aud, 10)
    assert aud.run(0.01) == pytest.approx(0.01) and aud.done == 1  # one step's worth
    assert aud.run(0.0) == 0.0 and aud.done == 1  # that round spent the credit


def test_a_handed_back_prefix_s_check_runs_every_step_even_in_debt(small_cfg):
    """A group waits for its prefixes' check before anyone continues it (echo_rl/control/handbacks.py):
    one such check runs each step whatever the credit, and ordinary audits wait for the debt."""
    clock = FakeClock()
    aud = _auditor(small_cfg, clock, job_s=0.05)  # one job: 5 steps' share
    _fill(aud, 3)
    for i in range(3):
        aud.submit(AuditJob(f"h{i}", "key", [], probation=False, prefix=True))
    used = [aud.run(0.01) for _ in range(3)]
    assert used == [pytest.approx(0.05)] * 3  # one job a step, though in debt after the first
    assert aud.waiting == 3 and all(not j.prefix for j in aud._jobs)  # the prefixes' checks
    assert [aud.run(0.01) for _ in range(5)] == [0.0] * 5  # the rest wait for the debt


def test_a_screened_group_s_check_runs_at_once_ahead_of_probation_even_in_debt(small_cfg):
    """Issue 52: the screen's audits waited for credit behind probation jobs, and at ten steps
    a second the learner had dropped their snapshot by then (the drill's patient liar had two of
    four screened groups never checked). Each now runs in the round after the screen, in debt."""
    clock = FakeClock()
    aud = _auditor(small_cfg, clock, job_s=0.05)  # one job: 5 steps' share
    ran: list[str] = []
    work = aud._audit

    def audit(job: AuditJob) -> None:
        ran.append(job.worker_id)
        work(job)

    aud._audit = audit
    for i in range(4):
        aud.submit(AuditJob(f"new{i}", "key", [], probation=True))
    aud.submit(AuditJob("liar", "key", [], probation=True, screened=True))
    assert aud.run(0.01) == pytest.approx(0.05) and ran == ["liar"]  # first, though on credit
    aud.submit(AuditJob("liar", "key", [], probation=True, screened=True))
    assert aud.run(0.01) == pytest.approx(0.05) and ran == ["liar", "liar"]  # in debt too
    assert [aud.run(0.01) for _ in range(5)] == [0.0] * 5  # probation waits for the debt
