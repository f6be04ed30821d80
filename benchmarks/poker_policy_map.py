"""What a poker run's policy answers in each state of the ``strength`` observation format.

    python benchmarks/poker_policy_map.py RUN_DIR [--untrained]

For every observation the ``strength`` format can show (street d/e, strength digit 0-9, a bet
faced + or not =) the run's latest checkpoint (or, with ``--untrained``, its initial weights)
gives a distribution over its next token. Printed per state: the most likely action letter
among f / c / b and its probability, and the probability of all tokens that are not an action
letter (invalid answers: check when free, else fold). A run with ``answer_letters`` samples
from the softmax over those letters only (echo_rl/data/answers.py): its probabilities are
renormalised over them and its invalid share is 0. A policy that learned poker answers
differently for a strong and a weak hand; one that did not shows the same row everywhere.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def policy_map(run: str, untrained: bool = False) -> dict[str, dict[str, float]]:
    """{observation: {letter: probability, ..., "invalid": probability}}."""
    import torch

    from echo_rl.adapters.hf import HFModel
    from echo_rl.adapters.poker.adapter import PokerAdapter
    from echo_rl.data.answers import answer_bias

    m = HFModel(run, untrained=untrained)
    if (
        m.run_config is None
        or m.run_config.adapter.effective_options.get("obs_format") != "strength"
    ):
        raise SystemExit(f'{run}: not an Echo run folder trained with obs_format = "strength"')
    tok = m.tokenizer
    adapter = PokerAdapter(dict(m.run_config.adapter.effective_options), tok)
    letters = {c: tok.convert_tokens_to_ids(c) for c in "fcba"}
    out: dict[str, dict[str, float]] = {}
    for obs in (f"{s}{d}{f}" for s in "de" for f in "+=" for d in range(10)):
        ids = adapter.builder.start() + adapter.builder.user(obs)
        with torch.no_grad():
            logits = m.model(torch.tensor([ids])).logits[0, -1].float()
        if adapter.answer_tokens is not None:  # the distribution the run samples from
            logits = logits + answer_bias(adapter.answer_tokens, logits.shape[-1])
        p = torch.softmax(logits, -1)
        row = {c: float(p[i]) for c, i in letters.items()}
        row["invalid"] = 1.0 - sum(row.values())
        out[obs] = row
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run")
    ap.add_argument("--untrained", action="store_true", help="the run's initial weights")
    a = ap.parse_args(argv)
    from rich.console import Console
    from rich.table import Table

    rows = policy_map(a.run, a.untrained)
    table = Table(
        title=f"{a.run}{' (untrained)' if a.untrained else ''}: most likely letter "
        "(its probability), probability of an invalid answer"
    )
    table.add_column("state")
    for d in range(10):
        table.add_column(str(d))
    for street in "de":
        for faced in "+=":
            cells = []
            for d in range(10):
                r = rows[f"{street}{d}{faced}"]
                best = max("fcb", key=r.__getitem__)
                cells.append(f"{best} {r[best]:.3f} / {abs(r['invalid']):.2f}")
            name = ("preflop" if street == "d" else "post-flop") + (
                ", bet faced" if faced == "+" else ", free"
            )
            table.add_row(name, *cells)
    Console(width=220).print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
