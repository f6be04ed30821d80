"""The patient liar, as a phase of the security drill's one uninterrupted attack run (issue 52).

A worker with its own token joins the training fleet, honest through probation, then forges the
behaviour log-probs (-20 for every token) of one group in every 20
(``benchmarks/drill_workers.py --kind patient_logprobs``). The phase lasts until the learner has
quarantined it (``<run>/security/quarantine.jsonl``) or ``seconds``. Then, from the liar's own
truth log (which groups it forged) and ledger (what the learner acknowledged storing), and the
learner's trails (``screened.jsonl``: rows left out of their step; ``consumed.jsonl``: groups
trained), it records:

  * forged groups sent, admitted (acknowledged), screened and trained all the same;
  * the learner step of its first screened group and of its quarantine;
  * honest workers struck or screened meanwhile (must be none).

Expected (issue 52): at most 2 forged groups admitted before the quarantine, none trained, no
honest worker struck, banned or starved.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

NAME = "a-patient-liar"  # not w*: the drill's final checks audit honest workers' ledgers only
HONEST = ("w0", "w1")
MAX_ADMITTED = 2


def _lines(path: Path) -> list[dict[str, Any]]:
    out = []
    for line in path.read_text().splitlines() if path.exists() else ():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written
            continue
    return out


def _quarantined(run: Path) -> dict[str, Any] | None:
    return next(
        (q for q in _lines(run / "security/quarantine.jsonl") if q.get("worker_id") == NAME), None
    )


def patient_phase(fleet: Any, sampler: Any, token: str, seconds: float = 240.0) -> dict[str, Any]:
    """Run the patient liar against ``fleet`` (security_drill.Fleet) until it is quarantined."""
    from security_drill import _failures

    url = fleet.info["metrics"]
    adm0, checks0 = fleet.admitted(), _failures(url)
    screened0 = len(_lines(fleet.run / "screened.jsonl"))
    sampler.take()
    tb0, s0, t0 = fleet.tracebacks(), fleet.step(), time.monotonic()
    fleet.worker(NAME, token, "patient_logprobs")
    deadline = t0 + seconds
    q = None
    while time.monotonic() < deadline and fleet.alive("learner"):
        q = _quarantined(fleet.run)
        if q is not None:
            break
        time.sleep(0.5)  # polling the learner's file: it offers no event to wait on
    wall = time.monotonic() - t0
    fleet.group.stop(NAME)
    steps = fleet.step() - s0
    stepped = fleet.wait_step(fleet.step() + 2, timeout=30)
    adm1, checks1 = fleet.admitted(), _failures(url)

    groups = [g for batch in _lines(fleet.tmp / f"{NAME}.truth") for g in batch["groups"]]
    # A group granted again (its first batch refused stale, say) is generated again: a group
    # counts as forged when every attempt the liar made at it was; one forged once and then
    # generated honestly is counted apart (which attempt was stored, the ledger cannot say)
    tries: dict[str, list[bool]] = {}
    for g in groups:
        tries.setdefault(g["group_id"], []).append(g["logprobs_replaced"] > 0)
    forged = {g for g, t in tries.items() if all(t)}
    mixed = {g for g, t in tries.items() if any(t) and not all(t)}
    # the ledger names each acknowledged record [group id, sample index]
    stored = {key[0] for row in _lines(fleet.tmp / f"{NAME}.ledger") for key in row["stored"]}
    screens = _lines(fleet.run / "screened.jsonl")[screened0:]
    screened = {g for e in screens for g in e["groups"]}
    consumed = {g for e in _lines(fleet.run / "consumed.jsonl") for g in e["groups"]}
    first_screen = next((e.get("step") for e in screens if NAME in e.get("workers", [])), None)
    honest_screened = sum(sum(w in HONEST for w in e.get("workers", [])) for e in screens)
    return {
        "attack": "patient_liar",
        "wall_s": round(wall, 1),
        "attacker": {"worker": NAME, "groups_generated": len(groups)},
        "forged_groups_sent": len(forged | mixed),
        "forged_then_regenerated": len(mixed),
        "forged_then_regenerated_trained": len((mixed & stored & consumed) - screened),
        "forged_groups_admitted": len(forged & stored),
        "forged_groups_screened": len(forged & screened),
        # the liar's own forged records trained: acknowledged from it, consumed by a step and
        # not screened out of it (a group the liar left partial is granted again and an honest
        # worker's records of it are trained under the same group id: those do not count)
        "forged_groups_trained": len((forged & stored & consumed) - screened),
        "first_screen_step": first_screen,
        "quarantine_step": q.get("step") if q else None,
        "quarantined": q is not None,
        "honest_screened_groups": honest_screened,
        "steps_during": steps,
        "kept_stepping": steps > 0 and stepped,
        "steps_per_s": round(steps / max(wall, 1e-3), 3),
        "learner_tracebacks": fleet.tracebacks() - tb0,
        "honest_admitted": {w: adm1.get(w, 0) - adm0.get(w, 0) for w in HONEST},
        "honest_struck": {
            w: checks1.get(w, 0) - checks0.get(w, 0)
            for w in HONEST
            if checks1.get(w, 0) > checks0.get(w, 0)
        },
        **sampler.take(),
        "learner_alive": fleet.alive("learner"),
        "honest_alive": all(fleet.alive(w) for w in HONEST),
    }


def check_patient(r: dict[str, Any]) -> list[str]:
    out = [f"honest {w} admitted nothing" for w in HONEST if not r["honest_admitted"].get(w)]
    if r.get("honest_struck"):
        out.append(f"honest workers struck: {r['honest_struck']}")
    if r.get("honest_screened_groups"):
        out.append(f"{r['honest_screened_groups']} honest group(s) screened")
    if not r["forged_groups_sent"]:
        out.append("the liar forged nothing in the phase: not exercised")
    if not r["quarantined"]:
        out.append("the liar was not quarantined")
    if r["forged_groups_admitted"] > MAX_ADMITTED:
        out.append(f"{r['forged_groups_admitted']} forged groups admitted (> {MAX_ADMITTED})")
    if r["forged_groups_trained"]:
        out.append(f"{r['forged_groups_trained']} forged groups trained")
    return out
