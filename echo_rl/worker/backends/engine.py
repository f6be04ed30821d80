"""Echo's own generation engine (``worker.backend = "engine"``, the default): the transformers
backend's model, sampled by a loop written for the card instead of Hugging Face ``generate``.

What ``generate`` costs a rollout, and what this loop does instead (docs/worker.md, "The
generation engine"; ``benchmarks/gen_speed.py`` measures both side by side):

* **One prefill per group.** A GRPO group is n samples of one prompt: the prompt is prefilled
  once and its keys and values copied into the n slots (``generate`` prefills it n times).
  Each sample's first token is drawn from that one set of logits.
* **No scores tensor.** The log-prob of each sampled token is taken in the step that samples
  it (``log_softmax`` + ``gather`` of one row per slot); nothing [rows, tokens, vocabulary]
  is kept.
* **A cache allocated once, one slot a sample** (``echo_rl/worker/backends/decoder.py``): a slot ends
  on end-of-sequence or at its own budget (``Group.max_new_tokens``), and when a request
  holds more samples than slots, a finished slot takes the next waiting one at once
  (continuous batching) instead of idling until the longest row ends.
* **A captured step on CUDA.** Every shape of a step is fixed by the slot cache, so on a GPU
  the step (forward, sampling, log-prob, end checks) is captured once as a CUDA graph and
  replayed: one launch a token instead of hundreds. The host looks at the slots every
  ``sync_every`` steps (every step on the CPU, where a look is free).

Sampling: ``softmax(logits / temperature)`` over the whole vocabulary, or renormalised over the
adapter's answer tokens (echo_rl/data/answers.py), drawn by the exponential race (argmax of
``p / E``, E ~ Exp(1), one draw per token: the same distribution as ``multinomial``, with no
host sync). Reported log-probs are of that distribution, as the learner computes them.

What the loop does not do itself falls back to the parent class's ``generate`` path: a model
the decoder does not run (``decoder.SUPPORTED``), and the multi-turn turn cache
(``generate_turn``), which keeps its own layout.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from echo_rl.core import wire
from echo_rl.core.config import LoraConfig, ModelConfig
from echo_rl.data.answers import answer_bias
from echo_rl.worker.backends.base import Row, Sample, sample_groups
from echo_rl.worker.backends.decoder import Decoder, KVCache, UnsupportedModel
from echo_rl.worker.backends.transformers import TransformersBackend

log = logging.getLogger("echo.worker")

# Rows of one prefill call at most: bounds its activations (rows x prompt width) on the CPU.
PREFILL_ROWS = 64


@dataclass
class Slots:
    """The device state of every slot, written in place by each step (so a captured step
    replays on the same tensors): the token each slot reads next and its position, the
    tokens it has produced (``n``) and may produce (``budget``), whether it still runs, and
    what it produced, ``out_tok``/``out_lp`` [slots, width + 1] (column ``n`` of an ended
    slot takes the writes of the steps it sits out)."""

    cache: KVCache
    rope: tuple[torch.Tensor, torch.Tensor]
    tok: torch.Tensor
    pos: torch.Tensor
    n: torch.Tensor
    budget: torch.Tensor
    active: torch.Tensor
    out_tok: torch.Tensor
    out_lp: torch.Tensor
    temperature: torch.Tensor  # [1] float32
    bias: torch.Tensor  # [vocab] float32: 0, or -inf outside the answer set
    eos: int

    @classmethod
    def allocate(
        cls, decoder: Decoder, slots: int, columns: int, width: int, vocab: int, eos: int
    ) -> Slots:
        dev = decoder.device

        def longs() -> torch.Tensor:
            return torch.zeros(slots, dtype=torch.long, device=dev)

        return cls(
            cache=decoder.cache(slots, columns),
            rope=decoder.rope(columns),
            tok=longs(),
            pos=longs(),
            n=longs(),
            budget=longs(),
            active=torch.zeros(slots, dtype=torch.bool, device=dev),
            out_tok=torch.zeros(slots, width + 1, dtype=torch.long, device=dev),
            out_lp=torch.zeros(slots, width + 1, dtype=torch.float32, device=dev),
            temperature=torch.ones(1, dtype=torch.float32, device=dev),
            bias=torch.zeros(vocab, dtype=torch.float32, device=dev),
            eos=eos,
        )

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.cache.slots, self.cache.columns, int(self.out_tok.shape[1]) - 1


def sample(
    logits: torch.Tensor, temperature: torch.Tensor, bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of ``logits`` [rows, vocab] and its log-prob, from
    ``softmax(logits / temperature + bias)``: argmax of p / E with E ~ Exp(1)."""
    logp = torch.log_softmax(logits / temperature + bias, dim=-1)
    race = torch.empty_like(logp).exponential_().clamp_min_(1e-30).log_()
    tok = (logp - race).argmax(dim=-1)
    return tok, logp.gather(-1, tok[:, None])[:, 0]


