"""How a shared worker under ``fleet.policy = "turns"`` (or a variant) picks its next job
(echo_rl/provisioning/sim/multijob.py ``MultiSim``): the worker's own rule (echo_rl/worker/sharing.py ``Turns``)
and the variants a learner's heartbeat ack could feed.

- ``"turns"``, ``"turns-decay"``: of the worker's joined jobs that ask (gate open, work to hand
  out), the least device-seconds on this worker per unit of weight (decayed books for
  ``"turns-decay"``: ``Workers.charge``).
- ``"turns-need"``: the same with each weight times the learner's need.
- ``"turns-needfirst"``: the asking job with the highest need, ties (needs within
  ``NEED_TIE`` of the highest) broken by the least decayed device-seconds per weight.

A learner's need is its capacity requirement at its last step time (``JobRun.required``, the
heuristic's target without alpha) over the workers it holds now (at least one), at least 0.1:
one number a learner has and could send in its heartbeat acks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from echo_rl.provisioning.sim.multijob import JobRun, MultiSim

NEED_FLOOR = 0.1
NEED_TIE = 0.05  # "turns-needfirst": needs within 5 % of the highest tie


def need(sim: MultiSim, job: JobRun) -> float:
    """Required workers / workers held (at least one), at least ``NEED_FLOOR``."""
    return max(NEED_FLOOR, job.required(sim.now, sim.mean_speed) / max(job.held, 1))


def choose_turns(sim: MultiSim, i: int) -> JobRun | None:
    """``Turns._is_next`` on worker i (or a variant, by ``fleet.policy``). Ties (only between
    jobs it has not served yet) go to a model on the device, then the lower index (``Turns``:
    whoever asked first)."""
    ok = [j for j in sim._allowed(i) if j.free_slots() > 0]
    if not ok:
        return None
    used, res = sim.w.used[i], sim.w.resident[i]
    policy = sim.sc.fleet.policy
    if policy == "turns-need":
        w = {j.idx: j.spec.weight * need(sim, j) for j in ok}
        return min(ok, key=lambda j: (used[j.idx] / w[j.idx], j.idx not in res, j.idx))
    if policy == "turns-needfirst" and len(ok) > 1:
        n = {j.idx: need(sim, j) for j in ok}
        top = max(n.values())
        ok = [j for j in ok if n[j.idx] >= top * (1 - NEED_TIE)]
    return min(ok, key=lambda j: (used[j.idx] / j.spec.weight, j.idx not in res, j.idx))
