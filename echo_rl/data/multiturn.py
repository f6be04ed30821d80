"""Multi-turn transcripts: chat messages -> token ids -> turn indices -> assistant loss masks.

Two ways to a trainable multi-turn sample, which agree token for token (tested):

* **From a log** (Appendix D; off-policy data, rule-based players, replayed games): render the
  whole conversation with the chat template, find each token's chat turn by counting
  turn-start tokens (``<|im_start|>`` in Qwen's template), and mark the tokens of assistant
  turns, after their role header, up to and including the end-of-turn token:
  ``log_to_sample``.
* **Live** (on-policy, one generation per decision): ``Transcript`` appends the template's
  pieces for each new user message and the generated action ids *as generated* (never
  re-tokenised, so the behaviour log-probs stay attached to the right ids).

Masks here are per token of the sequence ("this token was produced by the assistant");
``target_mask`` shifts one to the left to align with next-token targets (position ``j``
predicts token ``j + 1``), which is the convention of ``LearnerBatch.loss_mask``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from echo_rl.data.adapter import AdapterError

if TYPE_CHECKING:  # annotations only: importing the API does not import transformers
    from transformers import PreTrainedTokenizerBase


def render_ids(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[dict[str, str]],
    add_generation_prompt: bool = False,
) -> list[int]:
    """Token ids of ``messages`` through the tokenizer's chat template."""
    # a list of ids, or by transformers version a mapping holding them (BatchEncoding)
    out: Any = tokenizer.apply_chat_template(
        list(messages),
        add_generation_prompt=add_generation_prompt,
        tokenize=True,
        return_dict=False,
    )
    if isinstance(out, dict) or hasattr(out, "input_ids"):
        out = out["input_ids"]
    return [int(t) for t in out]


def _find(hay: list[int], needle: list[int], start: int = 0) -> int:
    for i in range(start, len(hay) - len(needle) + 1):
        if hay[i : i + len(needle)] == needle:
            return i
    return -1


@dataclass(frozen=True)
class ChatFormat:
    """What a chat template puts around messages, learnt by rendering probe conversations."""

    # the generation prompt (e.g. `<|im_start|>assistant\n`), which opens an assistant turn;
    # its first token is the turn-start token
    header: tuple[int, ...]
    # the token that opens every turn (Appendix D's turn-start token)
    turn_start: int
    # the tokens the template puts after an assistant message's content (e.g. `<|im_end|>\n`);
    # the first is the end-of-turn token the model generates
    turn_end: tuple[int, ...]

    @classmethod
    def learn(
        cls, tokenizer: PreTrainedTokenizerBase, turn_start_token: str | None = None
    ) -> ChatFormat:
        """Learn the format from ``tokenizer``'s chat template by rendering probe
        conversations; ``turn_start_token`` overrides the guessed turn-start token. Raises
        ``AdapterError`` when the tokenizer has no chat template or one it cannot read."""
        if not getattr(tokenizer, "chat_template", None):
            raise AdapterError("the tokenizer has no chat template; multi-turn adapters need one")
        u = [{"role": "user", "content": "1"}]
        base, gen = render_ids(tokenizer, u), render_ids(tokenizer, u, True)
        if gen[: len(base)] != base or len(gen) == len(base):
            raise AdapterError(
                "the chat template's generation prompt does not extend the "
                "conversation; cannot find the assistant header"
            )
        header = gen[len(base) :]
        content = list(tokenizer.encode("7", add_special_tokens=False))
        full = render_ids(tokenizer, u + [{"role": "assistant", "content": "7"}])
        at = _find(full, content, len(base))
        if at < 0:
            raise AdapterError("cannot locate an assistant message's content in the chat template")
        turn_end = full[at + len(content) :]
        if not turn_end:
            raise AdapterError(
                "the chat template ends assistant messages with nothing; an "
                "end-of-turn token is needed to delimit actions"
            )
        if turn_start_token is not None:
            start = tokenizer.convert_tokens_to_ids(turn_start_token)
        else:
            start = header[0]
        if start not in base:
            raise AdapterError(
                f"turn-start token id {start} does not open the user turn of the "
                f"chat template; set the adapter's turn_start_token option"
            )
        return cls(tuple(header), int(start), tuple(turn_end))

    @property
    def end_of_turn(self) -> int:
        """The end-of-turn token id the model generates to end an assistant message."""
        return self.turn_end[0]


def turn_indices(ids: Sequence[int], turn_start: int) -> list[int]:
    """c_t: the number of turn-start tokens among ``ids[:t+1]`` (0 before the first turn);
    token t belongs to message ``c_t - 1``."""
    out, c = [], 0
    for t in ids:
        c += t == turn_start
        out.append(c)
    return out


def assistant_mask(ids: Sequence[int], roles: Sequence[str], fmt: ChatFormat) -> list[int]:
    """m_t = 1 for the tokens an assistant produced: inside an assistant turn (by turn index),
    after its role header, up to and including the end-of-turn token."""
    turns = turn_indices(ids, fmt.turn_start)
    if max(turns, default=0) != len(roles):
        raise AdapterError(
            f"{max(turns, default=0)} turn-start tokens for {len(roles)} messages: "
            f"the turn-start token also appears inside message text, or the "
            f"template adds turns; set turn_start_token"
        )
    mask = [0] * len(ids)
    t = 0
    while t < len(ids):
        c = turns[t]
        if c == 0 or roles[c - 1] != "assistant":
            t += 1
            continue
        start = t + len(fmt.header)  # t is the turn-start token of this assistant turn
        if list(ids[t:start]) != list(fmt.header):
            raise AdapterError("an assistant turn does not open with the template's header")
        j = start
        while j < len(ids) and turns[j] == c:
            mask[j] = 1
            if ids[j] == fmt.end_of_turn:
                break
            j += 1
        t = j + 1
        while t < len(ids) and turns[t] == c:
            t += 1
    return mask


