"""Math with verifiable answers: questions from a local JSONL, reward 1 for a correct final answer.

Options (``[adapter] options = {...}``):
  path            JSONL file, one object per line with the question and the answer (required on
                  the learner; workers never read it). Relative paths are taken from the
                  current directory.
  question_key    field holding the question (default "question")
  answer_key      field holding the reference answer (default "answer"; a string or a number)
  system          optional system message put before the question
  chat_template   true: the question goes through the tokenizer's chat template
                  (``apply_chat_template(..., add_generation_prompt=True)``; an error if the
                  tokenizer has none); false: raw text; unset (default): the template when
                  the tokenizer has one (tiny-qwen3's and SmolLM2's do), raw text otherwise
  format_reward   reward for an answer that was found but is wrong (default 0.0): a little
                  shaping for tiny models that have yet to learn to answer with a number
  verify_timeout_s  bound for math-verify's parse and verify (default 5; see mathcheck)
  max_prompt_tokens  drop questions longer than this many tokens (default 0: keep all)
  heldout_path    JSONL of held-out questions (same keys): ``echo-rl eval --split heldout``
                  scores each once; training never draws them. A question that is also in
                  ``path`` is refused when the data is read (examples/data/arith_heldout.jsonl
                  and arith_words_heldout.jsonl hold none of their training file's questions)

Reward (worker side): extract the final answer of the completion (last ``\\boxed{}``, else the
last number); 1.0 if ``math-verify`` judges it equal to the reference answer, else
``format_reward`` if an answer was found, else 0.0. Plain numbers are compared exactly
without the child process (see ``echo_rl/adapters/mathcheck.py`` for the time bound).

The data set must be encodable by the model's tokenizer. The built-in ``tiny-qwen3`` tokenizer
knows only digits, ``+-*=`` and ``a-f``: use ``examples/data/arith.jsonl`` (``12+7=`` style
questions) with it; word problems (``examples/data/arith_words.jsonl``, or any GSM8K-style
file) are for real models. Prompts that the tokenizer maps to unknown tokens are refused at
start-up, naming the row.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

from echo_rl.adapters.mathcheck import MathChecker, extract_answer
from echo_rl.core.jsontypes import JsonObject
from echo_rl.data.adapter import Adapter, AdapterError, Prompt
from echo_rl.data.multiturn import render_ids

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_OPTIONS = {
    "path",
    "question_key",
    "answer_key",
    "system",
    "chat_template",
    "format_reward",
    "verify_timeout_s",
    "max_prompt_tokens",
    "heldout_path",
}


def encode_chat(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, str]],
    add_generation_prompt: bool = True,
) -> list[int]:
    """Token ids of ``messages`` through the tokenizer's chat template, as a plain list."""
    return render_ids(tokenizer, messages, add_generation_prompt=add_generation_prompt)


class MathRow(TypedDict):
    """One question of a JSONL file, with its line (for messages that name it)."""

    question: str
    answer: str
    line: int


def read_jsonl(
    path: str | Path, question_key: str = "question", answer_key: str = "answer"
) -> list[MathRow]:
    p = Path(path).expanduser()
    if not p.is_file():
        raise AdapterError(
            f"math: options.path = {str(path)!r}: no such file (relative paths are "
            f"taken from the current directory {Path.cwd()})"
        )
    rows: list[MathRow] = []
    with p.open() as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise AdapterError(f"math: {p}:{n}: not JSON ({exc})") from None
            if not isinstance(obj, dict) or question_key not in obj or answer_key not in obj:
                raise AdapterError(
                    f"math: {p}:{n}: expected an object with {question_key!r} and "
                    f"{answer_key!r} (set options.question_key / answer_key)"
                )
            rows.append(
                MathRow(question=str(obj[question_key]), answer=str(obj[answer_key]), line=n)
            )
    if not rows:
        raise AdapterError(f"math: {p} holds no rows")
    return rows


