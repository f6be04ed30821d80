"""A multi-turn rollout's context cache, kept from one decision to the next
(``worker.turn_cache``; docs/scheduling.md, "Cache-affine turns").

An episode adapter asks for one generation per decision, each with the whole transcript so
far (echo_rl/data/episodes.py). Without a cache every decision prefills that whole transcript
again: an episode of k decisions prefills its opening k times. ROSE sends a multi-turn
episode's next turn to the worker that holds its context cache; in Echo every turn of an
episode already runs on the worker that started it (episodes are played in lockstep on one
worker), so what is left to do is to keep the cache there. Here the transformers backend
keeps, per rollout, the key/value cache of every episode's transcript and, for the next
decision, feeds only what is new: the decision's last token and the environment's reply.

Layout: one row per episode, the positions of the previous call kept as they were (the
generated tokens after a row's end, and the left padding of each new segment, are holes
with attention mask 0); the model's positions come from the mask's running count, so a row
computes what the same transcript prefilled from scratch computes
(``tests/test_turn_cache.py`` checks samples and log-probs against it). Episodes that ended
leave the batch (their rows are dropped from the cache). A prompt that does not continue its
row (a replayed continuation, another rollout) starts the cache afresh.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Plan:
    """One call's inputs: the whole layout (kept positions, then the new segments), its mask,
    the cache of the kept positions (None: a fresh start) and the prefill it costs."""

    ids: Any  # LongTensor [rows, width]
    mask: Any  # LongTensor [rows, width]
    cache: Any  # a transformers Cache, or None
    new_tokens: int  # real tokens the model must read before sampling (the prefill)
    positions: int  # positions it computes for them (rows x new width)


class TurnCache:
    def __init__(self, pad: int):
        self.pad = pad
        self.seqs: list[list[int]] = []  # per row: the real tokens it holds (prompt + kept)
        self.ids: Any = None
        self.mask: Any = None
        self.cache: Any = None
        self.prefill_tokens = 0  # real tokens prefilled, over the rollout
        self.prefill_positions = 0  # positions computed for them (padding included)
        self.fresh_tokens = 0  # what prefilling every prompt whole would have read

    def plan(self, prompts: list[list[int]], device: torch.device) -> Plan:
        self.fresh_tokens += sum(len(p) for p in prompts)
        rows = self._match(prompts)
        if rows is None:
            plan = self._fresh(prompts, device)
        else:
            plan = self._continue(prompts, rows, device)
        self.prefill_tokens += plan.new_tokens
        self.prefill_positions += plan.positions
        return plan

    def _match(self, prompts: list[list[int]]) -> list[int] | None:
        """The cached row each prompt continues, in order; None when one does not."""
        if self.cache is None or not prompts:
            return None
        out, r = [], 0
        for p in prompts:
            while r < len(self.seqs) and not _continues(p, self.seqs[r]):
                r += 1
            if r == len(self.seqs):
                return None
            out.append(r)
            r += 1
        return out

    def _fresh(self, prompts: list[list[int]], device: torch.device) -> Plan:
        width = max(len(p) for p in prompts)
        ids = [[self.pad] * (width - len(p)) + p for p in prompts]
        mask = [[0] * (width - len(p)) + [1] * len(p) for p in prompts]
        return Plan(
            torch.tensor(ids, device=device),
            torch.tensor(mask, device=device),
            None,
            sum(len(p) for p in prompts),
            len(prompts) * width,
        )

    def _continue(self, prompts: list[list[int]], rows: list[int], device: torch.device) -> Plan:
        pick = torch.tensor(rows, device=self.ids.device)
        if len(rows) < len(self.seqs):
            self.cache.batch_select_indices(pick)
        segs = [p[len(self.seqs[r]) :] for p, r in zip(prompts, rows, strict=True)]
        width = max(1, max(len(s) for s in segs))
        seg = torch.tensor([[self.pad] * (width - len(s)) + s for s in segs], device=device)
        seg_mask = torch.tensor(
            [[0] * (width - len(s)) + [1] * len(s) for s in segs], device=device
        )
        ids = torch.cat([self.ids.index_select(0, pick).to(device), seg], 1)
        mask = torch.cat([self.mask.index_select(0, pick).to(device), seg_mask], 1)
        # the previous call's last sampled token was never fed through the model: it is read
        # now with the new segment
        read = ids.shape[1] - self.cache.get_seq_length()
        return Plan(ids, mask, self.cache, sum(len(s) for s in segs) + len(rows), len(rows) * read)

    def keep(
        self, prompts: list[list[int]], plan: Plan, sequences: Any, kept: list[int], cache: Any
    ) -> None:
        """After the call: ``sequences`` = the layout and what was generated, ``kept[j]`` the
        generated tokens row j keeps (up to its end), ``cache`` what the model computed."""
        width = plan.ids.shape[1]
        n = sequences.shape[1] - width
        gen_mask = torch.tensor(
            [[1] * k + [0] * (n - k) for k in kept], device=plan.mask.device, dtype=plan.mask.dtype
        )
        self.ids, self.mask, self.cache = sequences, torch.cat([plan.mask, gen_mask], 1), cache
        self.seqs = [
            p + sequences[j, width : width + kept[j]].tolist() for j, p in enumerate(prompts)
        ]


def _continues(prompt: list[int], held: list[int]) -> bool:
    return len(held) <= len(prompt) and prompt[: len(held)] == held
