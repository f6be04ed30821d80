"""Opponents: three rule-based styles and a language-model player (a frozen policy).

``tag``      tight-aggressive: plays few hands, bets and raises them hard, folds the rest.
``station``  loose-passive calling station: calls almost anything, almost never raises.
``maniac``   random/loose-aggressive: picks uniformly among fold/call/raise sizes (it reports
             the probability of what it picked, so its logs are usable as off-policy data).
``LLMPlayer`` wraps any ``policy(messages) -> text`` callable: a frozen snapshot of a model
             (see ``echo_rl/adapters/poker/eval.py`` for one built on a local Hugging Face folder), an
             API, or a test double. It keeps its own chat transcript within an episode.

Rule-based players judge their hand with the Chen formula before the flop and a small Monte
Carlo equity estimate (``samples`` run-outs against random hands, pokerkit's evaluator) after.
Their choices are deterministic given their RNG, which the adapter seeds per episode.
"""

from __future__ import annotations

import math
import random
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Protocol

from echo_rl.adapters.poker.game import RANKS, SUITS, Action, Decision, Player, format_action

if TYPE_CHECKING:
    from pokerkit import Card


def chen_score(hole: tuple[str, ...]) -> float:
    """Bill Chen's preflop hand score (about -1 .. 20)."""
    (r1, s1), (r2, s2) = tuple(hole[0]), tuple(hole[1])
    value = {"A": 10, "K": 8, "Q": 7, "J": 6, "T": 5}
    a, b = sorted((RANKS.index(r1), RANKS.index(r2)), reverse=True)
    hi = RANKS[a]
    score = value.get(hi, (a + 2) / 2)
    if a == b:
        return max(score * 2, 5)
    if s1 == s2:
        score += 2
    gap = a - b - 1
    score -= {0: 0, 1: 1, 2: 2, 3: 4}.get(gap, 5)
    if gap <= 1 and a < RANKS.index("Q"):
        score += 1
    return math.ceil(score)


@lru_cache(maxsize=4096)
def equity(
    hole: tuple[str, ...], board: tuple[str, ...], opponents: int, samples: int, seed: int
) -> float:
    """Monte Carlo share of the pot against ``opponents`` random hands (ties split)."""
    from pokerkit import Card, StandardHighHand

    used = set(hole) | set(board)
    deck = [r + s for r in RANKS for s in SUITS if r + s not in used]
    rng = random.Random(seed)

    def parse(cs: Iterable[str]) -> list[Card]:
        return list(Card.parse("".join(cs)))

    me = parse(hole)
    won = 0.0
    for _ in range(samples):
        draw = rng.sample(deck, 5 - len(board) + 2 * opponents)
        full = parse(board) + parse(draw[: 5 - len(board)])
        mine = StandardHighHand.from_game(me, full)
        rest = draw[5 - len(board) :]
        theirs = [
            StandardHighHand.from_game(parse(rest[2 * k : 2 * k + 2]), full)
            for k in range(opponents)
        ]
        best = max(theirs)
        if mine > best:
            won += 1
        elif mine == best:
            won += 1 / (1 + sum(t == mine for t in theirs))
    return won / samples


def strength(d: Decision, samples: int) -> float:
    """0..1: Chen score / 20 before the flop, equity against the live opponents after.
    What the rule-based players judge their hand by, and the policy's ``strength_hint``."""
    if d.street == "preflop":
        return min(max(chen_score(d.hole), 0) / 20, 1.0)
    live = max(1, sum(1 for o in d.opponents if not o[3]))
    # a fixed MC seed: equity is a function of the cards alone, cached across decisions
    return equity(tuple(d.hole), tuple(d.board), min(live, 3), samples, 0)


class RuleBased(ABC):
    """Shared plumbing: a seeded RNG, the hand-strength estimate, action text."""

    name = "rule"
    fmt = "text"

    def __init__(self, seed: int = 0, samples: int = 48, fmt: str = "text"):
        self.rng = random.Random(seed)
        self.samples = samples
        self.fmt = fmt
        self.last_logprob = 0.0

    def strength(self, d: Decision) -> float:
        return strength(d, self.samples)

    @abstractmethod
    def act(self, d: Decision) -> str:
        """The action text for ``d``: each style decides."""

    def say(self, a: Action, d: Decision, logprob: float = 0.0) -> str:
        self.last_logprob = logprob
        return format_action(a, self.fmt, d.to_call > 0)

    @staticmethod
    def raise_to(d: Decision, target: int) -> Action:
        assert d.min_raise_to is not None and d.max_raise_to is not None
        return Action("raise", int(min(max(target, d.min_raise_to), d.max_raise_to)))

    def passive(self, d: Decision) -> Action:
        return Action("check" if d.can_check else "fold")

    def new_episode(self) -> None:  # noqa: B027 (a rule-based style keeps nothing per episode)
        return None


