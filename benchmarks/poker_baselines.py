"""What simple strength-reading policies win against the three rule-based poker opponents.

    python benchmarks/poker_baselines.py [--hands 1000] [--json benchmarks/results/poker_baselines.json]

The policy's seat is played by a fixed rule that reads only what the ``strength`` observation
format shows (street, strength digit 0-9, whether a bet is faced), through the same adapter,
table and deals as ``echo-rl eval poker`` (heads-up, 100 big blinds, seats alternating,
common random numbers). These are the targets a trained tiny model could reach with that
observation (docs/adapters.md, "Poker that learns"):

- ``fold``: check when free, fold to any bet; what an untrained model's invalid answers play;
- ``call`` / ``raise``: the same answer every time (``c`` / ``b`` = pot-size raise);
- ``threshold``: raise with a strong hand (preflop digit >= 4, after the flop >= 6), call with
  a fair one (>= 2 / >= 4), fold the rest;
- ``threshold-loose``: raise from 3 / 6, call from 2 / 3, and always check when it is free.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

Rule = Callable[[str, int, bool], str]  # (street d/e, strength digit, facing a bet) -> letter


def _threshold(
    pre_raise: int, post_raise: int, pre_call: int, post_call: int, check_free: bool
) -> Rule:
    def rule(street: str, digit: int, facing: bool) -> str:
        pre = street == "d"
        if digit >= (pre_raise if pre else post_raise):
            return "b"
        if digit >= (pre_call if pre else post_call) or (check_free and not facing):
            return "c"
        return "f"

    return rule


RULES: dict[str, Rule] = {
    "fold": lambda s, d, f: "f",
    "call": lambda s, d, f: "c",
    "raise": lambda s, d, f: "b",
    "threshold": _threshold(4, 6, 2, 4, False),
    "threshold-loose": _threshold(3, 6, 2, 3, True),
}


def scripted(tokenizer: Any, rule: Rule, user: str) -> Any:
    """A ``generate`` that answers by ``rule`` from the last observation (``[de][0-9][+=]``),
    found after the last ``user`` turn header."""

    def generate(prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
        out = []
        for p in prompts:
            obs = tokenizer.decode(p).split(user)[-1][:3]
            letter = rule(obs[0], int(obs[1]), obs[2] == "+")
            out.append((tokenizer.encode(letter, add_special_tokens=False), [0.0]))
        return out

    generate.max_new_tokens = 1
    return generate


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hands", type=int, default=1000, help="hands per opponent and rule")
    ap.add_argument("--bot-samples", type=int, default=48)
    ap.add_argument("--json", type=Path, default=ROOT / "benchmarks/results/poker_baselines.json")
    a = ap.parse_args(argv)
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from echo_rl.adapters.poker.adapter import PokerAdapter
    from echo_rl.adapters.poker.eval import mean_ci
    from echo_rl.core.config import ModelConfig
    from echo_rl.core.machine import write_result
    from echo_rl.core.models import load_tokenizer

    tok = load_tokenizer(ModelConfig())
    ad = PokerAdapter(
        {
            "obs_format": "strength",
            "show_results": False,
            "allin": False,
            "bot_samples": a.bot_samples,
            "max_episode_tokens": 1 << 20,
        },
        tok,
    )
    user = tok.decode(ad.builder.user("d0+")).split("d0+")[0]  # the user turn's header
    rows: dict[str, dict[str, Any]] = {}
    t0 = time.monotonic()
    with Progress(console=Console(stderr=True)) as bar:
        job = bar.add_task("rules x opponents", total=len(RULES) * 3)
        for name, rule in RULES.items():
            gen = scripted(tok, rule, user)
            for opp in ("tag", "station", "maniac"):
                tasks = [
                    SimpleNamespace(
                        task={"deal_seed": h, "hero_seat": h % 2, "opponents": [opp]}, n=1, seed=h
                    )  # as echo-rl eval poker deals them
                    for h in range(a.hands)
                ]
                samples = [g[0] for g in ad.rollout(tasks, gen)]
                m, ci = mean_ci([s.info["net_chips"] / ad.table.big_blind for s in samples])
                rows.setdefault(name, {})[opp] = {"mean_bb": m, "ci95_bb": ci}
                bar.advance(job)
    table = Table(
        title=f"Strength-reading rules, big blinds per hand ± 95% CI, {a.hands} hands each"
    )
    for col in ("rule", "tag", "station", "maniac"):
        table.add_column(col)
    for name, r in rows.items():
        table.add_row(
            name,
            *(
                f"{r[o]['mean_bb']:+.3f} ± {r[o]['ci95_bb']:.3f}"
                for o in ("tag", "station", "maniac")
            ),
        )
    Console().print(table)
    a.json.parent.mkdir(parents=True, exist_ok=True)
    write_result(
        a.json,
        {
            "command": " ".join(
                ["python", "benchmarks/poker_baselines.py", *(argv or sys.argv[1:])]
            ),
            "hands": a.hands,
            "seconds": round(time.monotonic() - t0, 1),
            "rules": rows,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
