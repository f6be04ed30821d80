"""The long-tail cut's carry (``worker.tail_cut``, docs/scheduling.md, "Long-tail cut").

When most of a request's fresh samples have ended, the backend cuts the rest (the few long
ones that would keep every row of the batch waiting). The groups that ended are delivered;
a group with a sample still running is *carried*: kept leased to this worker, with what it
holds as its prefixes, and continued in the worker's next rollout beside the new groups,
where it is never cut again. Each group is still delivered whole, by the one worker that
generated all of it, so nothing crosses to another worker and no hand-back check is needed.
A carried sample continued after a new version was installed has tokens of two versions;
the learner audits one of them, drawn at random (``echo_rl.control.intake.one_version``).
"""

from __future__ import annotations

from echo_rl.core import wire
from echo_rl.worker.backends import Sample
from echo_rl.worker.records import runs


class Carry:
    """Groups cut in their tail, waiting for this worker's next rollout (at most one
    rollout's groups: each is continued, uncut, in the very next one)."""

    def __init__(self) -> None:
        self.groups: list[wire.Group] = []

    def ids(self) -> list[str]:
        return [g.group_id for g in self.groups]

    def keep(self, groups: list[wire.Group], samples: list[list[Sample]], version: int) -> None:
        """The cut groups, each with its samples so far as prefixes (finished ones too: a
        prefix that ended is delivered as it is)."""
        for g, row in zip(groups, samples):
            prefixes = [
                wire.Prefix(
                    sample_idx=i,
                    ids=s.completion_ids,
                    logprobs=s.logprobs,
                    versions=runs(s, version),
                )
                for i, s in enumerate(row)
                if s.completion_ids
            ]
            self.groups.append(g.model_copy(update={"prefixes": prefixes}))

    def take(self) -> list[wire.Group]:
        out, self.groups = self.groups, []
        return out

    def handback(self, worker_id: str, reason: str = "preempted") -> wire.Handback:
        """The carried groups given back when the worker stops (or yields to its owner)
        before continuing them."""
        groups, self.groups = self.groups, []
        return wire.Handback(
            worker_id=worker_id,
            reason="yielded" if reason == "yielded" else "preempted",
            groups=[g.group_id for g in groups],
            prefixes={g.group_id: list(g.prefixes) for g in groups},
        )
