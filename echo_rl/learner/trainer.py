"""One learner step: log-probs at step start, then ``updates_per_step`` mini-batch updates."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import logging
import math
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import overload

import torch

from echo_rl.control.screen import screen_rows
from echo_rl.core.config import LearnerConfig
from echo_rl.core.lora import base_of, is_peft
from echo_rl.core.steprow import COL  # the trainer names its numbers as the step row does
from echo_rl.data.adapter import LearnerBatch
from echo_rl.data.answers import answer_bias
from echo_rl.learner.head import head_logprobs
from echo_rl.learner.loss import LossConfig, grpo_loss
from echo_rl.learner.parallel import Parallel, Single

log = logging.getLogger("echo.trainer")


def _blame(batch: LearnerBatch, rows: torch.Tensor) -> list[int]:
    """The rows of a skipped mini-batch behind it: those whose own inputs are not finite
    (reward, advantage, a trained behaviour log-prob), else all of them (a gradient that
    overflowed has no single culprit)."""
    trained = batch.loss_mask[rows] > 0
    blp_ok = torch.where(trained, torch.isfinite(batch.behaviour_logprobs[rows]), True).all(-1)
    ok = torch.isfinite(batch.advantages[rows]) & torch.isfinite(batch.rewards[rows]) & blp_ok
    bad = rows[~ok] if not ok.all() else rows
    return [int(r) for r in bad]


def token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    loss_mask: torch.Tensor | None = None,
    temperature: float = 1.0,
    answer_tokens: Sequence[int] | None = None,
    fused: bool = True,
) -> torch.Tensor:
    """log p(token_{j+1} | tokens_{<=j}) for every position j: shape [B, L-1], under
    softmax(logits / temperature), the distribution a sampler at that temperature draws from
    (renormalised over ``answer_tokens`` when the adapter restricts answers).

    With ``loss_mask`` ([B, L-1]) only the span of columns some row trains on is computed
    (zeros elsewhere): the prompt in front needs no logits and the padding behind it no forward
    pass. On a real vocabulary (150k) the logits of prompt positions are most of the memory.

    ``fused``: the LM head run here a chunk at a time where ``fused_head`` knows the model.
    """
    full = (0, input_ids.shape[1] - 2)
    s, e = (_trained_span(loss_mask) if loss_mask is not None else None) or full
    ids, mask, targets = (
        input_ids[:, : e + 1],
        attention_mask[:, : e + 1],
        input_ids[:, s + 1 : e + 2],
    )
    head = fused_head(model) if fused else None
    if head is None:
        logits = _logits(model, ids, mask, keep=e + 1 - s)
        lp = selective_logprobs(logits, targets, temperature, answer_tokens)
    else:  # the head and the log-softmax in chunks (echo_rl/learner/head.py)
        decoder, weight = head
        out = decoder(input_ids=ids, attention_mask=mask, use_cache=False)
        hidden = out.last_hidden_state[:, s:]
        bias = (
            None
            if answer_tokens is None
            else answer_bias(answer_tokens, weight.shape[0], weight.device)
        )
        lp = head_logprobs(hidden, weight, targets, temperature, bias)
    return torch.nn.functional.pad(lp, (s, input_ids.shape[1] - 2 - e))


# Causal LMs whose logits are exactly lm_head(final hidden state): no soft-capping, scaling or
# bias (Gemma's, Cohere's, Granite's heads are left to the model's own forward).
FUSED_HEAD_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})


def fused_head(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.Tensor] | None:
    """The decoder stack and the LM head's weight when ``token_logprobs`` may run the head
    itself (echo_rl/learner/head.py), else None: the model's own forward then makes the logits.
    Not under FSDP2, whose root module gathers the head's shards in its own forward."""
    from torch.distributed.fsdp import FSDPModule

    inner = base_of(model)
    config = getattr(inner, "config", None)
    if getattr(config, "model_type", None) not in FUSED_HEAD_TYPES:
        return None
    if isinstance(model, FSDPModule) or isinstance(inner, FSDPModule):  # a peft model: the outer
        return None
    get_head = getattr(inner, "get_output_embeddings", None)
    head, decoder = get_head() if callable(get_head) else None, getattr(inner, "model", None)
    if type(head) is not torch.nn.Linear or head.bias is not None or decoder is None:
        return None  # e.g. a LoRA adapter on the head itself
    return decoder, head.weight


