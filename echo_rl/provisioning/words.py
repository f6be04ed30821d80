"""The provisioner's decisions as a volunteer reads them (docs/volunteers.md).

The controller's reasons are for the operator: "C_eff 334.8/s < alpha*mu_req ...". A volunteer
is told first, in a sentence, what changed for them and why, then the numbers. One function,
pure: the learner's accounts call it for every decision that names a worker.
"""

from __future__ import annotations

from echo_rl.provisioning.decisions import ACTIVATE, RELEASE, Decision

SENTENCES: dict[tuple[str, str], str] = {
    (ACTIVATE, "shortfall"): "active: the learner needs more capacity, and you are among the "
    "cheapest per trajectory",
    (ACTIVATE, "probation"): "active on probation: deliver a group and the learner measures "
    "your throughput",
    (ACTIVATE, "liveness"): "active: the learner has been waiting for data",
    (ACTIVATE, "trial"): "active on trial: the fleet has enough capacity, but at your price "
    "you could produce a trajectory for less than an active volunteer; deliver a group and the "
    "learner measures your throughput",
    (ACTIVATE, "swap"): "active: you produce a trajectory for less than a volunteer who now "
    "stands by",
    (RELEASE, "surplus"): "standby: the fleet has enough capacity; you keep your snapshot "
    "current and may be called again",
    (RELEASE, "swap"): "standby: a volunteer who produces a trajectory for less took your place",
    (RELEASE, "probation_over"): "standby: your probation ended without a delivered group; "
    "check your worker's log (does the model load and generate?)",
    (RELEASE, "yielded"): "standby: your machine's owner needs it; back when it is quiet",
}


def in_words(d: Decision) -> str:
    """What ``d`` means for its worker, then the provisioner's numbers."""
    sentence = SENTENCES.get((d.action, d.cause))
    if sentence is None:
        state = {ACTIVATE: "active", RELEASE: "standby"}.get(d.action, d.action)
        sentence = f"{state}: the provisioner decided so"
    return f"{sentence} (provisioner: {d.reason})"
