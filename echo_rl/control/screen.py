"""Every delivery screened at no extra forward (docs/security.md, "Screened before training";
issue 52, item 3).

The step-start forward already computes the learner's log-prob of every trained token (the
``logp_old`` of the importance ratio). A worker claims the behaviour log-prob of each token it
sampled; honest claims differ from ``logp_old`` only by what the policy moved in the versions
between (staleness, at most ``learner.staleness``) and by rounding (bf16 snapshots). A row whose
mean claimed-minus-learner gap over its trained tokens is beyond ``security.screen_nats`` in
either direction is left out of the step before any update (its loss mask zeroed) and its group
goes to an immediate audit (``echo_rl.learner.main``: the auditor re-scores it under the version the
worker claims). Forged log-probs (the drill's ``fake_logprobs``: -20 on every token, a gap of
about 18 nats) fail it on their first delivery; a lie within the bound moves the importance
weight by at most ``exp(screen_nats)``, which ``learner.is_cap`` truncates anyway.

One process only: under torchrun each rank holds a shard of the step-start log-probs; the
screen is off there (said at start-up by ``echo_rl.learner.policy``).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Mapping

import torch

from echo_rl.control.intake import AuditJob, one_version
from echo_rl.data.records import Record

log = logging.getLogger("echo.learner")


def screen_rows(
    rows: torch.Tensor,
    old: torch.Tensor,
    behaviour: torch.Tensor,
    mask: torch.Tensor,
    nats: float,
) -> list[int]:
    """Batch rows (of ``rows``, aligned with ``old``'s) whose mean |gap| per trained token
    between the claimed ``behaviour`` log-probs and the learner's ``old`` exceeds ``nats``."""
    m = mask.to(old.dtype)
    diff = torch.where(m > 0, behaviour.to(old.dtype) - old, torch.zeros_like(old))
    gap = diff.sum(-1) / m.sum(-1).clamp(min=1)
    bad = (~torch.isfinite(gap)) | (gap.abs() > nats)
    return [int(r) for r in rows[bad].tolist()]


def audit_screened(
    groups: list[list[Record]],
    rows: list[int],
    key_of: Callable[[str], str | None],
    submit: Callable[[AuditJob], None],
    write: Callable[[str, Mapping[str, object]], None],
    pick: Callable[[list[int]], int] = random.choice,
) -> int:
    """The groups behind screened ``rows`` (batch rows in the order of ``groups``' records):
    each sender's records of each group go to the auditor ahead of sampled audits (as
    probation audits, never dropped for room), ``screened.jsonl`` says which, and the count of
    audits asked is returned. A sender gone from the fleet is not audited (its records were
    left out all the same)."""
    records = [r for g in groups for r in g]
    flagged = [records[i] for i in sorted(set(rows)) if 0 <= i < len(records)]
    by_group = {r.group_id: g for g in groups for r in g}
    asked, seen = 0, set()
    for r in flagged:
        if (r.group_id, r.worker_id) in seen:
            continue
        seen.add((r.group_id, r.worker_id))
        key = key_of(r.worker_id)
        mine = sorted(
            (x for x in by_group[r.group_id] if x.worker_id == r.worker_id),
            key=lambda x: x.sample_idx,
        )
        if key is not None:
            recs, at = one_version(mine, pick)
            submit(AuditJob(r.worker_id, key, recs, True, at, screened=True))
            asked += 1
    write(
        "screened",
        {
            "groups": sorted({g for g, _ in seen}),
            "workers": sorted({w for _, w in seen}),
            "rows": len(flagged),
        },
    )
    log.warning(
        "screen: %d row(s) of %d group(s) from %s claimed log-probs far from the policy's: "
        "left out of the step, %d audit(s) asked (security.screen_nats)",
        len(flagged),
        len({g for g, _ in seen}),
        sorted({w for _, w in seen}),
        asked,
    )
    return asked
