"""Appendix D, log side: raw episode logs -> chat messages -> token ids -> masks -> records.

A raw episode log (JSON-serialisable, one per line in a ``.jsonl``)::

    {"system": "...rules...", "seat": 0, "player": "tag",
     "hands": [{"turns": [{"observation": "...", "action": "Action: Call",
                           "chip_delta": -4, "invalid": false, "logprob": 0.0}, ...],
                "result": "Hand 1 over. ...", "net": 6, "invalid": 0}, ...]}

``log_messages`` flattens it (system rules, then per turn a user observation and an assistant
action, and optionally each hand's result as a user message); ``sample_from_log`` renders that
with the chat template and derives turn indices and the assistant mask (``echo_rl.data.multiturn``);
the episode return is the net chips (in big blinds by default) minus the invalid-action
penalty. ``simulate_logs`` produces such logs from rule-based players, and
``records_from_logs`` turns them into records for ``materialise``: the rule-based player's
actions become the trained tokens, with its own action probability as behaviour log-prob
(0 for the deterministic players), which is how the truncated importance weight treats
off-policy data.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

from echo_rl.adapters.poker.game import TableConfig, TurnLog, play_hand
from echo_rl.adapters.poker.players import make_player
from echo_rl.adapters.poker.render import render, result_text, system_prompt
from echo_rl.data.episodes import EpisodeRecord, EpisodeSample
from echo_rl.data.multiturn import ChatFormat, assistant_mask, render_ids, turn_indices

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class TurnEntry(TypedDict):
    """One decision of a seat in a raw log (``TurnLog`` without what was played)."""

    observation: str
    action: str
    chip_delta: int
    invalid: bool
    logprob: float


class HandEntry(TypedDict):
    """One hand of a raw log: the seat's turns, the result message, its net chips."""

    turns: list[TurnEntry]
    result: str
    net: int
    invalid: int  # invalid actions in the hand


class EpisodeLog(TypedDict):
    """A raw episode log: one seat's hands, one per line of a ``.jsonl`` (module docstring)."""

    system: str
    seat: int
    player: str
    hands: list[HandEntry]


def hand_entry(turns: Sequence[TurnLog], result: str, net: int, invalid: int) -> HandEntry:
    return {
        "turns": [
            {
                "observation": t.observation,
                "action": t.action,
                "chip_delta": t.chip_delta,
                "invalid": t.invalid,
                "logprob": t.logprob,
            }
            for t in turns
        ],
        "result": result,
        "net": int(net),
        "invalid": int(invalid),
    }


def log_messages(log: EpisodeLog, show_results: bool = True) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": log["system"]}]
    for hand in log["hands"]:
        for t in hand["turns"]:
            messages.append({"role": "user", "content": t["observation"]})
            messages.append({"role": "assistant", "content": t["action"]})
        if show_results:
            messages.append({"role": "user", "content": hand["result"]})
    return messages


def episode_return(log: EpisodeLog, unit: float = 2.0, invalid_penalty: float = 1.0) -> float:
    """Net chips of the episode (the sum of its chip deltas), in units of ``unit`` chips,
    minus ``invalid_penalty`` per invalid action."""
    chips = sum(h["net"] for h in log["hands"])  # = the sum of the turns' chip deltas
    invalid = sum(h["invalid"] for h in log["hands"])
    return float(chips / unit - invalid_penalty * invalid)