def target_mask(token_mask: Sequence[int]) -> list[int]:
    """Align a per-token mask with next-token targets: entry j is for predicting token j+1."""
    return list(token_mask[1:])


@dataclass
class Transcript:
    """A growing sequence of token ids with, per token, whether it is trained on (the policy
    produced it) and its behaviour log-prob (0 where not trained)."""

    # the transcript's token ids: an EpisodeSample's completion_ids
    ids: list[int] = field(default_factory=list)
    # per token, 1 where trained (the policy's decisions): an EpisodeSample's loss_mask
    mask: list[int] = field(default_factory=list)
    # per token, the behaviour log-prob (0.0 on context): an EpisodeSample's logprobs
    logprobs: list[float] = field(default_factory=list)

    def add_context(self, ids: Sequence[int]) -> None:
        """Append environment tokens: not trained, log-prob 0.0."""
        self.ids += list(ids)
        self.mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)

    def add_action(
        self, ids: Sequence[int], logprobs: Sequence[float], trained: bool = True
    ) -> None:
        """Append a decision's ids as generated with their behaviour log-probs; ``trained``
        False keeps them in the transcript without training them (a forced move)."""
        if len(ids) != len(logprobs):
            raise ValueError(f"{len(ids)} action tokens with {len(logprobs)} log-probs")
        self.ids += list(ids)
        self.mask += [int(trained)] * len(ids)
        self.logprobs += [float(x) for x in logprobs]

    def __len__(self) -> int:
        """Tokens so far."""
        return len(self.ids)


class ChatBuilder:
    """Builds transcripts through the tokenizer's chat template the way the live loop sees
    them, one piece at a time: `start()` is the system turn (the group prompt), `user(text)` a
    user turn with the assistant header after it (the context of a decision), `note(text)` a
    user turn without it, `close(action_ids)` the end-of-turn tokens a generated action lacks.

    The pieces are cut from renderings of short probe conversations, and the class checks that
    the template renders messages independently (true for ChatML/Qwen-style templates);
    otherwise concatenated pieces would differ from a full rendering, and it refuses.
    """

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, system: str, fmt: ChatFormat | None = None
    ):
        """``system``: the system message every episode starts with; ``fmt``: learnt from
        the tokenizer's chat template when not given (``ChatFormat.learn``, which raises
        ``AdapterError`` for a tokenizer without one). The tiny model's tokenizer has a small
        template (``<bos>ROLE=content<eos>``, roles a/b/c); for a model folder without a
        template, build the transcript with ``tokenizer.encode`` and ``Transcript`` instead."""
        self.tokenizer = tokenizer
        self.fmt = fmt or ChatFormat.learn(tokenizer)
        self.system = system
        self._sys = [{"role": "system", "content": system}]
        self.system_ids = render_ids(tokenizer, self._sys)

    def start(self) -> list[int]:
        """Ids of the system turn: the group's ``prompt_ids``."""
        return list(self.system_ids)

    def _delta(self, content: str, gen: bool) -> list[int]:
        full = render_ids(self.tokenizer, self._sys + [{"role": "user", "content": content}], gen)
        if full[: len(self.system_ids)] != self.system_ids:
            raise AdapterError(
                "the chat template does not render the system turn as a prefix of "
                "longer conversations; multi-turn transcripts cannot be built "
                "incrementally with it"
            )
        return full[len(self.system_ids) :]

    def user(self, content: str) -> list[int]:
        """Ids of a user turn followed by the assistant header: the context before a decision."""
        return self._delta(content, True)

    def note(self, content: str) -> list[int]:
        """Ids of a user turn without the assistant header (results, bookkeeping)."""
        return self._delta(content, False)

    def close(self, action_ids: Sequence[int]) -> list[int]:
        """The template's end-of-turn ids that a generated action lacks (all of them when it
        was cut before the end-of-turn token; the rest when it ends with it)."""
        end = list(self.fmt.turn_end)
        if action_ids and action_ids[-1] == end[0]:
            return end[1:]
        return end

    def action_text(self, content: str) -> list[int]:
        """Ids of an action written as text (an assistant message's content, end-of-turn
        token included), as the full template renders it."""
        return list(self.tokenizer.encode(content, add_special_tokens=False)) + [
            self.fmt.end_of_turn
        ]


def log_to_sample(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[dict[str, str]],
    fmt: ChatFormat | None = None,
) -> tuple[list[int], list[int], list[int]]:
    """Appendix D for one conversation: (ids, per-token turn index, per-token assistant mask)."""
    fmt = fmt or ChatFormat.learn(tokenizer)
    ids = render_ids(tokenizer, messages)
    roles = [m["role"] for m in messages]
    return ids, turn_indices(ids, fmt.turn_start), assistant_mask(ids, roles, fmt)