def _trained_span(loss_mask: torch.Tensor) -> tuple[int, int] | None:
    """First and last target column any row trains on (None: no row trains on anything)."""
    cols = loss_mask.any(dim=0).nonzero().flatten()
    return (int(cols[0]), int(cols[-1])) if len(cols) else None


def _logits(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, keep: int
) -> torch.Tensor:
    """Logits of the last ``keep`` positions; the LM head runs only there when the model
    supports ``logits_to_keep`` (current transformers models do)."""
    inner = base_of(model)  # peft passes it on
    if "logits_to_keep" in inspect.signature(inner.forward).parameters:
        out = model(
            input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=keep, use_cache=False
        )  # no key/value cache: nothing decodes after this pass
    else:  # an older model class: full logits, then slice
        out = model(input_ids=input_ids, attention_mask=attention_mask)
    logits: torch.Tensor = out.logits[:, -keep:]
    return logits


def selective_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    answer_tokens: Sequence[int] | None = None,
) -> torch.Tensor:
    """log_softmax(logits / temperature).gather(targets) without the [B, K, V] log-softmax
    tensor: the target's scaled logit minus the log-sum-exp, in float32. Low-precision logits
    go one row at a time so that only one row's float32 copy exists at once (the temperature
    is applied to that copy, not to a second low-precision [B, K, V] tensor).

    ``answer_tokens``: the log-sum-exp runs over those tokens only (echo_rl/data/answers.py).
    A target outside the set gets a finite number, not -inf: such positions are the context
    between an episode's answers, which the loss mask leaves out (a -inf there would turn
    the masked product into NaN)."""
    bias = (
        None
        if answer_tokens is None
        else answer_bias(answer_tokens, logits.shape[-1], logits.device)
    )

    def rows_logprobs(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        if temperature != 1.0:
            x = x / temperature
        norm = torch.logsumexp(x if bias is None else x + bias, dim=-1)
        return x.gather(-1, t.unsqueeze(-1)).squeeze(-1) - norm

    if logits.dtype in (torch.float32, torch.float64):
        return rows_logprobs(logits, targets)
    return torch.stack([rows_logprobs(row.float(), t) for row, t in zip(logits, targets)])


def truncated_rows(
    input_ids: torch.Tensor, loss_mask: torch.Tensor, eos_token_id: int
) -> torch.Tensor:
    """[B] bool: rows whose last trained token (the last token the policy generated) is not
    end-of-sequence, i.e. generation stopped at max_new_tokens. Rows that train on nothing: False."""
    trained = loss_mask > 0
    cols = torch.arange(loss_mask.shape[1], device=loss_mask.device).expand_as(loss_mask)
    last = torch.where(trained, cols, -1).max(dim=1).values  # last trained target column
    token = input_ids.gather(1, (last + 1).clamp(min=1).unsqueeze(1)).squeeze(1)
    return (last >= 0) & (token != eos_token_id)


@dataclass(frozen=True)
class Sampling:
    """How the workers sample, which the trainer's log-probs follow. ``temperature``: the
    workers' sampling temperature (``worker.temperature``), at which every log-prob is computed;
    ``max_new_tokens``: the constant of ``seq-mean-token-sum-norm``; ``eos_token_id``: needed
    by ``mask_truncated_completions``; ``answer_tokens``: the adapter's restricted answers
    (echo_rl/data/answers.py), under which every log-prob is computed."""

    temperature: float = 1.0
    max_new_tokens: int = 0
    eos_token_id: int | None = None
    answer_tokens: Sequence[int] | None = None


class Trainer:
    """``sampling``: how the workers sample (``Sampling``); ``screen_nats``: the screen's
    threshold (echo_rl/control/screen.py, 0: off)."""

    def __init__(
        self,
        model: torch.nn.Module,
        cfg: LearnerConfig,
        seed: int = 0,
        parallel: Parallel | None = None,
        *,
        sampling: Sampling = Sampling(),
        screen_nats: float = 0.0,
    ):
        temperature, max_new_tokens = sampling.temperature, sampling.max_new_tokens
        eos_token_id, answer_tokens = sampling.eos_token_id, sampling.answer_tokens
        self.model = model
        # echo_rl/control/screen.py: rows whose claimed log-probs are this far from the step-start
        # ones are left out of the step (0: off; one process only)
        self.screen_nats = screen_nats if (parallel is None or parallel.world == 1) else 0.0
        self.screened_rows: list[int] = []  # rows the last step left out for the screen
        self.answer_tokens = answer_tokens
        self.par = parallel or Single()
        self.cfg = cfg
        self.temperature = temperature
        self.loss_cfg = loss_config(cfg, max_new_tokens)
        if cfg.mask_truncated_completions and eos_token_id is None:
            raise ValueError(
                "learner.mask_truncated_completions needs the tokenizer's eos_token_id: "
                "pass eos_token_id to Trainer, or set it to false"
            )
        self.eos_token_id = eos_token_id
        # The trained parameters: all of them, or a LoRA adapter's (the base is frozen).
        trained = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.Adam(trained, lr=cfg.lr, fused=fusable(trained, self.par))
        # The reference model costs a full copy; it exists only when the KL term is on. With
        # LoRA the reference is the base model: the policy with its adapter disabled, no copy
        # (as TRL does with a peft_config).
        self.ref_base = cfg.beta > 0 and is_peft(model)
        # peft's context manager that runs the policy without its adapter: the reference
        self._disable_adapter: Callable[[], AbstractContextManager[object]] | None = (
            getattr(model, "disable_adapter", None) if self.ref_base else None
        )
        self.ref_model = (
            copy.deepcopy(model).eval().requires_grad_(False)
            if cfg.beta > 0 and not self.ref_base
            else None
        )
        self.generator = torch.Generator().manual_seed(seed)
        self.nonfinite_rows: list[int] = []  # rows behind the last step's skipped updates

    def step(self, batch: LearnerBatch) -> dict[str, float]:
        """Every rank calls this with the whole batch and trains on its shard of each
        mini-batch; losses are scaled so the rank-averaged gradient is the global one.

        An update whose loss or gradient is not finite on any rank is skipped on every rank:
        weights and optimizer state stay as they were. Skips are counted in the returned
        ``skipped_nonfinite``, and the batch rows behind them are left in ``nonfinite_rows``
        so the caller can trace them to their senders."""
        self.model.train()
        self.nonfinite_rows = []
        batch, extra = self.prepare(batch)
        extra[COL.entropy_est] = sampled_entropy(batch.behaviour_logprobs, batch.loss_mask)
        order = torch.randperm(batch.input_ids.shape[0], generator=self.generator)
        minibatches = order.chunk(self.cfg.updates_per_step)
        shards = [self.par.shard(mb) for mb in minibatches]
        # The first mini-batch trains on the step-start parameters: its training forward gives
        # its logp_old (detached), so only the later ones need a no-grad forward (as TRL does
        # with one update per generation batch). Not when the screen must see every row before
        # the loss of one of several micro-batches is formed: its normaliser counts the rows kept.
        reuse = not self.screen_nats or len(self.micro_batches(minibatches[0], shards[0])) == 1
        with torch.no_grad():  # logp_old: parameters at step start, before any update
            olds: list[torch.Tensor | None] = [
                None
                if k == 0 and reuse
                else self._micro_logprobs(batch, mb, i, self._policy_logprobs)
                for k, (mb, i) in enumerate(zip(minibatches, shards))
            ]
            refs = [
                self._micro_logprobs(batch, mb, i, self.ref_logprobs)
                for mb, i in zip(minibatches, shards)
            ]
        self.screened_rows = []
        batch = self._screen(batch, minibatches, shards, olds)
        applied: list[dict[str, float]] = []
        for k, (mb, idx, ref) in enumerate(zip(minibatches, shards, refs)):
            stats, batch, olds[k] = self._update(batch, mb, idx, olds[k], ref)
            if stats is None:
                self.nonfinite_rows += _blame(batch, mb)
            else:
                applied.append(stats)
        extra[COL.sampling_lag_kl] = sampling_lag(
            batch,
            [(self._trained_rows(mb, idx), old) for mb, idx, old in zip(minibatches, shards, olds)],
        )
        skipped = len(minibatches) - len(applied)
        if skipped:
            log.error(
                "skipped %d of %d updates: non-finite loss or gradient (rows %s)",
                skipped,
                len(minibatches),
                sorted(self.nonfinite_rows),
            )
        keys = (*self.TOKEN_MEANS, COL.grad_norm, COL.loss)
        out = (
            {k: sum(s[k] for s in applied) / len(applied) for k in keys}
            if applied
            else {k: math.nan for k in keys}
        )  # nothing trained: no loss to report
        return {**extra, **out, COL.skipped_nonfinite: float(skipped)}

    def _screen(
        self,
        batch: LearnerBatch,
        minibatches: Sequence[torch.Tensor],
        shards: Sequence[torch.Tensor],
        olds: Sequence[torch.Tensor | None],
    ) -> LearnerBatch:
        """The batch with the rows the screen flags left out (added to ``screened_rows``); a
        mini-batch without its ``old`` yet is screened by ``_update`` after its forward."""
        if not self.screen_nats:
            return batch
        flagged: list[int] = []
        for mb, idx, old in zip(minibatches, shards, olds):
            if old is not None:
                flagged += self._flag(batch, self._trained_rows(mb, idx), old)
        return self._leave_out(batch, flagged)

    def _flag(self, batch: LearnerBatch, rows: torch.Tensor, old: torch.Tensor) -> list[int]:
        return screen_rows(
            rows, old, batch.behaviour_logprobs[rows], batch.loss_mask[rows], self.screen_nats
        )

    def _leave_out(self, batch: LearnerBatch, rows: list[int]) -> LearnerBatch:
        """``batch`` with ``rows``' loss mask zeroed, and them counted in ``screened_rows``."""
        if not rows:
            return batch
        self.screened_rows += rows
        keep = torch.ones(batch.loss_mask.shape[0], dtype=batch.loss_mask.dtype)
        keep[rows] = 0
        return dataclasses.replace(batch, loss_mask=batch.loss_mask * keep.unsqueeze(1))

    def _trained_rows(self, mb: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """The batch rows of this rank's shard ``idx`` of mini-batch ``mb`` that train, in the
        order of their step-start log-probs."""
        return torch.cat([idx[pos] for pos, w in self.micro_batches(mb, idx) if w])

    def _update(
        self,
        batch: LearnerBatch,
        mb: torch.Tensor,
        idx: torch.Tensor,
        old: torch.Tensor | None,
        ref: torch.Tensor | None,
    ) -> tuple[dict[str, float] | None, LearnerBatch, torch.Tensor]:
        """One mini-batch update: its statistics (None, and no optimizer step, when it is not
        finite), the batch (less the rows the screen left out, when ``old`` came from this
        forward) and the shard's step-start log-probs. ``old`` None: the parameters are the
        step's start, and each micro-batch's training forward gives its own."""
        micro = self.micro_batches(mb, idx)
        self.optimizer.zero_grad(set_to_none=True)
        loss, stats, batch, old = self._accumulate(batch, mb, idx, micro, old, ref)
        stats[COL.grad_norm] = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0))
        stats[COL.loss] = loss.item()
        if not self._all_finite(stats[COL.loss], stats[COL.grad_norm]):
            self.optimizer.zero_grad(set_to_none=True)  # the NaN gradients go, unused
            return None, batch, old
        self.optimizer.step()
        return self._global(stats, float(batch.loss_mask[idx].sum())), batch, old

    def micro_batches(
        self, mb: torch.Tensor, idx: torch.Tensor
    ) -> list[tuple[torch.Tensor, float]]:
        """Positions in this rank's shard ``idx`` of mini-batch ``mb``, split into micro-batches
        of at most ``learner.micro_batch_rows`` rows, each with its weight (1, or 0 for a stand-in).
        Every rank makes as many as the largest shard needs: under FSDP2 each forward and backward
        is a collective. A rank with a row fewer than the others fills its last one with a
        stand-in row of weight 0 (computed, contributing nothing)."""
        rows, per_rank = len(idx), math.ceil(len(mb) / self.par.world)
        m = self.cfg.micro_batch_rows
        n = max(1, math.ceil(per_rank / m)) if m else 1
        out = []
        for pos in torch.tensor_split(torch.arange(rows), n):
            out.append((pos, 1.0) if len(pos) or not rows else (torch.arange(1), 0.0))
        return out

    @overload
    def _micro_logprobs(
        self,
        batch: LearnerBatch,
        mb: torch.Tensor,
        idx: torch.Tensor,
        fn: Callable[[LearnerBatch, torch.Tensor], torch.Tensor],
    ) -> torch.Tensor: ...

    @overload
    def _micro_logprobs(
        self,
        batch: LearnerBatch,
        mb: torch.Tensor,
        idx: torch.Tensor,
        fn: Callable[[LearnerBatch, torch.Tensor], torch.Tensor | None],
    ) -> torch.Tensor | None: ...

    def _micro_logprobs(
        self,
        batch: LearnerBatch,
        mb: torch.Tensor,
        idx: torch.Tensor,
        fn: Callable[[LearnerBatch, torch.Tensor], torch.Tensor | None],
    ) -> torch.Tensor | None:
        """``fn`` (``logprobs`` or ``ref_logprobs``) of the shard's rows, a micro-batch at a time."""
        parts = [(fn(batch, idx[pos]), w) for pos, w in self.micro_batches(mb, idx)]
        if parts[0][0] is None:
            return None
        return torch.cat([lp for lp, w in parts if w and lp is not None])

    def _accumulate(
        self,
        batch: LearnerBatch,
        mb: torch.Tensor,
        idx: torch.Tensor,
        micro: list[tuple[torch.Tensor, float]],
        old: torch.Tensor | None,
        ref: torch.Tensor | None,
    ) -> tuple[torch.Tensor, dict[str, float], LearnerBatch, torch.Tensor]:
        """Forward and backward of each micro-batch, gradients accumulating: the loss is a sum
        over rows divided by the mini-batch's count (1/world of it per rank), so the sum of the
        parts is the whole. Token-mean statistics are weighted by each part's trained tokens.
        Without ``old``, each part's forward gives its logp_old, and the screen sees its rows
        before its loss is formed (``step`` leaves it that way only for one micro-batch, whose
        count may then follow the screen)."""
        total = torch.zeros(())
        sums: dict[str, float] = dict.fromkeys(self.TOKEN_MEANS, 0.0)
        tokens = 0.0
        olds: list[torch.Tensor] = []
        denom = self.loss_cfg.count(batch.loss_mask[mb]) / self.par.world
        for pos, weight in micro:
            rows = idx[pos]
            logp = self.logprobs(self.model, batch, rows)
            lp_old = logp.detach() if old is None else old[pos]
            if old is None and self.screen_nats and weight:
                batch = self._leave_out(batch, self._flag(batch, rows, lp_old))
                denom = self.loss_cfg.count(batch.loss_mask[mb]) / self.par.world
            if weight:
                olds.append(lp_old)
            loss, stats = self.rows_loss(
                logp, batch, rows, lp_old, None if ref is None else ref[pos], denom
            )
            torch.autograd.backward(loss * weight)  # on every rank even when non-finite: FSDP2's
            # collectives must line up
            n = float(batch.loss_mask[rows].sum()) * weight
            for k in self.TOKEN_MEANS:
                sums[k] += stats[k] * n
            tokens += n
            total = total + loss.detach() * weight
        stats = {k: v / max(tokens, 1.0) for k, v in sums.items()}
        return total, stats, batch, torch.cat(olds) if old is None else old

    def _all_finite(self, loss: float, grad_norm: float) -> bool:
        """Finite on every rank (an all-reduced flag: each rank sees only its shard's loss,
        and all must agree to skip). A non-finite gradient anywhere makes the norm non-finite."""
        bad = float(not (math.isfinite(loss) and math.isfinite(grad_norm)))
        if self.par.world > 1:
            bad = float(self.par.all_sum(torch.tensor([bad], dtype=torch.float64))[0])
        return bad == 0

    def prepare(self, batch: LearnerBatch) -> tuple[LearnerBatch, dict[str, float]]:
        """The batch as trained on: with ``mask_truncated_completions``, completions that ended
        without end-of-sequence lose their loss mask (their advantages already counted in their
        groups). Same on every rank: each holds the whole batch."""
        if not self.cfg.mask_truncated_completions:
            return batch, {}
        assert self.eos_token_id is not None
        cut = truncated_rows(batch.input_ids, batch.loss_mask, self.eos_token_id)
        mask = batch.loss_mask * (~cut).unsqueeze(1).to(batch.loss_mask.dtype)
        return dataclasses.replace(batch, loss_mask=mask), {
            COL.truncated_frac: float(cut.float().mean())
        }

    def minibatch_loss(
        self,
        batch: LearnerBatch,
        rows: torch.Tensor,
        old: torch.Tensor,
        ref: torch.Tensor | None,
        denom: float | None = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """The GRPO loss of ``rows`` under the current parameters (``old``, ``ref``: their
        step-start and reference log-probs from ``logprobs``)."""
        return self.rows_loss(self.logprobs(self.model, batch, rows), batch, rows, old, ref, denom)

    def rows_loss(
        self,
        logp: torch.Tensor,
        batch: LearnerBatch,
        rows: torch.Tensor,
        old: torch.Tensor,
        ref: torch.Tensor | None,
        denom: float | None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """The GRPO loss of ``rows`` whose current log-probs are ``logp``."""
        return grpo_loss(
            logp,
            old,
            batch.behaviour_logprobs[rows],
            batch.advantages[rows],
            batch.loss_mask[rows],
            self.loss_cfg,
            ref,
            denom=denom,
        )

    TOKEN_MEANS = (COL.clip_frac, COL.is_weight_mean, COL.is_zeroed_frac, COL.kl_mean)

    def _global(self, stats: dict[str, float], tokens: float) -> dict[str, float]:
        """This rank's shard statistics made the mini-batch's: token means weighted by each
        rank's trained tokens; the loss averaged (each rank divides by 1/world of the global
        count, ``denom``, so their mean is the global loss, as their averaged gradients are
        the global gradient); the clipped grad norm is already global."""
        if self.par.world == 1:
            return stats
        local = [stats[k] * tokens for k in self.TOKEN_MEANS] + [tokens, stats[COL.loss]]
        total = self.par.all_sum(torch.tensor(local, dtype=torch.float64)).tolist()
        out = dict(stats)
        for i, k in enumerate(self.TOKEN_MEANS):
            out[k] = total[i] / max(total[-2], 1.0)
        out[COL.loss] = total[-1] / self.par.world
        return out

    def ref_logprobs(self, batch: LearnerBatch, rows: torch.Tensor) -> torch.Tensor | None:
        """Reference log-probs of ``rows`` (None when the KL term is off)."""
        if self._disable_adapter is not None:  # ref_base
            with self._disable_adapter():
                return self.logprobs(self.model, batch, rows)
        return None if self.ref_model is None else self.logprobs(self.ref_model, batch, rows)

    def _policy_logprobs(self, batch: LearnerBatch, rows: torch.Tensor) -> torch.Tensor:
        return self.logprobs(self.model, batch, rows)

    def logprobs(
        self, model: torch.nn.Module, batch: LearnerBatch, rows: torch.Tensor
    ) -> torch.Tensor:
        return token_logprobs(
            model,
            batch.input_ids[rows],
            batch.attention_mask[rows],
            batch.loss_mask[rows],
            self.temperature,
            self.answer_tokens,
            fused=self.cfg.fused_head,
        )


def sampling_lag(
    batch: LearnerBatch, parts: Sequence[tuple[torch.Tensor, torch.Tensor | None]]
) -> float:
    """nats/token: KL from the policy the workers sampled with to the learner's at the step's
    start (the k3 estimate on the sampled tokens), over every trained token: what the versions
    between (staleness) and the snapshot's rounding put between the two (docs/does-it-learn.md,
    "Snapshot precision"). ``parts``: batch rows and their step-start log-probs."""
    num = den = 0.0
    for rows, old in parts:
        if old is None:
            continue
        m = batch.loss_mask[rows].to(old.dtype)
        gap = torch.where(m > 0, old - batch.behaviour_logprobs[rows].to(old.dtype), 0.0)
        num += float(((torch.expm1(gap) - gap) * m).sum())
        den += float(m.sum())
    return num / den if den else math.nan


def sampled_entropy(behaviour_logp: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean negative log-prob of the sampled tokens under the policy that sampled them: an
    unbiased estimate of the sampling distribution's per-token entropy (nats), free since the
    workers send the log-probs. A collapse toward 0 means the policy stopped exploring."""
    m = mask.to(behaviour_logp.dtype)
    return float(-(behaviour_logp * m).sum() / m.sum().clamp(min=1))


def fusable(params: list[torch.nn.Parameter], par: Parallel) -> bool | None:
    """Adam's fused kernels (one pass over every tensor of an update) where they apply: one
    process (FSDP2's sharded tensors are left to the default), float parameters on the CPU or
    a GPU. None: PyTorch's default. On one CPU thread an update of 128M float32 parameters
    took 0.069 s fused against 0.357 s; a whole SmolLM2 step 14.93 against 15.31 s
    (benchmarks/bench_adam.py, benchmarks/results/adam.json)."""
    ok = par.world == 1 and all(
        p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params
    )
    return True if ok and params else None


def loss_config(cfg: LearnerConfig, max_new_tokens: int = 0) -> LossConfig:
    """The loss options of the learner's config (``max_new_tokens``: dr_grpo's constant)."""
    return LossConfig(
        epsilon=cfg.epsilon,
        epsilon_high=cfg.epsilon_high or None,
        is_cap=cfg.is_cap,
        is_mode=cfg.is_mode,
        level=cfg.importance_sampling_level,
        beta=cfg.beta,
        kl_bias_correction=cfg.use_bias_correction_kl,
        agg=cfg.loss_agg,
        max_len=max_new_tokens,
    )
