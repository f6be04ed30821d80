"""The lying workers of the security drill's ``liars`` mode (docs/security.md, "Trust but verify").

    python benchmarks/drill_workers.py --kind forge_rewards [--truth FILE] join LINE [echo-worker options]

Everything after the drill's own options is ``echo-worker``'s command line: the liar is a real
worker (``echo_rl.worker.agent.Worker``) started by ``echo_rl.cli.worker.main``, with its CURVE identity, join
line and token, speaking the real protocol. Only its generation part's ``generate_and_score``
is overridden (``LyingGeneration``): the honest samples and the adapter's rewards are computed
as usual, then one lie is applied to what is delivered. Kinds:

  * ``honest``: no lie (the drill's honest workers, so that their true rewards are logged too);
  * ``forge_rewards``: claims reward 1.0 for every sample the adapter scored below 1, and 0.0
    for the correct ones: the group advantages are inverted, training unlearns the task;
  * ``patient_logprobs``: honest for its first 8 groups (through probation), then
    ``fake_logprobs`` in one group of every 20 (issue 52);
  * ``fake_logprobs``: every behaviour log-prob claimed as ``--fake-logprob`` (default -20). The
    learner weighs a token by w = min(exp(logp_old - logp_behaviour), is_cap) (echo_rl.learner.loss,
    token_truncate): -20 pins w at the cap (2x) on every token of this worker, the most
    weight the truncation allows, and removes the off-policy correction of its stale samples.
    (-0.01, a claimed probability of ~1, would instead shrink w to ~p_old and mute the worker:
    a nuisance, not damage.) Under ``is_mode = "token_mask"`` -20 zeroes the tokens instead;
  * ``garbage_tokens``: completions replaced by tokens the worker chose (random ids, or
    ``--garbage-text`` tokenized), same length, claimed with the real sample's log-probs, so they
    look sampled; the rewards are the adapter's honest scores of the garbage, so that only a
    log-prob / sampling audit can tell;
  * ``drop_low``: the lowest-reward ``--drop-share`` of each group's samples is not delivered;
    the rest are sent as samples 0..k-1 of a group of n (the group stays partial).

``--truth FILE`` appends one JSON line per generated batch: per group, the rewards the adapter
gave, the rewards claimed, how many samples were sent and how many had their tokens or
log-probs replaced. The drill compares it with what the learner stored.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import random
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from echo_rl.core import wire  # noqa: E402
from echo_rl.worker.agent import Worker  # noqa: E402
from echo_rl.worker.backends import Sample  # noqa: E402
from echo_rl.worker.generation import Generation  # noqa: E402

Scored = list[tuple[Sample, float]]  # one group's samples and their rewards
KINDS = (
    "honest",
    "forge_rewards",
    "fake_logprobs",
    "patient_logprobs",
    "garbage_tokens",
    "drop_low",
)
PATIENT_FIRST, PATIENT_EVERY = 8, 20  # patient_logprobs: honest groups first, then 1 lie in 20


@dataclasses.dataclass(frozen=True)
class Lie:
    kind: str
    fake_logprob: float = -20.0
    garbage_text: str = ""  # "" = random token ids
    drop_share: float = 0.5
    seed: int = 0


class LyingGeneration(Generation):
    """The worker's generation part (``echo_rl.worker.generation.Generation``) with one lie
    (``lie.kind``) in what it delivers."""

    def __init__(self, *args: Any, lie: Lie, truth: str | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.lie = lie
        self.truth = truth
        self.rng = random.Random(lie.seed)

    def generate_and_score(self, groups: list[wire.Group]) -> list[Scored]:
        honest = super().generate_and_score(groups)
        sent = [
            getattr(self, f"_lie_{self.lie.kind}")(g, scored) for g, scored in zip(groups, honest)
        ]
        if self.truth:
            self._write_truth(groups, honest, sent)
        return sent

    # ------------------------------------------------------------------ the lies

    def _lie_honest(self, group: wire.Group, scored: Scored) -> Scored:
        return scored

    def _lie_forge_rewards(self, group: wire.Group, scored: Scored) -> Scored:
        return [(s, 0.0 if r >= 1.0 else 1.0) for s, r in scored]

    def _lie_patient_logprobs(self, group: wire.Group, scored: Scored) -> Scored:
        """Honest through probation (its first ``PATIENT_FIRST`` groups), then
        ``fake_logprobs`` in one group of every ``PATIENT_EVERY`` (issue 52's patient liar)."""
        self.groups_sent = getattr(self, "groups_sent", 0) + 1
        n = self.groups_sent - PATIENT_FIRST
        return (
            self._lie_fake_logprobs(group, scored) if n > 0 and n % PATIENT_EVERY == 0 else scored
        )

    def _lie_fake_logprobs(self, group: wire.Group, scored: Scored) -> Scored:
        return [
            (dataclasses.replace(s, logprobs=[self.lie.fake_logprob] * len(s.logprobs)), r)
            for s, r in scored
        ]

    def _lie_garbage_tokens(self, group: wire.Group, scored: Scored) -> Scored:
        backend, adapter = self.held.backend, self.held.adapter
        assert backend is not None and adapter is not None
        tok = backend.tokenizer
        out = []
        for s, _ in scored:
            ids = self._garbage(len(s.completion_ids))
            reward = adapter.reward(group.task, ids, tok.decode(ids, skip_special_tokens=True))
            out.append((dataclasses.replace(s, completion_ids=ids), float(reward)))
        return out

    def _garbage(self, n: int) -> list[int]:
        """``n`` token ids of the worker's choosing: the fixed text's (cycled), or random
        non-special ids."""
        backend = self.held.backend
        assert backend is not None
        tok = backend.tokenizer
        fixed = (
            tok.encode(self.lie.garbage_text, add_special_tokens=False)
            if self.lie.garbage_text
            else []
        )
        if fixed:
            return [fixed[i % len(fixed)] for i in range(n)]
        special = set(tok.all_special_ids)
        vocab = min(len(tok), backend.vocab_size)
        ids: list[int] = []
        while len(ids) < n:
            t = self.rng.randrange(vocab)
            if t not in special:
                ids.append(t)
        return ids

    def _lie_drop_low(self, group: wire.Group, scored: Scored) -> Scored:
        keep = max(1, round(len(scored) * (1 - self.lie.drop_share)))
        return sorted(scored, key=lambda sr: sr[1], reverse=True)[:keep]

    # ------------------------------------------------------------------ the truth log

    def _write_truth(
        self, groups: list[wire.Group], honest: list[Scored], sent: list[Scored]
    ) -> None:
        rows = []
        for g, h, s in zip(groups, honest, sent):
            # Position i of what was sent is sample i of the honest group, except for drop_low
            # (it reorders and drops: only the count changes).
            pairs = list(zip(h, s)) if self.lie.kind != "drop_low" else []
            rows.append(
                {
                    "group_id": g.group_id,
                    "n": g.n,
                    "sent": len(s),
                    "true": [r for _, r in h],
                    "claimed": [r for _, r in s],
                    "tokens_replaced": sum(
                        a.completion_ids != b.completion_ids for (a, _), (b, _) in pairs
                    ),
                    "logprobs_replaced": sum(a.logprobs != b.logprobs for (a, _), (b, _) in pairs),
                }
            )
        line = {
            "worker_id": self.session.worker_id,
            "kind": self.lie.kind,
            "version": self.held.version,
            "groups": rows,
        }
        with open(self.truth, "a") as f:
            f.write(json.dumps(line) + "\n")


class LyingWorker(Worker):
    """A ``Worker`` whose deliveries carry one lie (``lie.kind``)."""

    def __init__(self, *args: Any, lie: Lie, truth: str | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.make_generation = functools.partial(LyingGeneration, lie=lie, truth=truth)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="drill_workers.py",
        usage="%(prog)s --kind KIND [options] join LINE [echo-worker join options]",
        description="A worker that lies one way (the security drill).",
    )
    p.add_argument("--kind", required=True, choices=KINDS)
    p.add_argument(
        "--truth",
        default=None,
        metavar="FILE",
        help="append per batch what the adapter scored and what was claimed",
    )
    p.add_argument(
        "--fake-logprob",
        type=float,
        default=-20.0,
        help="fake_logprobs: the log-prob claimed for every token",
    )
    p.add_argument(
        "--garbage-text",
        default="",
        help="garbage_tokens: send this text's tokens (default: random token ids)",
    )
    p.add_argument(
        "--drop-share",
        type=float,
        default=0.5,
        help="drop_low: share of each group's samples (lowest rewards) not delivered",
    )
    p.add_argument("--seed", type=int, default=0, help="garbage_tokens: seed of the random ids")
    return p


def main(argv: list[str] | None = None) -> int:
    args, rest = build_parser().parse_known_args(argv)
    if not 0 <= args.drop_share < 1:
        print("drill_workers.py: --drop-share must be in [0, 1)", file=sys.stderr)
        return 2
    if args.fake_logprob > 0:
        print("drill_workers.py: --fake-logprob must be <= 0 (a log-probability)", file=sys.stderr)
        return 2
    from echo_rl.cli import worker as cli

    lie = Lie(args.kind, args.fake_logprob, args.garbage_text, args.drop_share, args.seed)
    return cli.main(
        rest, make_worker=lambda *a, **kw: LyingWorker(*a, lie=lie, truth=args.truth, **kw)
    )


if __name__ == "__main__":
    sys.exit(main())
