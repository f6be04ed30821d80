"""Generate the single-digit addition set for SmolLM2 (deterministic: same seed, same files).

    python examples/data/make_add.py      # writes add1.jsonl and add1_heldout.jsonl here

Every question is ``What is A + B? Answer with only the number, like this: \\boxed{7}`` for a
pair of digits A, B in 0-9, with the answer as a string. The 100 ordered pairs are shuffled with
``--seed`` (default 0); the first 70 go to add1.jsonl (training) and the other 30 to
add1_heldout.jsonl (the math adapter's ``heldout_path``, what ``echo-rl eval --split heldout``
scores). No held-out pair is in the training file, so a rise there is not memory of the
training prompts. (examples/smollm2-full.toml and smollm2-lora.toml use these files.)

Why this task: SmolLM2-135M-Instruct can add digits but, sampled at the run's temperature with
a 16-token budget, it mostly explains instead of answering ("To calculate 3 + 2, we need to
..."), and the math adapter takes the last ``\\boxed{}`` else the last number, so a correct
sum followed by more words, or cut off, scores as a wrong answer: ``format_reward`` (0.1 in
examples/smollm2-*.toml) when a number was found, else 0. Answering tersely in ``\\boxed{}`` is what
lifts the reward: a behaviour a short CPU run can reinforce.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

PROMPT = "What is {a} + {b}? Answer with only the number, like this: \\boxed{{7}}"


def pairs(seed: int) -> list[tuple[int, int]]:
    ps = [(a, b) for a in range(10) for b in range(10)]
    random.Random(seed).shuffle(ps)
    return ps


def rows(ps: list[tuple[int, int]]) -> list[dict[str, str]]:
    return [{"question": PROMPT.format(a=a, b=b), "answer": str(a + b)} for a, b in ps]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--train", type=int, default=70, help="pairs in the training file (of 100)")
    ap.add_argument("--out", default=str(Path(__file__).parent))
    args = ap.parse_args()
    ps = pairs(args.seed)
    out = Path(args.out)
    for name, part in (("add1.jsonl", ps[: args.train]), ("add1_heldout.jsonl", ps[args.train :])):
        with (out / name).open("w") as f:
            for r in rows(part):
                f.write(json.dumps(r) + "\n")
        print(f"{out / name}: {len(part)} questions")


if __name__ == "__main__":
    main()
