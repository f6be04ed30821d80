"""An adapter's or a config's fault told apart from a worker's lie (issue 56).

Some refusals follow from the run's own limits, not from what a worker chose: a record longer
than ``worker.max_new_tokens`` (``bad_length``: an adapter whose episodes outgrow the limit, a
worker of another release) or a sample past its task's budget (``over_budget``). The record is
refused either way, and the rest of its group then arrives partial; one worker doing so may be
lying, and is struck for it (a failed ``whole_group`` or ``budget`` check, echo_rl/control/intake.py).
When the same refusal comes from ``NEEDED`` independent witnesses (a token's keys are one,
``Gate.witness``; in open mode each key is one), it is the run's own: the learner says so once,
naming the adapter and the fix, on the console and in the log, forgives the strikes it gave
for it, and strikes nobody for it again in this run. The records stay refused: nothing over a
limit is trained.

What that costs against liars: two tokens (or two open-mode keys) buy freedom from strikes for
these two refusals only; each such record is still refused, and a whole group of them is still
a delivery that trains nothing (its bytes are bounded per key by ``security.msgs_per_s`` and
``bytes_per_s``). Bounded: at most ``MAX_WITNESSES`` witnesses and ``MAX_STRUCK`` struck workers
kept per reason.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable

from echo_rl.control.reputation import Reputation

log = logging.getLogger("echo.learner")

FAULTS = ("bad_length", "over_budget")  # refusals the run's own limits can cause alike
NEEDED = 2  # independent witnesses that make a refusal the run's own
MAX_WITNESSES = 64
MAX_STRUCK = 1024
FIX = {
    "bad_length": "raise worker.max_new_tokens (the longest record the learner takes), or make "
    "the adapter's episodes shorter (its max_completion_tokens, its turns)",
    "over_budget": "check the task's generation budget (adapter.presets.NAME.generation "
    "max_new_tokens) against what the adapter's prompts need",
}


class FaultBook:
    """``witness``: a key's witness (its token; None in open mode: the key itself)."""

    def __init__(self, witness: Callable[[str], str | None], reputation: Reputation, adapter: str):
        self.witness, self.reputation, self.adapter = witness, reputation, adapter
        self.witnesses: dict[str, set[str]] = {r: set() for r in FAULTS}
        self.struck: dict[str, Counter[str]] = {r: Counter() for r in FAULTS}  # worker -> strikes
        self.run_s: set[str] = set()  # the reasons found to be the run's own

    def owns(self, reason: str, worker_id: str, key: str, detail: str) -> bool:
        """A group of ``worker_id`` arrived partial (or over budget) because of a ``reason``
        refusal: True when that refusal is the run's own (no strike); False when it may be
        this worker's lie (the caller strikes, and it is remembered for forgiveness)."""
        if reason in self.run_s:
            return True
        seen = self.witnesses[reason]
        if len(seen) < MAX_WITNESSES:
            seen.add(self.witness(key) or key)
        if len(seen) < NEEDED:
            if len(self.struck[reason]) < MAX_STRUCK or worker_id in self.struck[reason]:
                self.struck[reason][worker_id] += 1
            return False
        self.run_s.add(reason)
        forgiven = {w: n for w, n in self.struck[reason].items() if self.reputation.forgive(w, n)}
        log.error(
            "adapter %s: records refused as %s from %d independent workers (%s): the run's own "
            "limit, not the workers' fault; nobody is struck for it from now on%s, and the "
            "records stay refused (nothing is trained). Fix: %s",
            self.adapter,
            reason,
            len(seen),
            detail,
            f" (strikes forgiven: {forgiven})" if forgiven else "",
            FIX[reason],
        )
        return True