class MathAdapter(Adapter):
    name = "math"

    def __init__(self, options: dict[str, Any], tokenizer: PreTrainedTokenizerBase):
        super().__init__(options, tokenizer)
        import importlib.util

        if importlib.util.find_spec("math_verify") is None:
            raise AdapterError("math: the math-verify package is missing: pip install math-verify")
        unknown = set(self.options) - _OPTIONS
        if unknown:
            raise AdapterError(
                f"math: unknown option(s) {sorted(unknown)}; it takes {sorted(_OPTIONS)}"
            )
        self.path = self.options.get("path")
        self.question_key = str(self.options.get("question_key", "question"))
        self.answer_key = str(self.options.get("answer_key", "answer"))
        self.system = self.options.get("system")
        has_template = bool(getattr(tokenizer, "chat_template", None))
        self.chat = bool(self.options.get("chat_template", has_template))
        self.format_reward = float(self.options.get("format_reward", 0.0))
        self.max_prompt_tokens = int(self.options.get("max_prompt_tokens", 0))
        if not 0.0 <= self.format_reward < 1.0:
            raise AdapterError(f"math: format_reward={self.format_reward} must be in [0, 1)")
        if self.chat and not has_template:
            raise AdapterError(
                "math: the tokenizer has no chat template; set options.chat_template"
                " = false to feed the raw question text"
            )
        self.checker = MathChecker(float(self.options.get("verify_timeout_s", 5.0)))
        self._items: list[tuple[list[int], JsonObject]] | None = None

    # ----------------------------------------------------------------- learner side

    def encode(self, question: str) -> list[int]:
        if not self.chat:
            return list(self.tokenizer.encode(question, add_special_tokens=False))
        messages = [{"role": "system", "content": self.system}] if self.system else []
        messages.append({"role": "user", "content": question})
        return encode_chat(self.tokenizer, messages)

    def items(self) -> list[tuple[list[int], JsonObject]]:
        """(prompt ids, task) for every usable row; read and encoded once, on first use."""
        if self._items is None:
            if not self.path:
                raise AdapterError(
                    "math: set options.path to a JSONL file of questions and answers"
                )
            self._items = self._encode_file(self.path)
            heldout = self.options.get("heldout_path")
            if heldout:
                self._check_disjoint(str(heldout))
        return self._items

    def _encode_file(self, path: str) -> list[tuple[list[int], JsonObject]]:
        rows = read_jsonl(path, self.question_key, self.answer_key)
        unk = getattr(self.tokenizer, "unk_token_id", None)
        items: list[tuple[list[int], JsonObject]] = []
        for row in rows:
            if unk is not None and unk in self.tokenizer.encode(
                row["question"], add_special_tokens=False
            ):
                raise AdapterError(
                    f"math: {path}:{row['line']}: the tokenizer cannot encode question "
                    f"{row['question'][:60]!r} (unknown characters); the tiny-qwen3 tokenizer "
                    f"knows only digits, +-*= and a-f: use examples/data/arith.jsonl or a real model"
                )
            ids = self.encode(row["question"])
            if self.max_prompt_tokens and len(ids) > self.max_prompt_tokens:
                continue
            items.append((ids, {"answer": row["answer"]}))
        if not items:
            raise AdapterError(
                f"math: no question of {path} fits max_prompt_tokens={self.max_prompt_tokens}"
            )
        return items

    def _check_disjoint(self, heldout: str) -> None:
        """A held-out question that training also draws measures memory, not learning."""
        assert self.path is not None  # a held-out file is checked against the training one
        train = {q["question"] for q in read_jsonl(self.path, self.question_key, self.answer_key)}
        both = [
            q
            for q in read_jsonl(heldout, self.question_key, self.answer_key)
            if q["question"] in train
        ]
        if both:
            raise AdapterError(
                f"math: {len(both)} question(s) of heldout_path {heldout} are also "
                f"in path {self.path} (line {both[0]['line']}: "
                f"{both[0]['question'][:60]!r}); remove them from one of the files"
            )

    def heldout_prompts(self, rng: random.Random) -> Iterator[Prompt] | None:
        """Each question of ``heldout_path`` once, in file order (None without one)."""
        heldout = self.options.get("heldout_path")
        if not heldout:
            return None
        self.items()  # the disjointness check
        return (
            Prompt(prompt_ids=list(ids), task=dict(task))
            for ids, task in self._encode_file(str(heldout))
        )

    def prompts(self, rng: random.Random) -> Iterator[Prompt]:
        items = self.items()
        while True:  # sampling with replacement: the stream is a function of the RNG alone
            ids, task = items[rng.randrange(len(items))]
            yield Prompt(prompt_ids=list(ids), task=dict(task))

    def close(self) -> None:
        """Stop the checker's child process (an evaluation's end; workers keep theirs)."""
        self.checker.close()

    # ----------------------------------------------------------------- worker side

    def reward(
        self, task: dict[str, Any], completion_ids: list[int], completion_text: str
    ) -> float:
        pred = extract_answer(completion_text)
        if pred is None:
            return 0.0
        return 1.0 if self.checker.equal(str(task["answer"]), pred) else self.format_reward
