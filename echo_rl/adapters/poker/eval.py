"""``echo-rl eval poker``: final chip change of a policy against each opponent (Table 4 layout).

    echo-rl eval poker --model DIR --hands 500 [--opponent-model DIR] [--seats 2] [--json OUT]

For each opponent column (Rule-based1 = tight-aggressive ``tag``, Rule-based2 = calling
station ``station``, Rule-based3 = ``maniac``, LLM = a frozen model) the policy plays
``--hands`` independent hands (fresh stacks every hand), its seat alternating so that it is
in every position equally often; every column sees the same deals (common random numbers).
Reported: mean chip change per hand in big blinds with a 95% confidence interval
(mean +- 1.96 standard errors), and the share of the policy's actions that were invalid.

``--model`` is a Hugging Face folder, an Echo run folder (its latest checkpoint; the
observation format it trained with), ``tiny-qwen3`` (random init; a smoke test), or
``rule:tag`` / ``rule:station`` / ``rule:maniac`` to put a rule-based player in the policy's
seat (baselines, and a check of the harness without a model). ``--untrained`` with a run
folder evaluates the run's model as it started (its seeded initial weights, or the pretrained
ones), which is the "before" of a before/after comparison. A run folder's observation options
(``obs_format``, ``strength_hint``) are the ones it trained with. The LLM column's opponent is
``--opponent-model`` (default: a frozen copy of ``--model``, i.e. self-play); skip it with
``--no-llm``. Decisions of the policy are batched across hands (``--batch``).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

from echo_rl.core.jsontypes import JsonObject

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from echo_rl.adapters.hf import HFModel
    from echo_rl.adapters.poker.adapter import PokerAdapter
    from echo_rl.adapters.poker.players import Policy
    from echo_rl.data.episodes import Generated, GenerateFn

COLUMNS = [
    ("Rule-based1", "tag"),
    ("Rule-based2", "station"),
    ("Rule-based3", "maniac"),
    ("LLM", "llm"),
]


class HFChatPolicy:
    """A frozen model as a poker player: ``policy(messages) -> action text``."""

    def __init__(
        self,
        name: str,
        max_new_tokens: int = 32,
        temperature: float = 0.0,
        model: HFModel | None = None,
    ):
        from echo_rl.adapters.hf import HFModel

        self.model = model or HFModel(name)
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature

    def __call__(self, messages: list[dict[str, str]]) -> str:
        return self.model.chat(messages, self.max_new_tokens, self.temperature)


def mean_ci(xs: list[float]) -> tuple[float, float]:
    """(mean, half-width of the 95% normal interval)."""
    n = len(xs)
    if n == 0:
        return float("nan"), float("nan")
    m = sum(xs) / n
    if n == 1:
        return m, float("inf")
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1))
    return m, 1.96 * sd / math.sqrt(n)


class Column(TypedDict):
    """One opponent's column: the policy's chips against it over ``hands`` hands."""

    opponent: str
    hands: int
    mean_bb: float  # big blinds per hand
    ci95_bb: float  # half-width of the 95% interval
    total_chips: int
    decisions: int
    invalid_rate: float


class TableColumn(Column):
    column: str  # Table 4's label
    seconds: float


class PokerEval(TypedDict):
    """What ``evaluate`` returns (and ``--json`` writes, with the command line)."""

    model: str
    seats: int
    hands: int
    unit: str
    options: JsonObject  # the adapter's options the hands were played under
    columns: list[TableColumn]


class HeroGenerate:
    """The evaluated model's decisions: ``generate(prompts)`` at its token budget (which the
    adapter reads as ``max_new_tokens``)."""

    def __init__(self, hero: HFModel, max_new_tokens: int, temperature: float):
        self.hero = hero
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature

    def __call__(self, prompts: list[list[int]]) -> list[Generated]:
        return self.hero.generate(prompts, self.max_new_tokens, self.temperature)


def play_column(
    adapter: PokerAdapter,
    opponent: str,
    hands: int,
    seed: int,
    generate: GenerateFn,
    batch: int,
) -> Column:
    from echo_rl.core.wire import Group

    seats = adapter.table.seats
    tasks = [
        Group(
            group_id=f"hand-{h}",
            prompt_ids=[],
            task={
                "deal_seed": (seed * 1_000_003 + h) & 0x7FFFFFFF,
                "hero_seat": h % seats,
                "opponents": [opponent] * (seats - 1),
            },
            n=1,
            seed=seed * 7919 + h,
        )
        for h in range(hands)
    ]
    samples = []
    for i in range(0, hands, batch):
        samples += [g[0] for g in adapter.rollout(tasks[i : i + batch], generate)]
    bb = [s.info["net_chips"] / adapter.table.big_blind for s in samples]
    decisions = sum(s.info["decisions"] for s in samples)
    invalid = sum(s.info["invalid"] for s in samples)
    mean, ci = mean_ci(bb)
    return {
        "opponent": opponent,
        "hands": hands,
        "mean_bb": mean,
        "ci95_bb": ci,
        "total_chips": sum(s.info["net_chips"] for s in samples),
        "decisions": decisions,
        "invalid_rate": invalid / decisions if decisions else 0.0,
    }


def _rule_seat_only(prompts: list[list[int]]) -> list[Generated]:
    """The policy's seat when a rule-based player fills it: it plays every decision, so
    nothing is ever asked of a model."""
    raise AssertionError("a rule-based player plays the policy's seat: no decision to generate")


def evaluate(
    model: str,
    hands: int,
    *,
    opponent_model: str | None = None,
    seats: int = 2,
    seed: int = 0,
    batch: int = 32,
    max_new_tokens: int | None = None,
    temperature: float = 0.0,
    obs_format: str | None = None,
    llm: bool = True,
    bot_samples: int = 48,
    hero: HFModel | None = None,
    opponent_policy: Policy | None = None,
    strength_hint: bool | None = None,
    untrained: bool = False,
) -> PokerEval:
    """Rows of Table 4 for one policy. ``hero``/``opponent_policy`` inject ready objects
    (an ``HFModel``; a ``policy(messages) -> text``) instead of loading folders."""
    from echo_rl.adapters.poker.adapter import PokerAdapter

    rule = model.startswith("rule:")
    if rule:
        from echo_rl.data.testing import build_chatml_char_tokenizer

        tokenizer: PreTrainedTokenizerBase = build_chatml_char_tokenizer()
    else:
        from echo_rl.adapters.hf import HFModel

        # poker transcripts outgrow the tiny model's default 64 positions
        if not hero:
            tiny_positions = model == "tiny-qwen3"
            hero = (
                HFModel(model, untrained=untrained, max_positions=1024)
                if tiny_positions
                else HFModel(model, untrained=untrained)
            )
        tokenizer = hero.tokenizer

    run = getattr(hero, "run_config", None)
    if max_new_tokens is None:  # as the run generated: a longer budget lets a policy that
        # learned "c" then any token (its end of turn is appended) answer "c5", invalid
        max_new_tokens = run.worker.max_new_tokens if run is not None else 32
    generate: GenerateFn = (
        _rule_seat_only if rule or hero is None else HeroGenerate(hero, max_new_tokens, temperature)
    )
    trained = dict(run.adapter.effective_options if run is not None else {})
    tiny = model == "tiny-qwen3" or (run is not None and run.model.name == "tiny-qwen3")
    fmt = obs_format or trained.get("obs_format") or ("compact" if tiny else "text")
    hint = trained.get("strength_hint", False) if strength_hint is None else strength_hint
    options: JsonObject = {
        "seats": seats,
        "obs_format": fmt,
        "group_by": "deal",
        "bot_samples": bot_samples,
        "max_episode_tokens": 1 << 20,
        "strength_hint": bool(hint),
        # what the policy saw and could answer as it trained
        "allin": bool(trained.get("allin", True)),
        "show_results": bool(trained.get("show_results", True)),
        "answer_letters": str(trained.get("answer_letters", "")),
    }
    if rule:
        options.update(offpolicy_player=model.split(":", 1)[1], offpolicy_fraction=1.0)
    adapter = PokerAdapter(options, tokenizer)
    if hero is not None:  # answers restricted as the run sampled them (echo_rl/data/answers.py)
        hero.answer_tokens = adapter.answer_tokens
    columns: list[TableColumn] = []
    for label, opp in COLUMNS:
        if opp == "llm":
            if not llm:
                continue
            if opponent_policy is None:
                if opponent_model:
                    opponent_policy = HFChatPolicy(opponent_model, max_new_tokens, temperature)
                elif not rule:  # a frozen copy of the evaluated model
                    opponent_policy = HFChatPolicy(model, max_new_tokens, temperature, model=hero)
                else:
                    continue
            adapter.set_llm_opponent(opponent_policy)
        t0 = time.monotonic()
        col = play_column(adapter, opp, hands, seed, generate, batch)
        columns.append(TableColumn(column=label, **col, seconds=round(time.monotonic() - t0, 2)))
    return {
        "model": model + (" (untrained)" if untrained else ""),
        "seats": seats,
        "hands": hands,
        "unit": "big blinds per hand",
        "options": options,
        "columns": columns,
    }


def table(result: PokerEval) -> str:
    cols = result["columns"]
    head = ["Model"] + [
        c["column"] + (" (" + c["opponent"] + ")" if c["opponent"] != "llm" else "") for c in cols
    ]
    row = [result["model"]] + [f"{c['mean_bb']:+.3f} ± {c['ci95_bb']:.3f}" for c in cols]
    inv = ["invalid actions"] + [f"{100 * c['invalid_rate']:.1f}%" for c in cols]
    widths = [max(len(a), len(b), len(c)) for a, b, c in zip(head, row, inv)]

    def fmt(cells: list[str]) -> str:
        return "| " + " | ".join(x.ljust(w) for x, w in zip(cells, widths)) + " |"

    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join(
        [
            f"Final chip change ({result['unit']}, mean ± 95% CI, "
            f"{result['hands']} hands per opponent, {result['seats']} seats)",
            fmt(head),
            rule,
            fmt(row),
            fmt(inv),
        ]
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="echo-rl eval poker", description=__doc__.splitlines()[0])
    ap.add_argument(
        "--model",
        required=True,
        help="HF folder, Echo run folder, tiny-qwen3, or rule:tag|station|maniac",
    )
    ap.add_argument("--hands", type=int, default=200, help="hands per opponent")
    ap.add_argument("--opponent-model", default=None, help="HF folder of the LLM opponent")
    ap.add_argument("--no-llm", action="store_true", help="skip the LLM column")
    ap.add_argument("--seats", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", type=int, default=32, help="hands whose decisions are batched")
    ap.add_argument(
        "--max-new-tokens",
        type=int,
        default=None,
        help="per decision (default: a run folder's worker.max_new_tokens, else 32)",
    )
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    ap.add_argument("--obs-format", choices=["text", "compact", "strength"], default=None)
    ap.add_argument(
        "--strength-hint",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="show the policy its hand strength (default: as the run trained)",
    )
    ap.add_argument(
        "--untrained",
        action="store_true",
        help="a run folder's model before training (its initial weights)",
    )
    ap.add_argument("--json", type=Path, default=None, help="also write the result here")
    args = ap.parse_args(argv)
    try:
        res = evaluate(
            args.model,
            args.hands,
            opponent_model=args.opponent_model,
            seats=args.seats,
            seed=args.seed,
            batch=args.batch,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            obs_format=args.obs_format,
            llm=not args.no_llm,
            strength_hint=args.strength_hint,
            untrained=args.untrained,
        )
    except Exception as exc:  # a readable line, not a traceback, for a bad model/option
        from echo_rl.core.models import ModelError
        from echo_rl.data.adapter import AdapterError

        if isinstance(exc, (AdapterError, ModelError, ValueError)):
            print(f"echo-rl eval poker: {exc}", file=sys.stderr)
            return 2
        raise
    print(table(res))
    if args.json:  # with what produced it: the command line and the machine
        from echo_rl.core.machine import write_result

        write_result(
            args.json,
            {
                **res,
                "command": " ".join(
                    ["echo-rl eval poker", *(argv if argv is not None else sys.argv[1:])]
                ),
            },
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
