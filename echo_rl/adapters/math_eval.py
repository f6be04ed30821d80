"""``echo-rl eval math``: accuracy of a model on a JSONL of questions and answers.

    echo-rl eval math --model DIR --data examples/data/arith_words.jsonl [--limit 200]

Each question goes through the chat template exactly as the ``math`` adapter builds training
prompts (same options: ``--system``, ``--no-chat-template``, ``--question-key`` ...); the
completion is generated greedily (``--temperature 0``, default) in batches and scored by the
adapter's reward (final answer extracted, checked with math-verify). Printed: accuracy with a
95% Wilson interval, the share of completions with no extractable answer, and a few examples.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

from echo_rl.core.jsontypes import JsonObject, JsonValue

if TYPE_CHECKING:
    from echo_rl.adapters.hf import HFModel


class Example(TypedDict):
    """One scored question, tails of its text kept, for the report."""

    prompt: str
    completion: str
    answer: JsonValue  # the data set's answer
    reward: float


class MathEval(TypedDict):
    """What ``evaluate`` returns (and ``--json`` writes)."""

    model: str
    data: str
    n: int
    correct: int
    accuracy: float
    ci95: list[float]  # Wilson interval, [low, high]
    no_answer_rate: float
    checker: dict[str, int]  # the checker's counts: fast, verified, timeouts
    examples: list[Example]
    seconds: float


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    if n == 0:
        return float("nan"), float("nan")
    p = k / n
    den = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return max(0.0, centre - half), min(1.0, centre + half)


def evaluate(
    model: str,
    data: str,
    *,
    limit: int = 0,
    batch: int = 16,
    max_new_tokens: int = 512,
    temperature: float = 0.0,
    options: JsonObject | None = None,
    hero: HFModel | None = None,
) -> MathEval:
    from echo_rl.adapters.hf import HFModel
    from echo_rl.adapters.math import MathAdapter
    from echo_rl.adapters.mathcheck import extract_answer

    hero = hero or HFModel(model)
    tok = hero.tokenizer
    adapter = MathAdapter({"path": data, **(options or {})}, tok)
    items = adapter.items()
    if limit:
        items = items[:limit]
    correct = no_answer = 0
    examples: list[Example] = []
    t0 = time.monotonic()
    try:
        for i in range(0, len(items), batch):
            chunk = items[i : i + batch]
            outs = hero.generate([ids for ids, _ in chunk], max_new_tokens, temperature)
            for (ids, task), (gen, _) in zip(chunk, outs):
                text = str(tok.decode(gen, skip_special_tokens=True))
                r = adapter.reward(task, gen, text)
                correct += r == 1.0
                no_answer += extract_answer(text) is None
                if len(examples) < 3:
                    examples.append(
                        {
                            "prompt": str(tok.decode(ids, skip_special_tokens=True))[-200:],
                            "completion": text[-200:],
                            "answer": task["answer"],
                            "reward": r,
                        }
                    )
    finally:
        adapter.checker.close()
    n = len(items)
    lo, hi = wilson(correct, n)
    return {
        "model": model,
        "data": data,
        "n": n,
        "correct": correct,
        "accuracy": correct / n if n else float("nan"),
        "ci95": [lo, hi],
        "no_answer_rate": no_answer / n if n else float("nan"),
        "checker": dict(adapter.checker.stats),
        "examples": examples,
        "seconds": round(time.monotonic() - t0, 2),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="echo-rl eval math", description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="HF folder or tiny-qwen3")
    ap.add_argument("--data", required=True, help="JSONL with question/answer fields")
    ap.add_argument("--limit", type=int, default=0, help="first N questions (0: all)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=512)
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    ap.add_argument("--system", default=None)
    ap.add_argument("--question-key", default="question")
    ap.add_argument("--answer-key", default="answer")
    ap.add_argument("--no-chat-template", action="store_true")
    ap.add_argument("--json", type=Path, default=None, help="also write the result here")
    args = ap.parse_args(argv)
    options: JsonObject = {
        "question_key": args.question_key,
        "answer_key": args.answer_key,
        "chat_template": not args.no_chat_template,
    }
    if args.system:
        options["system"] = args.system
    try:
        res = evaluate(
            args.model,
            args.data,
            limit=args.limit,
            batch=args.batch,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            options=options,
        )
    except Exception as exc:
        from echo_rl.core.models import ModelError
        from echo_rl.data.adapter import AdapterError

        if isinstance(exc, (AdapterError, ModelError)):
            print(f"echo-rl eval math: {exc}", file=sys.stderr)
            return 2
        raise
    lo, hi = res["ci95"]
    print(
        f"{res['model']} on {res['data']}: accuracy {res['accuracy']:.3f} "
        f"({res['correct']}/{res['n']}, 95% CI {lo:.3f}..{hi:.3f}); no answer found in "
        f"{100 * res['no_answer_rate']:.1f}%; {res['seconds']}s"
    )
    if args.json:
        args.json.write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
