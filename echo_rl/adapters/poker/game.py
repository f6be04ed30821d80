"""The poker sandbox: no-limit hold'em on ``pokerkit``, seeded deals, raw per-seat logs.

``play_hand`` is a generator: rule-based and other in-process players act inline; a seat whose
player is ``None`` is *external*: the generator yields its ``Decision`` and expects the action
text back through ``send()``. That is how one LLM decision becomes one generation request
(and how many hands run in lockstep, their decisions batched into one ``generate`` call).

Every seat's raw log is the Appendix D log: per turn the observation text, the action text
and the chip delta (the change of the seat's stack since its previous turn, blinds included in
the first turn and the payout in the last, so the deltas sum to the hand's net chips).

Action text (case-insensitive), verbose: ``Action: Fold | Check | Call | Bet N | Raise N |
All-in`` (N = the total the seat puts in this betting round, "raise to"); compact (tiny
vocabulary): ``f``, ``c`` (check or call), ``bN`` (bet/raise to N), ``a`` (all-in).
Unparseable or illegal text (e.g. "check" facing a bet) is *invalid*: the seat folds (checks
if that is free) and the hand records it; the adapter turns it into a reward penalty. A fold
when checking is free is played as a check; a bet size outside the legal range is clamped.
"""

from __future__ import annotations

import random
import re
import warnings
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol

if TYPE_CHECKING:
    from pokerkit import Card, State

RANKS = "23456789TJQKA"
SUITS = "cdhs"
STREETS = ("preflop", "flop", "turn", "river")


@dataclass(frozen=True)
class TableConfig:
    seats: int = 2
    stack: int = 200
    small_blind: int = 1
    big_blind: int = 2

    def __post_init__(self) -> None:
        if not 2 <= self.seats <= 6:
            raise ValueError(f"seats={self.seats}: 2..6 supported")
        if not 0 < self.small_blind <= self.big_blind < self.stack:
            raise ValueError("need 0 < small_blind <= big_blind < stack")


@dataclass(frozen=True)
class Action:
    kind: str  # fold | check | call | raise | allin | pot (a raise to the size of the pot)
    amount: int = 0  # raise-to total for "raise"


# A seat's history event: ("board", street, cards dealt) or ("act", seat, Action).
Event = tuple[Literal["board"], str, tuple[str, ...]] | tuple[Literal["act"], int, Action]


@dataclass
class Decision:
    """What a seat sees when it must act (rendered to text for language-model players)."""

    hand_no: int
    seat: int
    position: str
    hole: tuple[str, ...]
    board: tuple[str, ...]
    street: str
    pot: int  # everything in the middle, current-round bets included
    to_call: int
    stack: int  # behind, not counting this round's bet
    bet: int  # this seat's bet in the current round
    min_raise_to: int | None  # None when raising is not possible
    max_raise_to: int | None
    opponents: list[tuple[int, int, int, bool]]  # (seat, stack, bet, folded)
    # what happened since this seat's previous decision: ("act", seat, Action) and
    # ("board", street, cards) events
    history: list[Event]
    active: int  # seats still in the hand
    big_blind: int = 2

    @property
    def can_check(self) -> bool:
        return self.to_call == 0


@dataclass
class TurnLog:
    observation: str
    action: str
    chip_delta: int = 0
    invalid: bool = False
    logprob: float = 0.0  # behaviour log-prob of the action (rule-based players report theirs)
    played: str = ""  # the action actually played, canonical text


@dataclass
class HandResult:
    net: list[int]  # chips won (+) or lost (-) per seat
    logs: list[list[TurnLog]]
    summary: list[str]  # per seat: how the hand ended, from that seat's view
    invalid: list[int]
    board: tuple[str, ...] = ()
    shown: dict[int, tuple[str, ...]] = field(default_factory=dict)


class Player(Protocol):
    name: str

    def act(self, decision: Decision) -> str: ...


def card_str(c: Card) -> str:
    return f"{c.rank}{c.suit}"


def fresh_deck(seed: int) -> list[str]:
    deck = [r + s for r in RANKS for s in SUITS]
    random.Random(seed).shuffle(deck)
    return deck


# ----------------------------------------------------------------------------- actions

_VERBOSE = re.compile(
    r"\b(fold|check|call|all[\s-]?in|bet|raise)\b(?:\s*(?:to\s*)?\$?(\d+))?", re.I
)
_COMPACT = re.compile(r"^\s*(f|c|a|b(\d*))(?![a-z0-9])", re.I)