class TightAggressive(RuleBased):
    name = "tag"

    def act(self, d: Decision) -> str:
        s = self.strength(d)
        pot_odds = d.to_call / max(d.pot + d.to_call, 1)
        if d.street == "preflop":
            if s >= 0.5 and d.min_raise_to is not None:  # ~top 10%: raise 3x
                return self.say(self.raise_to(d, max(3 * d.big_blind, 3 * (d.bet + d.to_call))), d)
            if s >= 0.4 and d.to_call <= 3 * d.big_blind:
                return self.say(Action("call" if d.to_call else "check"), d)
            return self.say(self.passive(d), d)
        if s >= 0.7 and d.min_raise_to is not None:
            return self.say(self.raise_to(d, d.bet + d.to_call + (2 * d.pot) // 3), d)
        if d.to_call and s >= pot_odds + 0.1:
            return self.say(Action("call"), d)
        if not d.to_call and s >= 0.55 and d.min_raise_to is not None:
            return self.say(self.raise_to(d, d.pot // 2), d)
        return self.say(self.passive(d), d)


class CallingStation(RuleBased):
    name = "station"

    def act(self, d: Decision) -> str:
        if d.to_call == 0:
            if d.street != "preflop" and d.min_raise_to is not None and self.strength(d) > 0.9:
                return self.say(self.raise_to(d, d.min_raise_to), d)
            return self.say(Action("check"), d)
        if d.to_call > (d.stack + d.bet) // 2 and self.strength(d) < 0.3:
            return self.say(Action("fold"), d)
        return self.say(Action("call"), d)


class Maniac(RuleBased):
    """Uniform over the legal menu {fold (if facing a bet), check/call, min raise, pot raise,
    all-in}; ``last_logprob`` is log(1/len(menu))."""

    name = "maniac"

    def act(self, d: Decision) -> str:
        menu = [Action("check" if d.can_check else "call")]
        if not d.can_check:
            menu.append(Action("fold"))
        if d.min_raise_to is not None and d.max_raise_to is not None:
            pot_to = d.bet + d.to_call + d.pot + d.to_call
            menu += [
                Action("raise", d.min_raise_to),
                self.raise_to(d, pot_to),
                Action("raise", d.max_raise_to),
            ]
        uniq = list(dict.fromkeys(menu))
        a = self.rng.choice(uniq)
        return self.say(a, d, -math.log(len(uniq)))


RULE_PLAYERS: dict[str, type[RuleBased]] = {
    "tag": TightAggressive,
    "station": CallingStation,
    "maniac": Maniac,
}

Policy = Callable[[list[dict[str, str]]], str]


class Opponent(Player, Protocol):
    """A seat the adapter fills: it acts, reports the log-prob of what it played, and starts
    each episode afresh."""

    last_logprob: float

    def new_episode(self) -> None: ...


@dataclass(frozen=True)
class LLMSeat:
    """What an ``llm`` opponent is built from: the frozen model's ``policy``, the system
    prompt it plays under and how a decision is rendered for it."""

    policy: Policy
    system: str
    render: Callable[[Decision], str]


class LLMPlayer:
    """A language-model player: keeps (system, user observation, assistant action, ...) and
    asks ``policy`` for the next action text. ``render`` maps a Decision to the observation."""

    name = "llm"

    def __init__(self, policy: Policy, system: str, render: Callable[[Decision], str]):
        self.policy = policy
        self.system = system
        self.render = render
        self.messages: list[dict[str, str]] = []
        self.last_logprob = 0.0
        self.new_episode()

    def new_episode(self) -> None:
        self.messages = [{"role": "system", "content": self.system}]

    def act(self, d: Decision) -> str:
        self.messages.append({"role": "user", "content": self.render(d)})
        text = str(self.policy(list(self.messages)))
        self.messages.append({"role": "assistant", "content": text})
        return text


def make_player(
    name: str, seed: int, fmt: str, samples: int = 48, llm: LLMSeat | None = None
) -> Opponent:
    """``tag`` / ``station`` / ``maniac``, or ``llm`` (needs the ``llm`` seat's policy)."""
    if name in RULE_PLAYERS:
        return RULE_PLAYERS[name](seed=seed, samples=samples, fmt=fmt)
    if name == "llm":
        if not llm:
            raise ValueError("the llm opponent needs a policy (a frozen model); none configured")
        return LLMPlayer(llm.policy, llm.system, llm.render)
    raise ValueError(f"unknown player {name!r}: use one of {sorted(RULE_PLAYERS) + ['llm']}")
