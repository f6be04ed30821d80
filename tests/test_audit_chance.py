"""How often the learner audits a worker's groups (echo_rl/control/intake.py ``Intake.audit_chance``,
issue 52): every group during probation and after a failed check, then a chance that falls
with the key's age to ``security.audit_rate``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from echo_rl.control.intake import Intake

pytestmark = pytest.mark.timeout(30)


def chance_of(delivered: int, strikes: int = 0, probation: int = 4, rate: float = 0.05) -> float:
    intake = Intake.__new__(Intake)  # only the chance's inputs: the books it reads
    intake.delivered = {"w": delivered}
    intake.probation_groups, intake.audit_rate = probation, rate
    intake.reputation = SimpleNamespace(strikes={"w": strikes})
    return intake.audit_chance("w")


def test_a_young_key_is_audited_more_and_an_old_one_at_the_rate():
    assert [chance_of(d) for d in (1, 4)] == [1.0, 1.0]  # probation
    assert chance_of(8) == pytest.approx(0.5)
    assert chance_of(40) == pytest.approx(0.1)
    assert chance_of(80) == pytest.approx(0.05) == chance_of(10_000)  # the configured floor
    ages = [chance_of(d) for d in range(5, 200)]
    assert ages == sorted(ages, reverse=True)  # never rises with age alone


def test_a_key_with_a_failed_check_is_audited_every_group():
    assert chance_of(10_000, strikes=1) == 1.0


def test_without_probation_the_configured_rate_holds_from_the_start():
    assert chance_of(1, probation=0, rate=0.2) == pytest.approx(0.2)


def test_a_failed_check_of_a_screened_group_quarantines_at_once(tmp_path):
    """Issue 52: on a quiet machine the patient liar's second lie was admitted before the
    audit of its first screened one came back. A screened group whose check fails carries two
    findings against one claim: quarantine at once; any other failed check is one strike."""
    from echo_rl.control.reputation import Reputation, Verdict

    rep = Reputation(tmp_path, strikes=2, step=lambda: 7)
    q = rep.record(Verdict("honest", "k1", "g1", 3, "logprob", False, {}))
    assert rep.strikes["honest"] == 1 and q is None  # one ordinary failure: a strike
    q = rep.record(Verdict("liar", "k2", "g2", 3, "screened_logprob", False, {}))
    assert q is not None and q.worker_id == "liar"
    assert "screened_logprob" in rep.quarantined["liar"]
    rep.record(Verdict("ok", "k3", "g3", 3, "screened_logprob", True, {}))
    assert rep.strikes["ok"] == 0  # a screened group whose check passes: nothing
