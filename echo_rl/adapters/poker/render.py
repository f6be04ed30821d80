"""Observation and system-prompt text for language-model players, in two formats.

``text`` (default, for real models; Appendix D style)::

    Hand 1, preflop. You are seat 1 (button (small blind)).
    Hand: [Ah, Kd], Board: [], Pot: 3
    Your stack: 199, your bet this round: 1, to call: 1.
    Seat 0 (big blind): stack 198, bet 2.
    Since your last turn: -
    Legal: fold, call 1, raise to 4..200 (all-in 200).

``compact`` (the tiny-qwen3 vocabulary: digits, ``+-*=`` and ``a-f``)::

    c+b6*14d13a*020304*12*4*194        history*hole*board*pot*to_call*stack

where a card is its rank as two digits (02..14, ace 14) and its suit as a letter (clubs a,
diamonds b, hearts c, spades d), history lists the opponents' actions since the seat's last
turn (``f`` fold, ``c`` check/call, ``bN`` raise to N, ``a`` all-in) joined by ``+``, and the
answer is ``f``, ``c``, ``bN``, ``b`` (a pot-size raise) or ``a``. Hand results are ``=+12`` /
``=-4``.

With the adapter's ``strength_hint`` the compact line ends in ``*S``, a digit 0-9
(``floor(10 x strength)``, capped at 9) and the text gets a last line ``Hand strength: 0.63``.
Strength is what the rule-based players judge their hand by: Chen score / 20 before the flop,
Monte Carlo equity against the live opponents after. A small model cannot learn card
combinatorics from a few thousand hands; with the hint it only has to learn what to do with
a strong or a weak hand (docs/adapters.md, "Poker that learns").
"""

from __future__ import annotations

from echo_rl.adapters.poker.game import (
    LETTER_FORMATS,
    Action,
    Decision,
    Event,
    HandResult,
    TableConfig,
    format_action,
    positions,
)

FORMATS = ("text", *LETTER_FORMATS)


def system_prompt(cfg: TableConfig, fmt: str, hands: int = 1) -> str:
    if fmt in LETTER_FORMATS:
        return "fcab"
    n = "heads-up" if cfg.seats == 2 else f"{cfg.seats}-handed"
    return (
        f"You are playing no-limit Texas hold'em, {n}, blinds {cfg.small_blind}/{cfg.big_blind}, "
        f"every player starts each hand with {cfg.stack} chips; the episode is {hands} hand(s). "
        "Each turn you see your cards, the board, the pot and what happened since your last turn. "
        "Reply with exactly one action: 'Action: Fold', 'Action: Check', 'Action: Call', "
        "'Action: Bet N' or 'Action: Raise N' (N = your total bet for this betting round), or "
        "'Action: All-in'. Anything else, or an illegal action, folds your hand and costs a "
        "penalty. Your goal is to win chips."
    )


def _card(c: str) -> str:
    rank = "23456789TJQKA".index(c[0]) + 2
    return f"{rank:02d}" + "abcd"["cdhs".index(c[1])]


def _event_text(ev: Event, names: list[str]) -> str:
    if ev[0] == "board":
        return f"{ev[1]} dealt: {' '.join(ev[2])}"
    seat, a = ev[1], ev[2]
    what = {
        "fold": "folds",
        "check": "checks",
        "call": "calls",
        "raise": f"raises to {a.amount}",
        "allin": "goes all-in",
    }[a.kind]
    return f"seat {seat} ({names[seat]}) {what}"


def render_text(d: Decision) -> str:
    names = positions(len(d.opponents) + 1)
    lines = [
        f"Hand {d.hand_no}, {d.street}. You are seat {d.seat} ({d.position}).",
        f"Hand: [{', '.join(d.hole)}], Board: [{', '.join(d.board)}], Pot: {d.pot}",
        f"Your stack: {d.stack}, your bet this round: {d.bet}, to call: {d.to_call}.",
    ]
    for seat, stack, bet, folded in d.opponents:
        lines.append(
            f"Seat {seat} ({names[seat]}): "
            + ("folded." if folded else f"stack {stack}, bet {bet}.")
        )
    events = [_event_text(e, names) for e in d.history]
    lines.append("Since your last turn: " + ("; ".join(events) if events else "-"))
    legal = ["check"] if d.can_check else ["fold", f"call {d.to_call}"]
    if d.min_raise_to is not None:
        verb = "raise to" if d.to_call else "bet"
        legal.append(f"{verb} {d.min_raise_to}..{d.max_raise_to} (all-in {d.max_raise_to})")
    lines.append("Legal: " + ", ".join(legal) + ".")
    return "\n".join(lines)


def render_compact(d: Decision) -> str:
    hist = "+".join(format_action(e[2], "compact") for e in d.history if e[0] == "act")
    hole = "".join(_card(c) for c in d.hole)
    board = "".join(_card(c) for c in d.board)
    return f"{hist}*{hole}*{board}*{d.pot}*{d.to_call}*{d.stack}"


def render(d: Decision, fmt: str, hint_samples: int = 0) -> str:
    """The observation; ``hint_samples > 0`` adds the hand-strength hint (Monte Carlo run-outs
    for the post-flop equity; the rule-based players' estimate, from the same cache).
    ``strength`` is the hint alone: ``d`` preflop / ``e`` after the flop, the digit, ``+``
    facing a bet / ``=`` free to check; no cards, no pot, no history."""
    if fmt == "strength" and hint_samples <= 0:
        raise ValueError("obs_format 'strength' needs hint_samples > 0 (the run-outs behind it)")
    if hint_samples <= 0:
        return render_compact(d) if fmt == "compact" else render_text(d)
    from echo_rl.adapters.poker.players import strength

    s = strength(d, hint_samples)
    digit = min(int(10 * s), 9)
    if fmt == "strength":
        return ("d" if d.street == "preflop" else "e") + str(digit) + ("+" if d.to_call else "=")
    if fmt == "compact":
        return f"{render_compact(d)}*{digit}"
    return f"{render_text(d)}\nHand strength: {s:.2f}"


def result_text(result: HandResult, seat: int, fmt: str) -> str:
    if fmt in LETTER_FORMATS:
        return f"={result.net[seat]:+d}" if result.net[seat] else "=0"
    return result.summary[seat]


def action_text(a: Action, fmt: str, facing_bet: bool = True) -> str:
    return format_action(a, fmt, facing_bet)
