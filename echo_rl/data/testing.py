"""Test helpers for adapter authors: an in-memory ChatML tokenizer, entry points without a
wheel, and a kit that plays a multi-turn adapter's episodes the way a worker does.

The tiny quickstart tokenizer (``echo_rl.core.models.build_tiny_tokenizer``) only knows digits,
``+-*=`` and ``a-f``; adapters whose data is ordinary text (math word problems, poker
observations) need a tokenizer that can encode it. ``build_chatml_char_tokenizer`` maps every
printable ASCII character to one token, has ``<|im_start|>`` / ``<|im_end|>`` specials and a
ChatML chat template shaped like Qwen's, and needs no download, so tests and examples can
exercise the real multi-turn code paths (turn-start tokens, end-of-turn tokens, role headers).

The multi-turn kit (docs/adapters.md, "Testing a multi-turn adapter"): ``play_episode`` and
``play_groups`` drive ``episode()`` through the adapter's ``rollout`` with the worker's own
``generate`` for episodes, a test ``Policy`` (``scripted`` replies, or any function of the
``Turn``) standing in for the model; ``make_group`` / ``make_groups`` build the
``echo_rl.core.wire.Group`` objects a worker hands to ``rollout``.
"""

from __future__ import annotations

import math
import random
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from echo_rl.data.adapter import Adapter, AdapterError, Prompt
from echo_rl.data.episodes import EpisodeAdapter, EpisodeSample
from echo_rl.data.rules import derived_seed

if TYPE_CHECKING:  # annotations only: importing this module does not import transformers
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

    from echo_rl.core import wire
    from echo_rl.core.jsontypes import JsonObject

CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"]


def build_chatml_char_tokenizer() -> PreTrainedTokenizerFast:
    """Printable ASCII, one token per character, ChatML specials; eos = ``<|im_end|>``."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = list(dict.fromkeys(string.printable))
    vocab = {t: i for i, t in enumerate(CHATML_SPECIALS + chars)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in CHATML_SPECIALS])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<|endoftext|>", eos_token="<|im_end|>", unk_token="<unk>"
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast


def write_entry_points(
    site: str | Path, dist_name: str, adapters: dict[str, str], group: str = "echo_rl.adapters"
) -> Path:
    """Make ``site`` look like an installed distribution ``dist_name`` that declares
    ``adapters`` (``{"name": "module:Class"}``) in ``group``.

    Put ``site`` on ``sys.path`` (or ``PYTHONPATH`` for child processes) and
    ``load_adapter(name, ...)`` finds them, exactly as after a ``pip install``; this is how to
    test an adapter's registration without building a wheel.
    """
    site = Path(site)
    info = site / f"{dist_name.replace('-', '_')}-0.0.0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist_name}\nVersion: 0.0.0\n")
    lines = [f"[{group}]"] + [f"{k} = {v}" for k, v in adapters.items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    return info


# ----------------------------------------------------------------------------- multi-turn kit
# Play an EpisodeAdapter's episodes the way a worker does, with a test policy in place of a
# model: the episodes go through the adapter's own ``rollout`` (so ``drive``, the worker's
# lockstep driver) with the ``generate`` the worker builds (``backend_generate_fn``) over a
# stand-in backend that asks the policy. Only the backend differs from a worker's.

Reply = str | list[int]


@dataclass(frozen=True)
class Turn:
    """One decision as a test policy sees it: a context the worker's ``generate`` is handed."""

    # the context the episode yielded: the group's prompt_ids, then its transcript so far
    ids: list[int]
    # ``ids`` decoded with the adapter's tokenizer, special tokens kept
    text: str
    # which decision of its episode this is, from 0. Episodes play in lockstep, so every
    # episode still running is at the same decision: the index of the ``generate`` call
    # (groups with prefixes replay decisions without asking, and break this)
    decision: int
    # its place among the call's contexts (the episodes still running, in rollout order)
    slot: int
    # the sampling seed the worker's ``generate`` gives this call (it advances every call):
    # a random policy seeded with it and ``slot`` is deterministic
    seed: int


Policy = Callable[[Turn], Reply]


@dataclass
class PolicySample:
    """What ``PolicyBackend.generate`` returns per sample: the fields of a worker ``Sample``
    that the worker's ``generate`` for episodes reads."""

    # the decision's ids as the policy answered them, cut to max_new_tokens
    completion_ids: list[int]
    # one behaviour log-prob per id (the backend's ``logprob``)
    logprobs: list[float]


