"""Code: the policy completes a Python function; its reward runs hidden tests in a sandbox.

A prompt is a function's header and docstring (``def f(x):`` and what it must return), drawn
from small task families with random constants (``TASKS``). The worker runs the header plus the
completion in ``echo_rl.data.sandbox`` (no network, capped CPU, memory, files and processes) and
calls ``f`` on ``calls`` hidden inputs; the reward is the fraction whose result equals the
reference's (compared as JSON values). The program never sees the expected values, so printing
a claim earns nothing.

It is the expensive reward of docs/scheduling.md: each sample costs a sandboxed process (about
40 ms on this repository's CPU), so ``expensive_reward`` tells the learner to recompute a
sample of delivered rewards off its step (``security.reward_audit_rate``) rather than every
one inline.

Options: ``tasks`` (names from ``TASKS``; default all), ``calls`` (hidden inputs per prompt,
default 5), ``prompt`` (``"header"``, the default: the header as plain text, the completion is
the body, for a base model; ``"chat"``: the task as a user message through the tokenizer's chat
template, for an instruction-tuned model, whose reply is run: its first fenced code block, or
all of it, must define ``f``), ``cpu_s``, ``wall_s``, ``memory_mib`` (the sandbox's limits),
``sandbox_network`` (``"required"``, the default: the adapter refuses to start where no network
namespace can be had; ``"optional"``: run without one, at the operator's risk).
"""

from __future__ import annotations

import json
import random
import re
import string
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from echo_rl.core.jsontypes import JsonObject
from echo_rl.data.adapter import Adapter, AdapterError, Prompt
from echo_rl.data.multiturn import render_ids
from echo_rl.data.sandbox import Limits, SandboxError, call_entry

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class Task:
    """A family of functions: its docstring and reference from constants drawn per prompt,
    and how to draw an input."""

    doc: Callable[[dict[str, Any]], str]
    ref: Callable[[dict[str, Any], Any], Any]
    consts: Callable[[random.Random], dict[str, Any]]
    arg: Callable[[random.Random], Any]


def _word(rng: random.Random) -> str:
    return "".join(rng.choice("abcde") for _ in range(rng.randint(0, 12)))


def _ints(rng: random.Random) -> list[int]:
    return [rng.randint(-20, 20) for _ in range(rng.randint(1, 8))]