def parse_action(text: str) -> Action | None:
    """The action in ``text``, or None. Compact: ``f``, ``c``, ``a``, ``bN`` (raise to N) or a
    bare ``b`` (a pot-size raise) at the start, not followed by a letter or digit; verbose: the
    action word right after the last ``Action:`` (else at the very start of the text)."""
    text = re.sub(r"(?s)<think>.*?</think>", "", text)
    m = _COMPACT.match(text)
    if m:
        k = m.group(1)[0].lower()
        if k == "b":
            return Action("raise", int(m.group(2))) if m.group(2) else Action("pot")
        return Action({"f": "fold", "c": "call", "a": "allin"}[k])
    idx = text.lower().rfind("action:")
    tail = text[idx + 7 :] if idx >= 0 else text
    m = _VERBOSE.match(tail.lstrip(" \t\n*:\"'`["))
    if not m:
        return None
    word = m.group(1).lower()
    if word.startswith("all"):
        return Action("allin")
    if word in ("bet", "raise"):
        return Action("raise", int(m.group(2))) if m.group(2) else None
    return Action(word)


LETTER_FORMATS = ("compact", "strength")  # observation formats whose answers are letters


def format_action(a: Action, fmt: str = "text", facing_bet: bool = True) -> str:
    if fmt in LETTER_FORMATS:
        return {"fold": "f", "check": "c", "call": "c", "allin": "a", "pot": "b"}.get(
            a.kind, f"b{a.amount}"
        )
    if a.kind == "raise":
        return f"Action: {'Raise' if facing_bet else 'Bet'} {a.amount}"
    return (
        "Action: " + {"fold": "Fold", "check": "Check", "call": "Call", "allin": "All-in"}[a.kind]
    )


# ----------------------------------------------------------------------------- the table


def positions(n: int) -> list[str]:
    if n == 2:  # pokerkit heads-up: seat 0 posts the big blind, seat 1 is the button
        return ["big blind", "button (small blind)"]
    names = ["small blind", "big blind"] + [f"early {i}" for i in range(1, n - 2)] + ["button"]
    if n >= 4:
        names[-2] = "cutoff"
    return names


def _new_state(cfg: TableConfig, deck: list[str]) -> State:
    from pokerkit import Automation, Card, Mode, NoLimitTexasHoldem

    auto = (
        Automation.ANTE_POSTING,
        Automation.BET_COLLECTION,
        Automation.BLIND_OR_STRADDLE_POSTING,
        Automation.RUNOUT_COUNT_SELECTION,
        Automation.HOLE_CARDS_SHOWING_OR_MUCKING,
        Automation.HAND_KILLING,
        Automation.CHIPS_PUSHING,
        Automation.CHIPS_PULLING,
    )
    state = NoLimitTexasHoldem.create_state(
        auto,
        True,
        0,
        (cfg.small_blind, cfg.big_blind),
        cfg.big_blind,
        (cfg.stack,) * cfg.seats,
        cfg.seats,
        mode=Mode.CASH_GAME,
    )
    state.deck_cards.clear()  # our seeded deck: a deal is a function of its seed alone
    state.deck_cards.extend(Card.parse("".join(deck)))
    return state


def _deal(state: State) -> None:
    while True:
        if state.can_deal_hole():
            state.deal_hole()
        elif state.can_burn_card():
            state.burn_card()
        elif state.can_deal_board():
            state.deal_board()
        else:
            return


def _board(state: State) -> tuple[str, ...]:
    return tuple(card_str(c[0] if isinstance(c, list) else c) for c in state.board_cards)


def _decision(
    state: State,
    cfg: TableConfig,
    hand_no: int,
    seat: int,
    names: list[str],
    history: list[Event],
) -> Decision:
    can_raise = state.can_complete_bet_or_raise_to()
    # both set whenever a raise is possible
    lo = state.min_completion_betting_or_raising_to_amount if can_raise else None
    hi = state.max_completion_betting_or_raising_to_amount if can_raise else None
    return Decision(
        hand_no=hand_no,
        seat=seat,
        position=names[seat],
        hole=tuple(card_str(c) for c in state.hole_cards[seat]),
        board=_board(state),
        street=STREETS[min(state.street_index or 0, 3)],
        pot=int(state.total_pot_amount),
        to_call=int(state.checking_or_calling_amount or 0),
        stack=int(state.stacks[seat]),
        bet=int(state.bets[seat]),
        min_raise_to=None if lo is None else int(lo),
        max_raise_to=None if hi is None else int(hi),
        opponents=[
            (i, int(state.stacks[i]), int(state.bets[i]), not state.statuses[i])
            for i in range(cfg.seats)
            if i != seat
        ],
        history=list(history),
        active=sum(bool(s) for s in state.statuses),
        big_blind=cfg.big_blind,
    )