class PolicyBackend:
    """A stand-in for a worker ``Backend`` (``echo_rl/worker/backends/base.py``) that answers with
    ``policy`` instead of a model. ``backend_generate_fn`` calls ``generate`` once per round
    of decisions with one single-sample ``wire.Group`` per context, exactly as on a worker.

    A text reply becomes its ids then end-of-sequence (``tokenizer.eos_token_id``, the
    end-of-turn token of a chat tokenizer), as a model ends its turn; an id list is taken as
    given. Either is cut to ``max_new_tokens``, as a model's generation is, and every id gets
    log-prob ``logprob``. More than ``max_decisions`` rounds raise ``AdapterError``: an
    episode that never ends fails the test instead of hanging it."""

    def __init__(
        self,
        policy: Policy,
        tokenizer: PreTrainedTokenizerBase,
        *,
        logprob: float = -0.5,
        max_decisions: int = 64,
    ):
        """``tokenizer``: the adapter's (the worker's model has the same one)."""
        self.policy = policy
        self.tokenizer = tokenizer
        self.logprob = logprob
        self.max_decisions = max_decisions
        self.calls = 0  # rounds of decisions asked so far
        self.asked: list[tuple[Turn, list[int]]] = []  # every decision and the ids answered

    def generate(
        self, groups: Sequence[wire.Group], max_new_tokens: int, temperature: float, **_: object
    ) -> list[list[PolicySample]]:
        """``group.n`` samples per group (1 from the worker's ``generate``), each the
        policy's reply to the group's ``prompt_ids``; ``temperature`` is not used."""
        if self.calls >= self.max_decisions:
            raise AdapterError(
                f"episodes still running after {self.max_decisions} decisions: end them, or "
                f"raise max_decisions"
            )
        out = []
        for slot, g in enumerate(groups):
            turn = Turn(
                list(g.prompt_ids),
                str(self.tokenizer.decode(g.prompt_ids, skip_special_tokens=False)),
                self.calls,
                slot,
                g.seed,
            )
            ids = self._ids(self.policy(turn))[:max_new_tokens]
            self.asked.append((turn, ids))
            out.append([PolicySample(list(ids), [self.logprob] * len(ids)) for _ in range(g.n)])
        self.calls += 1
        return out

    def _ids(self, reply: Reply) -> list[int]:
        if isinstance(reply, str):
            ids = list(self.tokenizer.encode(reply, add_special_tokens=False))
            return ids + [int(self.tokenizer.eos_token_id)]
        if not isinstance(reply, list) or not all(type(t) is int for t in reply):
            raise TypeError(f"a policy returns text or a list of token ids, not {reply!r}")
        if not reply or not all(0 <= t < len(self.tokenizer) for t in reply):
            raise ValueError(
                f"a policy's ids are one or more ids of the tokenizer's vocabulary "
                f"[0, {len(self.tokenizer)}), as a model generates: got {reply}"
            )
        return list(reply)


def scripted(replies: Sequence[Reply]) -> Policy:
    """A policy answering every episode's k-th decision with ``replies[k]`` (text or ids);
    an episode asking for more decisions than scripted raises ``IndexError``."""
    script = list(replies)

    def policy(turn: Turn) -> Reply:
        if turn.decision >= len(script):
            raise IndexError(
                f"scripted policy: decision {turn.decision} asked, {len(script)} scripted "
                f"(context ...{turn.text[-60:]!r})"
            )
        return script[turn.decision]

    return policy


def make_group(
    prompt: Prompt | JsonObject, *, n: int = 1, seed: int = 0, group_id: str = "test-0"
) -> wire.Group:
    """The ``echo_rl.core.wire.Group`` a worker is granted for ``prompt``: its ``prompt_ids``,
    ``task`` and ``max_new_tokens``, ``n`` samples and the group's ``seed``. A bare task dict
    is a prompt without ids (``episode`` never reads them; ``play_groups`` then cannot check
    that contexts extend the prompt)."""
    from echo_rl.core import wire

    p = prompt if isinstance(prompt, Prompt) else Prompt(prompt_ids=[], task=dict(prompt))
    return wire.Group(
        group_id=group_id,
        prompt_ids=list(p.prompt_ids),
        n=n,
        seed=seed,
        task=p.task,
        max_new_tokens=p.max_new_tokens,
    )