TASKS: dict[str, Task] = {
    "linear": Task(
        lambda c: f"Return x times {c['a']}, plus {c['b']}.",
        lambda c, x: x * c["a"] + c["b"],
        lambda r: {"a": r.randint(2, 9), "b": r.randint(-9, 9)},
        lambda r: r.randint(-50, 50),
    ),
    "digit_sum": Task(
        lambda c: "Return the sum of the decimal digits of the non-negative integer x.",
        lambda c, x: sum(int(d) for d in str(x)),
        lambda r: {},
        lambda r: r.randint(0, 10**6),
    ),
    "count_char": Task(
        lambda c: f"Return how many times the letter '{c['ch']}' occurs in the string x.",
        lambda c, x: x.count(c["ch"]),
        lambda r: {"ch": r.choice("abcde")},
        _word,
    ),
    "reverse": Task(
        lambda c: "Return the list x in reverse order.",
        lambda c, x: x[::-1],
        lambda r: {},
        _ints,
    ),
    "spread": Task(
        lambda c: "Return the largest element of the non-empty list x minus the smallest.",
        lambda c, x: max(x) - min(x),
        lambda r: {},
        _ints,
    ),
    "divisible": Task(
        lambda c: f"Return True if x is divisible by {c['k']}, else False.",
        lambda c, x: x % c["k"] == 0,
        lambda r: {"k": r.randint(2, 7)},
        lambda r: r.randint(-100, 100),
    ),
    "clamp": Task(
        lambda c: f"Return x limited to the range {c['lo']} to {c['hi']}, both included.",
        lambda c, x: min(max(x, c["lo"]), c["hi"]),
        lambda r: {"lo": r.randint(-10, 0), "hi": r.randint(1, 10)},
        lambda r: r.randint(-30, 30),
    ),
    "squares": Task(
        lambda c: "Return the sum of i * i for every integer i from 1 to x (0 if x < 1).",
        lambda c, x: sum(i * i for i in range(1, x + 1)),
        lambda r: {},
        lambda r: r.randint(-3, 40),
    ),
    "vowels": Task(
        lambda c: "Return the number of vowels (a, e, i, o, u) in the lower-case string x.",
        lambda c, x: sum(ch in "aeiou" for ch in x),
        lambda r: {},
        lambda r: "".join(r.choice(string.ascii_lowercase) for _ in range(r.randint(0, 15))),
    ),
}
OPTIONS = {"tasks", "calls", "prompt", "cpu_s", "wall_s", "memory_mib", "sandbox_network"}
FENCED = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)(?:```|$)", re.S)


def header(doc: str) -> str:
    """The prompt's text: the function the policy completes."""
    return f'def f(x):\n    """{doc}"""\n'


def ask(doc: str) -> str:
    """The user message of ``prompt = "chat"``."""
    return f"Write a Python function f(x). {doc} Reply with the code only."


def program(task: JsonObject, completion_text: str) -> str:
    """What runs: the header and the body the policy wrote, or (chat) the code of its reply."""
    if not task.get("chat"):
        return str(task["header"]) + completion_text
    block = FENCED.search(completion_text)
    return block.group(1) if block else completion_text


class CodeAdapter(Adapter):
    name = "code"
    expensive_reward = True  # the learner audits a sample of rewards, off its step

    def __init__(self, options: dict[str, Any], tokenizer: PreTrainedTokenizerBase):
        super().__init__(options, tokenizer)
        unknown = set(self.options) - OPTIONS
        if unknown:
            raise AdapterError(
                f"code: unknown option(s) {sorted(unknown)}; it takes {sorted(OPTIONS)}"
            )
        names = list(self.options.get("tasks", list(TASKS)))
        bad = [n for n in names if n not in TASKS]
        if bad or not names:
            raise AdapterError(f"code: tasks {bad or names} unknown; choose from {list(TASKS)}")
        self.tasks = names
        self.chat = self.options.get("prompt", "header") == "chat"
        if self.options.get("prompt", "header") not in ("header", "chat"):
            raise AdapterError(
                f'code: prompt={self.options["prompt"]!r} must be "header" (a base model '
                f'continues the function) or "chat" (an instruction-tuned model answers)'
            )
        self.calls = int(self.options.get("calls", 5))
        if not 1 <= self.calls <= 50:
            raise AdapterError(f"code: calls={self.calls} must be 1..50 (hidden inputs a prompt)")
        network = self.options.get("sandbox_network", "required")
        if network not in ("required", "optional"):
            raise AdapterError(
                f'code: sandbox_network={network!r} must be "required" or "optional"'
            )
        self.limits = Limits(
            cpu_s=int(self.options.get("cpu_s", 1)),
            wall_s=float(self.options.get("wall_s", 2.0)),
            memory_mib=int(self.options.get("memory_mib", 512)),
            network_optional=network == "optional",
        )
        self._probe()

    def _probe(self) -> None:
        """The sandbox works here, or the adapter refuses to start, naming the fix."""
        try:
            out = call_entry("def f(x):\n    return x\n", "f", [[1]], self.limits)
        except SandboxError as err:
            raise AdapterError(f"code: {err}") from None
        if out.results != [1]:
            raise AdapterError(
                f"code: the sandbox could not run a trivial program ({out.status}: "
                f"{out.detail}); is this Python able to start with -I -S?"
            )

    def prompts(self, rng: random.Random) -> Iterator[Prompt]:
        while True:
            name = rng.choice(self.tasks)
            task = TASKS[name]
            consts = task.consts(rng)
            args = [task.arg(rng) for _ in range(self.calls)]
            expected = [json.loads(json.dumps(task.ref(consts, a))) for a in args]
            doc = task.doc(consts)
            text = header(doc)
            ids = (
                render_ids(self.tokenizer, [{"role": "user", "content": ask(doc)}], True)
                if self.chat
                else self.tokenizer.encode(text, add_special_tokens=False)
            )
            yield Prompt(
                prompt_ids=ids,
                task={"kind": name, "header": text, "chat": self.chat,
                      "calls": [[a] for a in args], "expected": expected},
            )  # fmt: skip

    def reward(
        self, task: dict[str, Any], completion_ids: list[int], completion_text: str
    ) -> float:
        out = call_entry(program(task, completion_text), "f", task["calls"], self.limits)
        if out.results is None:
            return 0.0
        right = sum(_same(got, want) for got, want in zip(out.results, task["expected"]))
        return right / len(task["expected"])


def _same(got: object, want: object) -> bool:
    """Equal as JSON values: 1 is not True, 1.0 is not 1 (Python's == says they are)."""
    return json.dumps(got, sort_keys=True) == json.dumps(want, sort_keys=True)
