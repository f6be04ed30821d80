"""The ``poker`` adapter: no-limit hold'em episodes against rule-based (and LLM) opponents.

Options (``[adapter] options = {...}``), all optional:
  seats = 2               2..6 players at the table (the policy is one of them)
  stack = 200             chips per player at the start of every hand (100 big blinds)
  blinds = [1, 2]
  hands = 1               hands per episode (stacks reset each hand; the button moves)
  opponents = ["tag", "station", "maniac"]   drawn per group and seat; "llm" = a frozen model
  opponent_model = ""     Hugging Face folder for the "llm" opponent (loaded on the worker)
  group_by = "deal"       "deal": a group's episodes share the cards (GRPO on one initial
                          state); "random": each episode its own deal; "batch": own deals and
                          advantages normalised across the whole learner batch
  obs_format = "text"     "text" for real models; "compact" for the tiny-qwen3 vocabulary;
                          "strength": only street, strength digit and whether a bet is faced
                          (three characters; what a tiny model can learn from, see
                          docs/adapters.md, "Poker that learns")
  strength_hint = false   end each observation with the hand's strength (0-9 digit in compact,
                          "Hand strength: 0.63" in text; echo_rl/adapters/poker/render.py)
  show_results = true     put each hand's result in the transcript as a user message
  reward_unit = "bb"      episode return in big blinds ("chips": raw chips)
  invalid_penalty = 1.0   subtracted from the return (in reward units) per invalid action
  allin = true            false: the policy's "all-in" answer is an invalid action (raises,
                          pot-size "b" included, stay legal)
  answer_letters = ""     e.g. "fcb": the policy generates only these action letters (letter
                          formats, worker.max_new_tokens = 1): sampled from its softmax over
                          them, with log-probs computed the same way on the learner
                          (echo_rl/data/answers.py); "" lets it write any token
  reward_clip = 0         > 0: the return is clipped to [-reward_clip, reward_clip] (reward
                          units) before the penalty: one all-in swing no longer sets the group's
                          standard deviation and flattens every other sample's advantage
  hero_seat = -1          the policy's seat; -1: drawn per group
  max_decisions = 24      per episode; later decisions are played check/fold, untrained
  max_episode_tokens = 4096   bound on the transcript after the prompt (the record's completion)
  offpolicy_player = ""   "tag" / "station" / "maniac": this rule-based player takes the
  offpolicy_fraction = 0  policy's seat in that fraction of episodes; its actions are trained
                          on as off-policy data (behaviour log-prob = its own action probability)
  bot_samples = 48        Monte Carlo run-outs per rule-based post-flop decision
  system = ""             replaces the rules text of the system message
  turn_start_token = ""   override the chat template's turn-start token

Prompt: the system turn (rules) as token ids; the task names the deal, the opponents and the
seat. Each episode's record: completion = everything after the system turn (observations,
actions, results), ``loss_mask`` = 1 on the policy's action tokens, reward = episode return.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from echo_rl.adapters.poker.game import (
    LETTER_FORMATS,
    Action,
    Decision,
    TableConfig,
    legalise,
    parse_action,
    play_hand,
)
from echo_rl.adapters.poker.pipeline import hand_entry
from echo_rl.adapters.poker.players import RULE_PLAYERS, LLMSeat, Opponent, Policy, make_player
from echo_rl.adapters.poker.render import FORMATS, action_text, render, result_text, system_prompt
from echo_rl.data.adapter import AdapterError, Prompt
from echo_rl.data.episodes import Episode, EpisodeAdapter, EpisodeSample, GenerateFn
from echo_rl.data.multiturn import ChatBuilder, ChatFormat, Transcript

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from echo_rl.core import wire

_DEFAULTS: dict[str, Any] = {
    "seats": 2,
    "stack": 200,
    "blinds": [1, 2],
    "hands": 1,
    "opponents": ["tag", "station", "maniac"],
    "opponent_model": "",
    "group_by": "deal",
    "obs_format": "text",
    "strength_hint": False,
    "show_results": True,
    "reward_unit": "bb",
    "invalid_penalty": 1.0,
    "reward_clip": 0.0,
    "allin": True,
    "answer_letters": "",
    "hero_seat": -1,
    "max_decisions": 24,
    "max_episode_tokens": 4096,
    "offpolicy_player": "",
    "offpolicy_fraction": 0.0,
    "bot_samples": 48,
    "system": "",
    "turn_start_token": "",
}
HELDOUT_SALT = 0x48454C44  # "HELD": the held-out split's deals come from their own stream
RESULT_RESERVE = 160  # tokens kept free for the last hand's result message


def _mix(*xs: int) -> int:
    h = 0x9E3779B97F4A7C15
    for x in xs:
        h = (h ^ (x & 0xFFFFFFFFFFFFFFFF)) * 0x100000001B3 & 0xFFFFFFFFFFFFFFFF
    return h >> 2


class PokerAdapter(EpisodeAdapter):
    name = "poker"

    def __init__(self, options: dict[str, Any], tokenizer: PreTrainedTokenizerBase):
        super().__init__(options, tokenizer)
        from echo_rl.core.extras import MissingExtra, require

        try:
            require("pokerkit", "the poker adapter")  # Python >= 3.11
        except MissingExtra as err:
            raise AdapterError(str(err)) from None
        unknown = set(self.options) - set(_DEFAULTS)
        if unknown:
            raise AdapterError(
                f"poker: unknown option(s) {sorted(unknown)}; it takes {sorted(_DEFAULTS)}"
            )
        o = {**_DEFAULTS, **self.options}
        try:
            sb, bb = (int(x) for x in o["blinds"])
            self.table = TableConfig(int(o["seats"]), int(o["stack"]), sb, bb)
        except (TypeError, ValueError) as exc:
            raise AdapterError(f"poker: table options: {exc}") from None
        self.hands = int(o["hands"])
        self.fmt = str(o["obs_format"])
        self.group_by = str(o["group_by"])
        self.opponents = list(o["opponents"])
        self.show_results = bool(o["show_results"])
        self.unit = float(self.table.big_blind if o["reward_unit"] == "bb" else 1)
        self.invalid_penalty = float(o["invalid_penalty"])
        self.reward_clip = float(o["reward_clip"])
        self.allow_allin = bool(o["allin"])
        self.hero_seat = int(o["hero_seat"])
        self.max_decisions = int(o["max_decisions"])
        self.max_completion_tokens = int(o["max_episode_tokens"])
        self.offpolicy_player = str(o["offpolicy_player"])
        self.offpolicy_fraction = float(o["offpolicy_fraction"])
        self.bot_samples = int(o["bot_samples"])
        # the hint uses the bots' Monte Carlo estimate (and cache): bot_samples run-outs
        self.hint = self.bot_samples if bool(o["strength_hint"]) or self.fmt == "strength" else 0
        self.opponent_model = str(o["opponent_model"])
        checks = [
            (self.fmt in FORMATS, f"obs_format={self.fmt!r}: use one of {FORMATS}"),
            (
                self.group_by in ("deal", "random", "batch"),
                f"group_by={self.group_by!r}: use deal, random or batch",
            ),
            (o["reward_unit"] in ("bb", "chips"), "reward_unit: use bb or chips"),
            (self.hands >= 1, "hands must be >= 1"),
            (
                bool(self.opponents)
                and all(p in RULE_PLAYERS or p == "llm" for p in self.opponents),
                f"opponents={self.opponents}: use {sorted(RULE_PLAYERS)} and/or llm",
            ),
            (
                "llm" not in self.opponents or bool(self.opponent_model),
                "the llm opponent needs opponent_model (a local model folder), or call "
                "set_llm_opponent(policy) in code",
            ),
            (-1 <= self.hero_seat < self.table.seats, f"hero_seat={self.hero_seat}: -1 or a seat"),
            (
                self.offpolicy_player in ("", *RULE_PLAYERS),
                f"offpolicy_player={self.offpolicy_player!r}: empty or one of {sorted(RULE_PLAYERS)}",
            ),
            (0.0 <= self.offpolicy_fraction <= 1.0, "offpolicy_fraction must be in [0, 1]"),
            (self.reward_clip >= 0, "reward_clip must be >= 0 (0: off)"),
            (
                self.hint == 0 or self.bot_samples >= 1,
                "strength_hint needs bot_samples >= 1 (the run-outs behind the estimate)",
            ),
            (
                self.max_decisions >= 1 and self.max_completion_tokens > RESULT_RESERVE,
                "max_decisions >= 1 and max_episode_tokens > 160",
            ),
        ]
        for ok, msg in checks:
            if not ok:
                raise AdapterError(f"poker: {msg}")
        self.answer_tokens = self._answer_tokens(str(o["answer_letters"]), tokenizer)
        self.system = str(o["system"]) or system_prompt(self.table, self.fmt, self.hands)
        self.chat = ChatFormat.learn(tokenizer, str(o["turn_start_token"]) or None)
        self.builder = ChatBuilder(tokenizer, self.system, self.chat)
        self._llm_policy: Policy | None = None
        self._max_new = 64
        self.stats = {"episodes": 0, "decisions": 0, "invalid_actions": 0, "forced": 0}

    def _answer_tokens(
        self, letters: str, tokenizer: PreTrainedTokenizerBase
    ) -> tuple[int, ...] | None:
        """The token ids of ``answer_letters`` (None when empty): one token per letter."""
        if not letters:
            return None
        if self.fmt not in LETTER_FORMATS:
            raise AdapterError(
                f"poker: answer_letters needs a letter obs_format {LETTER_FORMATS}, "
                f"not {self.fmt!r} (its answers are words)"
            )
        if set(letters) - set("fcab") or len(set(letters)) != len(letters):
            raise AdapterError(
                f"poker: answer_letters={letters!r}: distinct letters among f, c, "
                f"b, a (fold, check/call, pot raise, all-in)"
            )
        if "a" in letters and not self.allow_allin:
            raise AdapterError(
                "poker: answer_letters has 'a' but allin = false makes it an "
                "invalid answer: drop 'a', or set allin = true"
            )
        ids = [tokenizer.encode(c, add_special_tokens=False) for c in letters]
        split = [c for c, i in zip(letters, ids) if len(i) != 1]
        if split:
            raise AdapterError(
                f"poker: answer_letters {split} are not single tokens of this "
                f"tokenizer: leave answer_letters empty for this model"
            )
        return tuple(i[0] for i in ids)

    # ----------------------------------------------------------------- learner side

    def prompts(self, rng: random.Random) -> Iterator[Prompt]:
        prompt = self.builder.start()
        while True:
            hero = self.hero_seat if self.hero_seat >= 0 else rng.randrange(self.table.seats)
            task = {
                "deal_seed": rng.randrange(1 << 31),
                "hero_seat": hero,
                "opponents": [rng.choice(self.opponents) for _ in range(self.table.seats - 1)],
            }
            yield Prompt(prompt_ids=list(prompt), task=task)

    def heldout_prompts(self, rng: random.Random) -> Iterator[Prompt] | None:
        """Endless deals from an RNG of their own (seeded from ``rng`` and a constant that
        training's stream never mixes in), opponents and seats drawn as in training. A deal is
        one of 2^31: the chance that a held-out deal was also trained on is the run's deals /
        2^31 (under 1e-4 for 200,000 deals), so held-out here means unseen cards."""
        return self.prompts(random.Random(_mix(rng.randrange(1 << 62), HELDOUT_SALT)))

    # ----------------------------------------------------------------- worker side

    def set_llm_opponent(self, policy: Policy) -> None:
        """The frozen-model opponent: ``policy(messages) -> action text``."""
        self._llm_policy = policy

    def _llm(self) -> LLMSeat:
        if self._llm_policy is None:
            from echo_rl.adapters.poker.eval import HFChatPolicy

            self._llm_policy = HFChatPolicy(self.opponent_model)
        return LLMSeat(self._llm_policy, self.system, self.observe)

    def observe(self, d: Decision) -> str:
        return render(d, self.fmt, self.hint)

    def rollout(
        self, groups: Sequence[wire.Group], generate: GenerateFn
    ) -> list[list[EpisodeSample]]:
        self._max_new = int(getattr(generate, "max_new_tokens", 64))
        return super().rollout(groups, generate)

    def episode(self, task: dict[str, Any], seed: int, sample_idx: int) -> Episode:
        rng = random.Random(_mix(seed, sample_idx, 17))
        deal = (
            task["deal_seed"] if self.group_by == "deal" else _mix(seed, sample_idx, 29)
        ) & 0x7FFFFFFF
        hero_seat = int(task["hero_seat"])
        names = list(task["opponents"])
        llm = self._llm() if "llm" in names else None
        opponents = [
            make_player(n, rng.randrange(1 << 30), self.fmt, self.bot_samples, llm) for n in names
        ]
        stand_in: Opponent | None = None
        if self.offpolicy_player and rng.random() < self.offpolicy_fraction:
            stand_in = make_player(
                self.offpolicy_player, rng.randrange(1 << 30), self.fmt, self.bot_samples
            )
        for p in opponents:
            p.new_episode()
        prompt = self.builder.start()
        tr = Transcript()
        hands, decisions, invalid, forced = [], 0, 0, 0
        net = 0
        for h in range(self.hands):
            seat = (hero_seat + h) % self.table.seats  # the button moves every hand
            seating: list[Opponent | None] = list(opponents)
            seating.insert(seat, None)
            game = play_hand(
                seating, (deal * 64 + h) & 0x7FFFFFFF, self.table, h + 1, render=self.observe
            )
            reply: str | None = None
            while True:
                try:
                    d = game.send(reply) if reply is not None else next(game)
                except StopIteration as stop:
                    result = stop.value
                    break
                obs = self.builder.user(self.observe(d))
                tr.add_context(obs)
                decisions += 1
                room = self.max_completion_tokens - RESULT_RESERVE - len(tr)
                if decisions > self.max_decisions or room < self._max_new + 1:
                    # out of budget: play check/fold, keep it in the transcript, do not train it
                    self.stats["forced"] += 1
                    forced += 1
                    text = action_text(legalise(Action("fold"), d)[0], self.fmt, d.to_call > 0)
                    ids = self.builder.action_text(text)
                    tr.add_action(ids, [0.0] * len(ids), trained=False)
                    tr.add_context(self.builder.close(ids))
                elif stand_in is not None:
                    text = stand_in.act(d)
                    ids = self.builder.action_text(text)
                    tr.add_action(ids, [stand_in.last_logprob] + [0.0] * (len(ids) - 1))
                    tr.add_context(self.builder.close(ids))
                else:
                    ids, lps = yield prompt + tr.ids
                    tr.add_action(ids, lps)
                    tr.add_context(self.builder.close(ids))
                    text = str(self.tokenizer.decode(ids, skip_special_tokens=True))
                    if not self.allow_allin and getattr(parse_action(text), "kind", "") == "allin":
                        text = ""  # refused: played as an invalid action
                reply = text
            invalid += result.invalid[seat]
            net += result.net[seat]
            res = result_text(result, seat, self.fmt)
            hands.append(hand_entry(result.logs[seat], res, result.net[seat], result.invalid[seat]))
            if self.show_results or (h == self.hands - 1 and len(tr) == 0):
                # a hand the opponents ended before the policy acted still leaves the result:
                # an empty completion is refused by admission (bad_length) and its worker struck
                tr.add_context(self.builder.note(res))
        if len(tr) > self.max_completion_tokens:  # a long result message: cut the tail context
            del tr.ids[self.max_completion_tokens :], tr.mask[self.max_completion_tokens :]
            del tr.logprobs[self.max_completion_tokens :]
        ret = net / self.unit
        if self.reward_clip > 0:
            ret = min(max(ret, -self.reward_clip), self.reward_clip)
        reward = ret - self.invalid_penalty * invalid
        self.stats["episodes"] += 1
        self.stats["decisions"] += decisions
        self.stats["invalid_actions"] += invalid
        log = {
            "system": self.system,
            "seat": hero_seat,
            "player": self.offpolicy_player if stand_in is not None else "policy",
            "hands": hands,
        }
        return EpisodeSample(
            tr.ids,
            tr.logprobs,
            tr.mask,
            reward,
            info={
                "log": log,
                "net_chips": net,
                "invalid": invalid,
                "decisions": decisions,
                "offpolicy": stand_in is not None,
            },
            cut=forced > 0,  # out of budget: ended by forced folds (completions_cut)
        )
