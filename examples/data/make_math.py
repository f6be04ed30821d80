"""Generate the small math data sets shipped with Echo (deterministic: same seed, same files).

    python examples/data/make_math.py            # writes arith.jsonl and arith_words.jsonl here

arith.jsonl        400 questions like ``12+7=`` / ``9*3=`` / ``4-11=``: written only with digits
                   and ``+-*=``, so the tiny-qwen3 character tokenizer can encode them (the
                   quickstart-sized math example, examples/math.toml, trains on this file).
arith_words.jsonl  300 one- or two-step arithmetic word problems ("Ana has 12 shells and
                   finds 7 more. ...") with integer answers, for real models.

arith_heldout.jsonl, arith_words_heldout.jsonl
                   100 questions each of the same kinds, none of them in the training file:
                   the math adapter's held-out split (options.heldout_path; echo-rl eval
                   --split heldout). Drawn from their own RNG (seed + 1), so adding them left
                   the training files as they were.

Each line is ``{"question": ..., "answer": ...}`` with the answer as a string.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

NAMES = ["Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Gus", "Hana", "Ivan", "Jo", "Kofi", "Lena"]
THINGS = ["apples", "marbles", "stickers", "books", "shells", "coins", "pencils", "cards"]


def arith(rng: random.Random, n: int) -> list[dict[str, str]]:
    rows, seen = [], set()
    while len(rows) < n:
        op = rng.choice("++-*")  # addition twice as often: the easiest to learn
        if op == "*":
            a, b = rng.randint(2, 9), rng.randint(2, 9)
            ans = a * b
        elif op == "+":
            a, b = rng.randint(0, 50), rng.randint(0, 50)
            ans = a + b
        else:
            a, b = rng.randint(0, 50), rng.randint(0, 50)
            ans = a - b
        q = f"{a}{op}{b}="
        if q in seen:
            continue
        seen.add(q)
        rows.append({"question": q, "answer": str(ans)})
    return rows


def words(rng: random.Random, n: int) -> list[dict[str, str]]:
    rows = []
    for _ in range(n):
        who, thing = rng.choice(NAMES), rng.choice(THINGS)
        kind = rng.randrange(5)
        a, b, c = rng.randint(2, 60), rng.randint(2, 40), rng.randint(2, 9)
        if kind == 0:
            q, ans = (
                f"{who} has {a} {thing} and finds {b} more. How many {thing} does {who} have now?",
                a + b,
            )
        elif kind == 1:
            a = a + b
            q, ans = f"{who} had {a} {thing} and gave away {b}. How many {thing} are left?", a - b
        elif kind == 2:
            q, ans = (
                f"{who} buys {c} boxes with {b} {thing} in each box. How many {thing} is that in total?",
                b * c,
            )
        elif kind == 3:
            q, ans = (
                (
                    f"{who} shares {b * c} {thing} equally among {c} friends. How many {thing} "
                    f"does each friend get?"
                ),
                b,
            )
        else:
            q, ans = (
                (
                    f"{who} has {a} {thing}, buys {c} packs of {b} more, then loses {min(a, 5)}. "
                    f"How many {thing} does {who} have?"
                ),
                a + b * c - min(a, 5),
            )
        rows.append({"question": q + " Put the final answer in \\boxed{}.", "answer": str(ans)})
    return rows


def heldout(make, rng: random.Random, n: int, train: list[dict[str, str]]) -> list[dict[str, str]]:
    """``n`` rows from ``make`` whose questions are not in ``train`` (nor repeated)."""
    seen = {r["question"] for r in train}
    rows: list[dict[str, str]] = []
    while len(rows) < n:
        for r in make(rng, n):
            if r["question"] not in seen and len(rows) < n:
                seen.add(r["question"])
                rows.append(r)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    train = {"arith.jsonl": arith(rng, 400), "arith_words.jsonl": words(rng, 300)}
    rng_heldout = random.Random(args.seed + 1)
    files = {
        **train,
        "arith_heldout.jsonl": heldout(arith, rng_heldout, 100, train["arith.jsonl"]),
        "arith_words_heldout.jsonl": heldout(words, rng_heldout, 100, train["arith_words.jsonl"]),
    }
    for name, rows in files.items():
        path = args.out / name
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        print(f"wrote {len(rows)} rows to {path}")


if __name__ == "__main__":
    main()