def legalise(a: Action | None, d: Decision) -> tuple[Action, bool]:
    """(the action to play, whether the text was invalid)."""
    free = d.to_call == 0
    if a is None:
        return Action("check" if free else "fold"), True
    if a.kind == "fold":
        return Action("check" if free else "fold"), False
    if a.kind == "check":
        return (Action("check"), False) if free else (Action("fold"), True)
    if a.kind == "call":
        return Action("check" if free else "call"), False
    if d.min_raise_to is None:  # raising impossible (e.g. the bet covers our stack)
        if a.kind == "allin":
            return Action("check" if free else "call"), False
        return Action("check" if free else "fold"), True
    assert d.max_raise_to is not None
    if a.kind == "allin":
        return Action("raise", d.max_raise_to), False
    if a.kind == "pot":  # call, then raise by the pot that call leaves: the classic pot raise
        a = Action("raise", d.bet + d.to_call + d.pot + d.to_call)
    return Action("raise", min(max(a.amount, d.min_raise_to), d.max_raise_to)), False


def play_hand(
    players: Sequence[Player | None],
    deal_seed: int,
    cfg: TableConfig,
    hand_no: int = 1,
    render: Callable[[Decision], str] | None = None,
) -> Generator[Decision, str, HandResult]:
    """Play one hand. ``players[i] is None``: seat i is external (yield/send). ``render``
    turns a Decision into the observation text logged for the seat (default: repr)."""
    if len(players) != cfg.seats:
        raise ValueError(f"{len(players)} players for {cfg.seats} seats")
    render = render or repr
    names = positions(cfg.seats)
    state = _new_state(cfg, fresh_deck(deal_seed))
    logs: list[list[TurnLog]] = [[] for _ in range(cfg.seats)]
    invalid = [0] * cfg.seats
    history: list[list[Event]] = [[] for _ in range(cfg.seats)]
    mark = [cfg.stack] * cfg.seats  # each seat's stack at its previous decision
    street: int | None = -1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # pokerkit warns on e.g. folds that could be checks
        _deal(state)
        while state.status and state.actor_index is not None:
            seat = state.actor_index
            if state.street_index != street:
                street = state.street_index
                board = _board(state)
                if board:
                    for h in history:
                        h.append(("board", STREETS[min(street or 0, 3)], board))
            d = _decision(state, cfg, hand_no, seat, names, history[seat])
            history[seat] = []
            player = players[seat]
            text = (yield d) if player is None else player.act(d)
            text = str(text or "")
            action, bad = legalise(parse_action(text), d)
            invalid[seat] += bad
            now = int(state.stacks[seat])
            if logs[seat]:  # the previous turn's delta runs up to this decision
                logs[seat][-1].chip_delta += now - mark[seat]
            first = now - cfg.stack if not logs[seat] else 0  # blinds go to the first turn
            mark[seat] = now
            logs[seat].append(
                TurnLog(
                    render(d),
                    text,
                    first,
                    bad,
                    float(getattr(player, "last_logprob", 0.0) or 0.0),
                    format_action(action, "text", d.to_call > 0),
                )
            )
            if action.kind == "fold":
                state.fold()
            elif action.kind in ("check", "call"):
                state.check_or_call()
            else:
                state.complete_bet_or_raise_to(action.amount)
            for i in range(cfg.seats):
                if i != seat:
                    history[i].append(("act", seat, action))
            _deal(state)
    final = [int(s) for s in state.stacks]
    net = [f - cfg.stack for f in final]
    for i in range(cfg.seats):
        if logs[i]:
            # the chip delta of the last turn runs to the end of the hand (payout included)
            logs[i][-1].chip_delta += final[i] - mark[i]
    board = _board(state)
    from pokerkit import HoleCardsShowingOrMucking

    shown = {
        op.player_index: tuple(card_str(c) for c in op.hole_cards)
        for op in state.operations
        if isinstance(op, HoleCardsShowingOrMucking) and op.hole_cards
    }
    summary = []
    for i in range(cfg.seats):
        others = ", ".join(f"seat {j} showed {' '.join(h)}" for j, h in shown.items() if j != i)
        tail = f" ({others})" if others and len(shown) > 1 else ""
        verb = "win" if net[i] > 0 else "lose" if net[i] < 0 else "break even"
        amount = f" {abs(net[i])} chips" if net[i] else ""
        summary.append(
            f"Hand {hand_no} over. Board: [{', '.join(board)}]. You {verb}{amount}{tail}."
        )
    return HandResult(
        net=net, logs=logs, summary=summary, invalid=invalid, board=board, shown=shown
    )
