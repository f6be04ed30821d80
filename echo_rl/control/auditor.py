"""Audits of delivered groups: were these tokens sampled from the snapshot the worker claims,
and are the behaviour log-probs the ones that snapshot gives?

The learner keeps the last few published snapshots (their payload bytes, exactly what workers
installed). For an audited group it installs the claimed version into an audit copy of the
model and recomputes, for every trained token t of every sample, at the sampling temperature:
the log-prob ``l_t`` of the token, and the entropy ``H_t`` of the distribution it was drawn from.

Two checks, each per group:

* ``logprob``: the mean over a sample's tokens of ``|claimed - l_t|`` must stay under
  ``security.audit_logprob_tol``. Honest backends differ by about 0.01 nats per token (bf16,
  vLLM kernels; ``../shared/research/security.md``), so 0.5 leaves a wide margin: this compares
  trajectory statistics, never single tokens.
* ``sampling``: for a token drawn from its distribution, ``E[l_t + H_t] = 0``. With
  ``Y_t = max(l_t + H_t, -c)`` (so ``E[Y_t] >= 0`` and ``-c <= Y_t <= H_t``), the sum over the
  group's tokens is a supermartingale with bounded steps, and Azuma-Hoeffding bounds
  ``P(sum Y_t <= -s) <= exp(-2 s^2 / sum (H_t + c)^2)``. The check fails when the sum falls
  below ``s`` set for ``security.audit_alpha``: an honest group fails with probability at most
  ``audit_alpha``, whatever the model and however short the samples. Tokens a worker chose
  instead of sampling (garbage, a fixed answer) sit far below ``-H_t`` under a model that has
  learned anything, and fail it; under a near-uniform (random-init) model they cannot be told
  from samples, and cannot do more harm than samples either.

Cost is bounded: the trainer thread runs audits between steps for at most
``security.audit_budget`` of its time over the run (a credit each step adds to, so a round
dearer than one step's share waits for it rather than never running; ``Auditor.run``),
handed-back prefixes first, then groups the step-start screen left out (echo_rl/control/screen.py;
both run in debt, one a round, so they are checked while their snapshot is held), then
probation jobs, the least-audited worker's first; the queue of waiting jobs is
bounded (``security.audit_queue``), overflow drops the oldest non-probation job and counts it
(``dropped``). A job whose snapshot is no longer held is skipped and counted (``expired``).
"""

from __future__ import annotations

import logging
import math
import mmap
import threading
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from echo_rl.control.intake import AuditJob
from echo_rl.control.reputation import Verdict
from echo_rl.core.config import EchoConfig
from echo_rl.core.steprow import StepRow
from echo_rl.data.answers import answer_bias
from echo_rl.data.records import Record

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

    from echo_rl.core.layout import TensorLayout

log = logging.getLogger("echo.auditor")


@dataclass
class TokenStats:
    """Per trained token of one sample, under the claimed snapshot."""

    logprob: list[float]  # recomputed log-prob of the token
    entropy: list[float]  # entropy of the distribution it was drawn from
    claimed: list[float]  # what the worker reported


def logprob_check(samples: list[TokenStats], tol: float) -> tuple[bool, dict[str, float]]:
    gaps = [
        sum(abs(c - lp) for c, lp in zip(s.claimed, s.logprob)) / len(s.logprob)
        for s in samples
        if s.logprob
    ]
    worst = max(gaps, default=0.0)
    return worst <= tol, {"max_mean_gap": round(worst, 4), "tol": tol}


def sampling_check(
    samples: list[TokenStats], alpha: float, clip: float
) -> tuple[bool, dict[str, float]]:
    total, spread = 0.0, 0.0
    for s in samples:
        for lp, h in zip(s.logprob, s.entropy):
            total += max(lp + h, -clip)
            spread += (h + clip) ** 2
    threshold = -math.sqrt(math.log(1 / alpha) * spread / 2)
    tokens = sum(len(s.logprob) for s in samples)
    # No trained token, no evidence: a poker group whose opponent folded before the policy
    # ever acted has none, and 0 > -0.0 would have been a strike against an honest worker.
    return tokens == 0 or total > threshold, {
        "sum": round(total, 3),
        "threshold": round(threshold, 3),
        "tokens": tokens,
    }