def _bucket(x: int, step: int) -> int:
    return -(-x // step) * step


def _fits(have: tuple[int, int, int], need: tuple[int, int, int]) -> bool:
    """A kept (slots, columns, width) serves a request needing ``need``: large enough, and
    no more than twice the slots or columns it needs."""
    return all(h >= n for h, n in zip(have, need)) and all(
        h <= 2 * n for h, n in zip(have[:2], need[:2])
    )


# One decode step over the slots (``EngineBackend._step``, compiled or not): ``columns``, the
# cache columns it reads (None: all of them, a fixed shape; ``Decoder.step``).
Step = Callable[["Slots", int | None], None]


@dataclass(frozen=True)
class EngineTuning:
    """How the engine's loop runs. ``slots``: samples decoded at once (0: 256 on a GPU, 64 on
    the CPU); more wait and take the slots that free up. ``cuda_graph``: capture the step on
    CUDA (False: run it eagerly, for comparison). ``compile``: ``torch.compile`` the step
    before capturing it (fuses its small kernels; costs a compile per slot shape, so off
    unless asked). ``sync_every``: steps between two looks at the slots on CUDA."""

    slots: int = 0
    cuda_graph: bool = True
    compile: bool = False
    sync_every: int = 8


class EngineBackend(TransformersBackend):
    """The transformers backend's model, sampled by this module's loop (``tuning``:
    ``EngineTuning``)."""

    def __init__(
        self,
        model_cfg: ModelConfig,
        threads: int = 1,
        device: str = "cpu",
        lora: LoraConfig | None = None,
        dtype: str = "auto",
        tuning: EngineTuning = EngineTuning(),
    ):
        super().__init__(model_cfg, threads=threads, device=device, lora=lora, dtype=dtype)
        self.decoder: Decoder | None
        try:
            self.decoder = Decoder(self.model)
        except UnsupportedModel as why:
            log.info("generation engine: %s; sampling with transformers' generate", why)
            self.decoder = None
        self.own_loop = self.decoder is not None  # else every request goes to generate
        cuda = self.device.type == "cuda"
        self.slots = tuning.slots or (256 if cuda else 64)
        self.graphs = cuda and tuning.cuda_graph
        self.compile = self.graphs and tuning.compile
        self.sync_every = max(1, tuning.sync_every) if cuda else 1
        self._ws: Slots | None = None  # reused while requests fit its shape (CUDA)
        self._graph: torch.cuda.CUDAGraph | None = None  # the captured step of ``_ws``
        self._warned = False  # past the model's positions: said once

    # -- what moves the weights drops the captured step (it holds their addresses) ----------

    def park(self) -> None:
        """Off the device: the captured step and the decoder (its fused weights would keep
        the device copies alive) go first; ``unpark`` builds them again."""
        if self.device.type == "cpu":
            return
        self._ws, self._graph = None, None
        self.decoder = None
        super().park()

    def unpark(self) -> None:
        if self.device.type == "cpu":
            return
        super().unpark()
        if self.own_loop:
            self.decoder = Decoder(self.model)

    # -- generation --------------------------------------------------------------------------

    @torch.no_grad()
    def generate(
        self,
        groups: list[wire.Group],
        max_new_tokens: int,
        temperature: float,
        stop: threading.Event | None = None,
        tail: float = 0.0,
    ) -> list[list[Sample]]:
        if self.decoder is None:
            return super().generate(groups, max_new_tokens, temperature, stop, tail)

        def sample(
            todo: list[Row], fresh: list[bool]
        ) -> tuple[dict[int, tuple[list[int], list[float]]], bool]:
            torch.manual_seed(groups[0].seed)
            run = _Run(self, self._slots_for(todo, temperature), todo, fresh, stop, tail)
            got, stopped = run.go()
            return {id(r): got[k] for k, r in enumerate(todo) if k in got}, stopped

        return sample_groups(groups, max_new_tokens, self.tokenizer.eos_token_id, sample)

    def _slots_for(self, todo: list[Row], temperature: float) -> Slots:
        """The slot state for a request: on CUDA the kept one when its shape holds the request
        and is at most twice as large in slots and columns (its captured step replays; a step
        computes every slot and column, so a much larger one would cost a small request more
        than a capture), else a new one in shapes rounded up so the next requests fit it
        too; on the CPU one of the request's exact shape."""
        assert self.decoder is not None
        slots = min(len(todo), self.slots)
        columns = max(len(r.prompt) + r.budget for r in todo)
        width = max(r.budget for r in todo)
        if self.decoder.max_positions and columns > self.decoder.max_positions and not self._warned:
            self._warned = True
            log.warning(
                "a prompt plus its budget runs to %d positions, past the model's %d",
                columns,
                self.decoder.max_positions,
            )
        eos = self.tokenizer.eos_token_id
        eos = -1 if eos is None else int(eos)
        if self.graphs:
            slots, columns, width = _bucket(slots, 16), _bucket(columns, 64), _bucket(width, 64)
            kept = self._ws
            need = (slots, columns, width)
            if kept is None or not _fits(kept.shape, need):
                self._ws, self._graph = None, None  # free the old cache before the new one
                torch.cuda.empty_cache()
                kept = Slots.allocate(self.decoder, slots, columns, width, self.vocab_size, eos)
                self._ws = kept
            ws = kept
            ws.active.zero_()
        else:
            ws = Slots.allocate(self.decoder, slots, columns, width, self.vocab_size, eos)
        ws.temperature.fill_(temperature)
        if self.answer_tokens is None:
            ws.bias.zero_()
        else:
            ws.bias.copy_(answer_bias(self.answer_tokens, self.vocab_size, self.device))
        return ws

    def advance(self, ws: Slots, columns: int | None = None) -> None:
        """One decode step of every slot, in place: the captured graph when there is one."""
        if self.graphs and ws is self._ws:
            if self._graph is None:
                self._graph = self._capture(ws)
            if self._graph is not None:
                self._graph.replay()
                return
        self._step(ws, columns)

    def _step(self, ws: Slots, columns: int | None) -> None:
        assert self.decoder is not None
        logits = self.decoder.step(ws.tok, ws.pos, ws.cache, ws.rope, columns)
        tok, lp = sample(logits, ws.temperature, ws.bias)
        at = torch.arange(tok.shape[0], device=tok.device)
        ws.out_tok[at, ws.n] = tok
        ws.out_lp[at, ws.n] = lp
        running = ws.active.long()
        ws.n.add_(running)
        ws.pos.add_(running)
        ws.active.logical_and_((tok != ws.eos) & (ws.n < ws.budget))
        ws.tok.copy_(tok)

    def _capture(self, ws: Slots) -> torch.cuda.CUDAGraph | None:
        """The step as a CUDA graph over ``ws`` (None, and eager steps from then on, if
        capture fails on this model or driver: said once in the log). The warm-up steps run
        on idle slots (``active`` all false), so they change nothing a request reads."""
        step: Step = self._step
        if self.compile:
            try:
                compiled = torch.compile(self._step, dynamic=False)
                _warm(compiled, ws)
                step = compiled
            except Exception as exc:  # noqa: BLE001 - the eager step computes the same thing
                log.warning("generation engine: torch.compile failed (%s); capturing eagerly", exc)
                self.compile = False
        try:
            _warm(step, ws)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step(ws, None)
            return graph
        except Exception as exc:  # noqa: BLE001 - eager steps compute the same thing
            log.warning("generation engine: no CUDA graph (%s); stepping eagerly", exc)
            self.graphs = False
            return None


def _warm(step: Step, ws: Slots) -> None:
    """Two steps on a side stream before a capture, as CUDA graphs ask (lazy initialisation,
    autotuning, a compile), on idle slots."""
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step(ws, None)
    torch.cuda.current_stream().wait_stream(side)


class _Run:
    """One request's samples through the slots: rows wait in order, each group's prompt is
    prefilled when its first sample takes a slot and kept until its last one has."""

    def __init__(
        self,
        engine: EngineBackend,
        ws: Slots,
        rows: list[Row],
        fresh: list[bool],
        stop: threading.Event | None,
        tail: float,
    ):
        assert engine.decoder is not None
        self.engine, self.decoder, self.ws = engine, engine.decoder, ws
        self.rows, self.fresh, self.stop, self.tail = rows, fresh, stop, tail
        self.waiting = deque(range(len(rows)))
        # a row's prompt key: the group's for a fresh sample (shared), its own for a prefix
        self.key = [(r.group, -1) if r.prefix is None else (r.group, k) for k, r in enumerate(rows)]
        self.left = Counter(self.key)  # rows of each prompt yet to start
        self.prefilled: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.slot_row: list[int | None] = [None] * ws.cache.slots
        self.start: list[int] = [0] * ws.cache.slots  # the slot's prompt length
        self.done: dict[int, tuple[list[int], list[float]]] = {}
        self.counted = [0] * ws.cache.slots  # tokens of the slot already in tokens_sampled
        self._furthest = 0  # the furthest column a running slot has reached (eager reads)

    def go(self) -> tuple[dict[int, tuple[list[int], list[float]]], bool]:
        """(new tokens and log-probs by row index, whether a stop or the tail cut ended it)."""
        step = self.engine.sync_every
        while True:
            self._fill()
            running = self._look()
            if not running:
                if self.waiting:
                    continue
                return self.done, False
            if self._cut():
                self._harvest(running)
                return self.done, True
            columns = None
            if not self.engine.graphs:  # eager: read no column past the furthest slot's end
                columns = min(self.ws.cache.columns, self._furthest + step + 1)
            for _ in range(step):
                self.engine.advance(self.ws, columns)

    def _fill(self) -> None:
        """Give every free slot the next waiting row: prefill what is new, copy the prompt's
        keys and values into the slot, draw the slot's first token."""
        free = [s for s, r in enumerate(self.slot_row) if r is None]
        take = [self.waiting.popleft() for _ in range(min(len(free), len(self.waiting)))]
        if not take:
            return
        self._prefill([k for k in take if self.key[k] not in self.prefilled])
        ws, dev = self.ws, self.ws.tok.device
        logits, plen, budget = [], [], []
        for s, k in zip(free, take):
            kv, last = self.prefilled[self.key[k]]
            p = kv.shape[-2]
            ws.cache.kv[:, :, s, :, :p].copy_(kv)
            logits.append(last)
            plen.append(p)
            budget.append(self.rows[k].budget)
            self.slot_row[s], self.start[s], self.counted[s] = k, p, 0
            self.left[self.key[k]] -= 1
            if not self.left[self.key[k]]:
                del self.prefilled[self.key[k]]
        idx = torch.tensor(free[: len(take)], device=dev)
        tok, lp = sample(torch.stack(logits), ws.temperature, ws.bias)
        budgets = torch.tensor(budget, device=dev)
        ws.tok[idx], ws.pos[idx], ws.budget[idx] = tok, torch.tensor(plen, device=dev), budgets
        ws.n[idx] = 1
        ws.out_tok[idx, 0], ws.out_lp[idx, 0] = tok, lp
        ws.active[idx] = (tok != ws.eos) & (budgets > 1)

    def _prefill(self, rows: list[int]) -> None:
        """Each distinct prompt of ``rows`` once, in calls of at most PREFILL_ROWS prompts."""
        keys = list(dict.fromkeys(self.key[k] for k in rows))
        prompts = {self.key[k]: self.rows[k].prompt for k in rows}
        dev = self.ws.tok.device
        for i in range(0, len(keys), PREFILL_ROWS):
            chunk = keys[i : i + PREFILL_ROWS]
            lens = [len(prompts[key]) for key in chunk]
            width = max(lens)
            ids = torch.tensor(
                [prompts[key] + [0] * (width - len(prompts[key])) for key in chunk], device=dev
            )
            kv, last = self.decoder.prefill(ids, torch.tensor(lens, device=dev), self.ws.rope)
            for j, key in enumerate(chunk):
                self.prefilled[key] = (kv[:, :, j, :, : lens[j]], last[j])

    def _look(self) -> list[int]:
        """Slots still running after harvesting the ended ones (one host sync)."""
        ws = self.ws
        active, n = ws.active.tolist(), ws.n.tolist()
        running: list[int] = []
        ended: list[int] = []
        for s, k in enumerate(self.slot_row):
            if k is None:
                continue
            self.engine.tokens_sampled += n[s] - self.counted[s]
            self.counted[s] = n[s]
            (running if active[s] else ended).append(s)
        self._furthest = max((self.start[s] + n[s] for s in running), default=0)
        self._harvest(ended, n)
        return running

    def _harvest(self, slots: list[int], n: list[int] | None = None) -> None:
        """The tokens and log-probs of ``slots`` become their rows' results; the slots free."""
        if not slots:
            return
        if n is None:
            n = self.ws.n.tolist()
        idx = torch.tensor(slots, device=self.ws.tok.device)
        most = max(n[s] for s in slots)
        toks = self.ws.out_tok[idx, :most].tolist()
        lps = self.ws.out_lp[idx, :most].tolist()
        for j, s in enumerate(slots):
            k = self.slot_row[s]
            assert k is not None
            self.done[k] = (toks[j][: n[s]], lps[j][: n[s]])
            self.slot_row[s] = None

    def _cut(self) -> bool:
        """``stop`` is set, or ``tail`` of the fresh rows have ended with no continued row
        left to run (docs/scheduling.md, "Long-tail cut")."""
        if self.stop is not None and self.stop.is_set():
            return True
        if not self.tail:
            return False
        live = [k for k in self.slot_row if k is not None] + list(self.waiting)
        if not live or any(not self.fresh[k] for k in live):
            return False
        ended = sum(1 for k in self.done if self.fresh[k])
        return ended >= self.tail * sum(self.fresh)
