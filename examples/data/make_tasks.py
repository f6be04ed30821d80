"""Three more single-digit tasks for SmolLM2, beyond addition (issue 51: do the defaults hold on
tasks they were not tuned on?). Deterministic: same seed, same files.

    python examples/data/make_tasks.py      # writes {mul1,sub1,max1}{,_heldout}.jsonl here

- mul1: ``What is A * B?`` for every ordered pair of digits (100): products up to 81.
- sub1: ``What is A - B?`` for every ordered pair (100): a third of the answers are negative.
- max1: ``Which is larger, A or B?`` for every ordered pair of different digits (90).

Each question ends ``Answer with only the number, like this: \\boxed{7}`` as add1's does
(examples/data/make_add.py), and the pairs are shuffled with ``--seed`` (default 0): 70 % go
to the training file, the rest to the ``_heldout`` file (the math adapter's ``heldout_path``),
so a held-out rise is not memory of the training prompts. The tasks were picked before any run,
not for how they turned out: SmolLM2-135M-Instruct knows small products, differences and
comparisons about as well as sums, and explains rather than answers on all four.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

ASK = " Answer with only the number, like this: \\boxed{7}"
TASKS = {
    "mul1": ("What is {a} * {b}?", lambda a, b: a * b, False),
    "sub1": ("What is {a} - {b}?", lambda a, b: a - b, False),
    "max1": ("Which is larger, {a} or {b}?", max, True),
}


def rows(task: str, seed: int) -> list[dict[str, str]]:
    text, answer, distinct = TASKS[task]
    pairs = [(a, b) for a in range(10) for b in range(10) if not (distinct and a == b)]
    random.Random(seed).shuffle(pairs)
    return [
        {"question": text.format(a=a, b=b) + ASK, "answer": str(answer(a, b))} for a, b in pairs
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(Path(__file__).parent))
    args = ap.parse_args()
    out = Path(args.out)
    for task in TASKS:
        rs = rows(task, args.seed)
        cut = round(0.7 * len(rs))
        for name, part in ((f"{task}.jsonl", rs[:cut]), (f"{task}_heldout.jsonl", rs[cut:])):
            with (out / name).open("w") as f:
                for r in part:
                    f.write(json.dumps(r) + "\n")
            print(f"{out / name}: {len(part)} questions")


if __name__ == "__main__":
    main()