class Auditor:
    def __init__(
        self,
        cfg: EchoConfig,
        tokenizer: PreTrainedTokenizerBase,
        report: Callable[[Verdict], None],
        is_quarantined: Callable[[str], bool] = lambda w: False,
        answer_tokens: tuple[int, ...] | None = None,
        borrow: torch.nn.Module | None = None,
        spill_to: Path | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        """``borrow``: the trainer's own model, audited in between steps instead of a copy
        of it (docs/memory.md): its weights are spilled to ``spill_to`` (a directory), the
        claimed version is installed, and the weights come back bit for bit before the next
        step. None: a model of the auditor's own (4 bytes a parameter more)."""
        sc = cfg.security
        self.answer_tokens = (
            answer_tokens  # the workers' restricted sampler (echo_rl/data/answers.py)
        )
        self.cfg, self.tokenizer, self.report = cfg, tokenizer, report
        self.is_quarantined = is_quarantined
        self.tol, self.alpha, self.clip = sc.audit_logprob_tol, sc.audit_alpha, sc.audit_clip
        self.keep = cfg.learner.staleness + 2  # every version a record may still claim
        self._snapshots: OrderedDict[int, tuple[list[TensorLayout], bytes | mmap.mmap]] = (
            OrderedDict()
        )
        self._jobs: deque[AuditJob] = deque()
        self._max_jobs = sc.audit_queue
        self._lock = threading.Lock()
        self._model: Any = None
        self._installed = -1
        self._audited: Counter[str] = Counter()  # worker id -> jobs taken
        self.done = self.failed = self.dropped = self.expired = 0
        self.seconds = 0.0
        self._borrow, self._spill_to = borrow, spill_to
        self.clock = clock
        self._credit = 0.0  # seconds of audit time the steps have paid for (run())

    # ------------------------------------------------------------------ inputs (any thread)

    def add_snapshot(
        self, version: int, tensors: list[TensorLayout], payload: bytes | mmap.mmap
    ) -> None:
        with self._lock:
            # a spilled payload (echo_rl.core.spill) is a read-only map already: kept as it is
            self._snapshots[version] = (
                tensors,
                payload if isinstance(payload, mmap.mmap) else bytes(payload),
            )
            while len(self._snapshots) > self.keep:
                self._snapshots.popitem(last=False)

    def payloads(self) -> list[object]:
        """The versions held for audits (echo_rl.core.memstat counts them)."""
        with self._lock:
            return [payload for _, payload in self._snapshots.values()]

    def model_tensors(self) -> list[torch.Tensor]:
        """The audit model's weights (None before its first audit)."""
        return [] if self._model is None else list(self._model.state_dict().values())

    def submit(self, job: AuditJob) -> None:
        with self._lock:
            if len(self._jobs) >= self._max_jobs:
                victim = next(
                    (j for j in self._jobs if not (j.probation or j.prefix)), self._jobs[0]
                )
                self._jobs.remove(victim)
                self.dropped += 1
            self._jobs.append(job)

    @property
    def waiting(self) -> int:
        with self._lock:
            return len(self._jobs)

    # ------------------------------------------------------------------ the work (trainer thread)

    def after_step(self, row: StepRow, t_train: float) -> None:
        """Audit waiting groups for at most ``security.audit_budget`` of the learner's time
        (audit / (train + audit) <= budget) after a step of ``t_train`` s; their cost and the
        counts go into the step's metrics ``row``."""
        share = self.cfg.security.audit_budget
        used = self.run(share / (1 - share) * t_train if share < 1 else float("inf"))
        row.t_audit, row.audits, row.audit_failures = round(used, 4), self.done, self.failed
        row.audit_queue, row.audits_dropped = self.waiting, self.dropped
        row.audits_expired = self.expired

    def run(self, budget_s: float) -> float:
        """Audit waiting groups, probation first, with this step's ``budget_s``; seconds used.

        The budget is a credit carried from call to call: a round runs while the credit is
        positive and takes at least one job, and what it overspends the next calls pay back
        before another round. A round that costs more than one step's share (borrowing the
        trainer's model, one long group: a small LoRA step on a slow disk) still runs once
        enough steps have paid for it, so audits never starve; over the run they keep their
        share. Credit is never banked beyond one step's budget: an idle queue buys no burst.
        A handed-back prefix's check runs in debt too (a group waits for it), and so does a
        screened group's (its snapshot would be gone before the credit came back), one a
        round."""
        self._credit = min(self._credit + budget_s, budget_s)
        with self._lock:
            urgent = any(j.prefix or j.screened for j in self._jobs)
            if not self._jobs or (self._credit <= 0 and not urgent):
                return 0.0
        t0 = self.clock()
        if self._borrow is not None:
            with self._borrowed():
                self._run_jobs(t0)
        else:
            self._run_jobs(t0)
        used = self.clock() - t0
        self._credit -= used
        self.seconds += used
        return used

    def _run_jobs(self, t0: float) -> None:
        while (job := self._next()) is not None:
            self._audit(job)
            if self.clock() - t0 >= self._credit:
                break

    @contextmanager
    def _borrowed(self) -> Iterator[None]:
        """The trainer's model as the audit model for one round: its weights saved to a spill
        file first and read straight back into the parameters after, whatever happens in
        between (no copy of them in RAM, mapped or not)."""
        import torch

        from echo_rl.core.spill import SpillWriter

        model, spill_to = self._borrow, self._spill_to
        assert model is not None and spill_to is not None  # given together (the constructor)
        params = [p for _, p in model.named_parameters()]
        saved = SpillWriter(spill_to)
        try:
            for p in params:
                saved.write(_raw(p))
            training = model.training
            self._model, self._installed = model.eval(), -1
            try:
                yield
            finally:
                offset = 0
                with torch.no_grad():
                    for p in params:
                        raw = _raw(p)  # the parameter's own bytes: read into in place
                        saved.read_into(raw, offset)
                        offset += raw.nbytes
                model.train(training)
                self._model, self._installed = None, -1
        finally:
            saved.close()

    def _next(self) -> AuditJob | None:
        with self._lock:
            if not self._jobs:
                return None
            # Handed-back prefixes first (a group waits for them), then screened groups, then
            # probation, and among each the worker audited least so far: each newcomer's
            # first group is looked at before anyone's second, so a liar needs few steps.
            pool = (
                [j for j in self._jobs if j.prefix]
                or [j for j in self._jobs if j.screened]
                or [j for j in self._jobs if j.probation]
                or [self._jobs[0]]
            )
            job = min(pool, key=lambda j: self._audited[j.worker_id])
            self._jobs.remove(job)
            self._audited[job.worker_id] += 1
            return job

    def _audit(self, job: AuditJob) -> None:
        if self.is_quarantined(job.worker_id):
            return
        with self._lock:
            snap = self._snapshots.get(job.version)
        if snap is None:
            self.expired += 1
            return
        samples = self.token_stats(job.version, snap, job.records)
        # a prefix's author answers for it; a screened group's failure is decisive (the screen
        # and the recomputation both found the claimed log-probs far from the policy's)
        kind = "handback_" if job.prefix else "screened_" if job.screened else ""
        for check, (ok, stats) in (
            ("logprob", logprob_check(samples, self.tol)),
            ("sampling", sampling_check(samples, self.alpha, self.clip)),
        ):
            self.done += 1
            self.failed += not ok
            self.report(
                Verdict(job.worker_id, job.key, job.group_id, job.version, kind + check, ok, stats)
            )

    def token_stats(
        self,
        version: int,
        snap: tuple[list[TensorLayout], bytes | mmap.mmap],
        records: list[Record],
    ) -> list[TokenStats]:
        import torch

        from echo_rl.core.lora import load_policy_model
        from echo_rl.core.models import install_payload, resolve_device

        if self._model is None:  # a copy of the policy: the trainer's weights move on
            device = resolve_device(self.cfg.learner.device, "learner.device")
            # with LoRA: the base model plus an adapter, into which the claimed version's
            # adapter tensors are installed (base + adapter of that version)
            model, _ = load_policy_model(self.cfg.model, self.cfg.learner.lora, self.tokenizer)
            self._model = model.to(device).eval()
        if self._installed != version:
            install_payload(self._model, *snap)  # a spilled map's pages go back as it reads
            self._installed = version
        with torch.no_grad():
            return self._batch(records)

    def _batch(self, records: list[Record]) -> list[TokenStats]:
        """One right-padded forward pass over the group's samples."""
        import torch

        seqs = [r.prompt_ids + r.completion_ids for r in records]
        width = max(len(q) for q in seqs)
        ids = torch.zeros((len(seqs), width), dtype=torch.long)
        attn = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, q in enumerate(seqs):
            ids[i, : len(q)] = torch.tensor(q)
            attn[i, : len(q)] = 1
        dev = self._model.device
        logits = self._model(input_ids=ids.to(dev), attention_mask=attn.to(dev)).logits[:, :-1]
        scaled = logits.float() / self.cfg.worker.temperature
        if self.answer_tokens is not None:  # the distribution the worker sampled from
            scaled = scaled + answer_bias(self.answer_tokens, scaled.shape[-1], scaled.device)
        logp = torch.log_softmax(scaled, dim=-1).cpu()
        return [self._one(rec, logp[i]) for i, rec in enumerate(records)]

    @staticmethod
    def _one(rec: Record, logp: torch.Tensor) -> TokenStats:
        import torch

        start = len(rec.prompt_ids) - 1  # position j predicts token j+1
        pos = torch.arange(start, start + len(rec.completion_ids))
        lp = logp[pos, torch.tensor(rec.completion_ids)]
        ent = -(logp[pos].exp() * logp[pos]).nansum(-1)  # 0 * -inf is 0 here, not NaN
        mask = getattr(rec, "loss_mask", None) or [1] * len(rec.completion_ids)
        keep = [i for i, m in enumerate(mask) if m]
        return TokenStats(
            [lp[i].item() for i in keep],
            [ent[i].item() for i in keep],
            [rec.logprobs[i] for i in keep],
        )


def _raw(p: torch.Tensor) -> memoryview:
    """A CPU parameter's bytes: a writable view of its own storage (through numpy)."""
    import torch

    return p.detach().view(-1).view(torch.uint8).numpy().data