def make_groups(adapter: Adapter, *, count: int = 1, n: int = 2, seed: int = 0) -> list[wire.Group]:
    """``count`` groups of ``n`` from the adapter's first prompts (``prompts(Random(seed))``),
    as ``echo_rl.core.wire.Group``, the type the learner grants and a worker hands to ``rollout``
    (echo_rl/control/work.py builds them from a ``Prompt`` the same way). Group ``i`` is ``test-i``
    with the seed ``echo-rl eval`` gives it (``echo_rl/learner/evaluation.seeded_groups``)."""
    prompts = adapter.prompts(random.Random(seed))
    return [
        make_group(next(prompts), n=n, seed=derived_seed(seed, i), group_id=f"test-{i}")
        for i in range(count)
    ]


def play_groups(
    adapter: EpisodeAdapter,
    groups: Sequence[wire.Group],
    policy: Policy,
    *,
    max_new_tokens: int = 16,
    logprob: float = -0.5,
    max_decisions: int = 64,
    check: bool = True,
) -> list[list[EpisodeSample]]:
    """Every group's ``n`` episodes, played as a worker plays them: ``adapter.rollout(groups,
    generate)`` with the worker's ``generate`` (``backend_generate_fn``) over a
    ``PolicyBackend``; ``max_new_tokens`` is ``worker.max_new_tokens`` (each decision's bound).
    Returns what the worker scores and sends, per group its ``EpisodeSample`` list.
    ``check``: ``check_episodes`` on the result (raises ``AdapterError``)."""
    from echo_rl.data.episodes import backend_generate_fn

    backend = PolicyBackend(policy, adapter.tokenizer, logprob=logprob, max_decisions=max_decisions)
    gen = backend_generate_fn(backend, max_new_tokens, 1.0, groups[0].seed)
    out = adapter.rollout(list(groups), gen)
    if check:
        check_episodes(adapter, groups, out, backend.asked, max_new_tokens)
    return out


def play_episode(
    adapter: EpisodeAdapter,
    prompt: Prompt | JsonObject,
    policy: Policy,
    *,
    seed: int = 0,
    max_new_tokens: int = 16,
    logprob: float = -0.5,
    max_decisions: int = 64,
) -> EpisodeSample:
    """One episode (``sample_idx`` 0 of a group of one with ``seed``) of ``prompt`` (a
    ``Prompt``, or a bare task dict), played and checked by ``play_groups``."""
    [[sample]] = play_groups(
        adapter,
        [make_group(prompt, seed=seed)],
        policy,
        max_new_tokens=max_new_tokens,
        logprob=logprob,
        max_decisions=max_decisions,
    )
    return sample


def check_episodes(
    adapter: EpisodeAdapter,
    groups: Sequence[wire.Group],
    out: Sequence[Sequence[EpisodeSample]],
    asked: Sequence[tuple[Turn, list[int]]],
    max_new_tokens: int,
) -> None:
    """The episode contract (docs/adapters.md, "Multi-turn adapters"), or ``AdapterError``
    naming what broke: ``group.n`` samples per group; each an ``EpisodeSample`` of 1 to
    ``max(max_new_tokens, max_completion_tokens)`` tokens (longer, a worker stops; empty, the
    learner refuses the record) with a finite reward; and, when the groups have prompt ids,
    every context followed by its decision's ids is a prefix of ``prompt_ids +
    completion_ids`` of some episode (the ids trained on are those the policy saw)."""
    if [len(s) for s in out] != [g.n for g in groups]:
        raise AdapterError(
            f"rollout gave {[len(s) for s in out]} episodes for groups of {[g.n for g in groups]}"
        )
    limit = max(max_new_tokens, int(adapter.max_completion_tokens))
    for g, samples in zip(groups, out):
        for i, s in enumerate(samples):
            where = f"episode {i} of {g.group_id}"
            if not isinstance(s, EpisodeSample):
                raise AdapterError(f"{where}: returned a {type(s).__name__}, not an EpisodeSample")
            if not 1 <= len(s.completion_ids) <= limit:
                raise AdapterError(
                    f"{where}: {len(s.completion_ids)} completion tokens; 1 to "
                    f"max(max_new_tokens, max_completion_tokens) = {limit} are admitted"
                )
            if not math.isfinite(s.reward):
                raise AdapterError(f"{where}: reward {s.reward} is not finite")
    if any(not g.prompt_ids for g in groups):
        return
    full = [
        list(g.prompt_ids) + s.completion_ids for g, samples in zip(groups, out) for s in samples
    ]
    for turn, ids in asked:
        seen = turn.ids + ids
        if not any(f[: len(seen)] == seen for f in full):
            raise AdapterError(
                f"decision {turn.decision}: no episode's prompt_ids + completion_ids start with "
                f"its context and the ids it generated (context ...{turn.text[-60:]!r}): yield "
                f"the prompt and the whole transcript, and keep each decision's ids in place"
            )