def sample_from_log(
    tokenizer: PreTrainedTokenizerBase,
    log: EpisodeLog,
    *,
    fmt: ChatFormat | None = None,
    show_results: bool = True,
    unit: float = 2.0,
    invalid_penalty: float = 1.0,
) -> tuple[list[int], EpisodeSample]:
    """(prompt ids, sample) from a raw log: the prompt is the system turn, the completion the
    rest; the mask marks assistant tokens; each action's behaviour log-prob sits on its first
    token (a rule-based player picks the whole action at once)."""
    fmt = fmt or ChatFormat.learn(tokenizer)
    messages = log_messages(log, show_results)
    ids = render_ids(tokenizer, messages)
    roles = [m["role"] for m in messages]
    mask = assistant_mask(ids, roles, fmt)
    prompt = render_ids(tokenizer, messages[:1])
    if ids[: len(prompt)] != prompt:
        raise ValueError("the chat template does not render the system turn as a prefix")
    turns = turn_indices(ids, fmt.turn_start)
    action_lps = [t["logprob"] for h in log["hands"] for t in h["turns"]]
    lps = [0.0] * len(ids)
    assistant_turn = [c for c, r in enumerate(roles, 1) if r == "assistant"]
    for c, lp in zip(assistant_turn, action_lps):
        first = next(j for j in range(len(ids)) if turns[j] == c and mask[j])
        lps[first] = float(lp)
    n = len(prompt)
    sample = EpisodeSample(
        ids[n:],
        lps[n:],
        mask[n:],
        episode_return(log, unit, invalid_penalty),
        info={"log": log, "turn_index": turns[n:]},
    )
    return prompt, sample


def simulate_logs(
    players: Sequence[str],
    episodes: int,
    seed: int = 0,
    cfg: TableConfig | None = None,
    fmt: str = "text",
    hands: int = 1,
    seats: Iterable[int] | None = None,
    samples: int = 48,
) -> list[EpisodeLog]:
    """Rule-based players against each other; one raw log per logged seat and episode."""
    cfg = cfg or TableConfig(seats=len(players))
    logged = list(range(cfg.seats)) if seats is None else list(seats)
    out: list[EpisodeLog] = []
    for e in range(episodes):
        bots = [
            make_player(p, seed * 7919 + e * 31 + i, fmt, samples) for i, p in enumerate(players)
        ]
        per_seat: list[list[HandEntry]] = [[] for _ in range(cfg.seats)]
        for h in range(hands):
            order = [(i + h) % cfg.seats for i in range(cfg.seats)]  # button moves every hand
            game = play_hand(
                [bots[j] for j in order],
                (seed * 1_000_003 + e) * 16 + h,
                cfg,
                h + 1,
                render=lambda d: render(d, fmt, samples if fmt == "strength" else 0),
            )
            try:
                next(game)
                raise RuntimeError("rule-based players never yield")
            except StopIteration as stop:
                res = stop.value
            for pos, j in enumerate(order):
                per_seat[j].append(
                    hand_entry(
                        res.logs[pos], result_text(res, pos, fmt), res.net[pos], res.invalid[pos]
                    )
                )
        for j in logged:
            out.append(
                {
                    "system": system_prompt(cfg, fmt, hands),
                    "seat": j,
                    "player": players[j],
                    "hands": per_seat[j],
                }
            )
    return out


def records_from_logs(
    tokenizer: PreTrainedTokenizerBase,
    logs: Sequence[EpisodeLog],
    group_size: int,
    *,
    version: int = 0,
    show_results: bool = True,
    unit: float = 2.0,
    invalid_penalty: float = 1.0,
    prefix: str = "offline",
) -> list[list[EpisodeRecord]]:
    """Off-policy ingestion: consecutive logs form groups of ``group_size`` (a short tail is
    dropped); each becomes an ``EpisodeRecord`` with its loss mask."""
    fmt = ChatFormat.learn(tokenizer)
    groups = []
    for g in range(len(logs) // group_size):
        recs = []
        for i, log in enumerate(logs[g * group_size : (g + 1) * group_size]):
            prompt, s = sample_from_log(
                tokenizer,
                log,
                fmt=fmt,
                show_results=show_results,
                unit=unit,
                invalid_penalty=invalid_penalty,
            )
            recs.append(
                EpisodeRecord(
                    f"{prefix}-{g}",
                    i,
                    prompt,
                    s.completion_ids,
                    s.logprobs,
                    s.reward,
                    version,
                    "offline",
                    0.0,
                    loss_mask=s.loss_mask,
                )
            )
        groups.append(recs)
    return groups


def write_logs(path: str | Path, logs: Iterable[EpisodeLog]) -> None:
    with Path(path).open("w") as f:
        for log in logs:
            f.write(json.dumps(log) + "\n")


def read_logs(path: str | Path) -> list[EpisodeLog]:
    """The logs ``write_logs`` wrote, as they were written (not checked again)."""
    return [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()]
