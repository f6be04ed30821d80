"""The multi-turn test kit (``echo_rl.data.testing``, issue 56): it plays an adapter's episodes as a
worker does (the worker's own driver gives the same episodes), by the adapter's rules, refuses
episodes that break the contract, builds the groups a worker is granted, and the docs' example
tests that use it pass against the tutorial's game."""

from __future__ import annotations

import importlib.util
import random
import sys
import threading
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from test_adapters_registry import MULTI_TURN, tutorial_files

from echo_rl.adapters.poker import PokerAdapter
from echo_rl.core import wire
from echo_rl.core.models import build_tiny_tokenizer
from echo_rl.data.adapter import AdapterError, Prompt
from echo_rl.data.episodes import EpisodeAdapter, EpisodeSample
from echo_rl.data.multiturn import Transcript
from echo_rl.data.testing import (
    PolicyBackend,
    Turn,
    build_chatml_char_tokenizer,
    make_group,
    make_groups,
    play_episode,
    play_groups,
    scripted,
)

pytestmark = pytest.mark.timeout(60)


def _module(name: str, path: Path, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """Import ``path`` as ``name`` (undone after the test)."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, mod)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def tutorial(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """docs/adapters.md's take-last package written out, its adapter importable."""
    root = tmp_path / "takelast"
    for name, text in tutorial_files(MULTI_TURN).items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    _module("echo_takelast", root / "echo_takelast" / "__init__.py", monkeypatch)
    return root


@pytest.fixture
def tok() -> Any:
    return build_tiny_tokenizer()


@pytest.fixture
def game(tutorial: Path, tok: Any) -> EpisodeAdapter:
    adapter: EpisodeAdapter = sys.modules["echo_takelast"].TakeLast({}, tok)
    return adapter


def by_the_rules(pile: int, seed: int, sample_idx: int, moves: list[int]) -> tuple[str, float, str]:
    """The take-last game of docs/adapters.md played out by hand: transcript, reward, end."""
    opponent = random.Random(f"{seed}/{sample_idx}")
    text = ""
    for take in moves:
        text += f"{take}<eos>"
        if take > pile:
            return text, 0.0, "illegal"
        pile -= take
        if pile == 0:
            return text, 1.0, "won"
        pile -= min(pile, opponent.randint(1, 3))
        if pile == 0:
            return text, 0.0, "lost"
        text += f"{pile}="
    raise AssertionError("the script ran out")


def test_the_kit_plays_the_tutorial_game_by_its_rules(game: EpisodeAdapter, tok: Any) -> None:
    seen: list[Turn] = []
    script = scripted(["2", "1", "1", "1", "1"])

    def policy(turn: Turn) -> str | list[int]:
        seen.append(turn)
        return script(turn)

    ends = set()
    for seed in range(12):
        seen.clear()
        prompt = Prompt(tok.encode("7=", add_special_tokens=False), {"pile": 7})
        ep = play_episode(game, prompt, policy, seed=seed, max_new_tokens=2)
        text, reward, end = by_the_rules(7, seed, 0, [2, 1, 1, 1, 1])
        assert tok.decode(ep.completion_ids) == text
        assert (ep.reward, ep.info) == (reward, {"end": end})
        # one decision per policy move, each seeing the prompt and the transcript so far
        assert [t.decision for t in seen] == list(range(text.count("<eos>")))
        assert [t.text for t in seen] == ["7=" + x for x in _contexts(text)]
        trained = [lp for lp, m in zip(ep.logprobs, ep.loss_mask) if m]
        assert trained == [-0.5] * (2 * len(seen))  # the kit's log-prob on every policy id
        assert all(lp == 0.0 for lp, m in zip(ep.logprobs, ep.loss_mask) if not m)
        ends.add(end)
    assert ends == {"won", "lost"}  # the seeds reach both endings


def _contexts(text: str) -> list[str]:
    """The transcript before each decision: up to each `=` the environment wrote, and ''."""
    out, at = [""], 0
    while (at := text.find("=", at) + 1) > 0:
        out.append(text[:at])
    return out


def test_a_malformed_reply_is_played_as_the_adapter_says(game: EpisodeAdapter, tok: Any) -> None:
    # take-last: not a move of 1-3 stones ends the game with nothing, after one decision
    ep = play_episode(game, {"pile": 7}, scripted(["9"]), max_new_tokens=2)
    assert tok.decode(ep.completion_ids) == "9<eos>" and ep.loss_mask == [1, 1]
    assert (ep.reward, ep.info) == (0.0, {"end": "illegal"})
    # a reply longer than a decision is cut as a model's is: "12" then <eos>, cut to 2 ids
    ep = play_episode(game, {"pile": 1}, scripted(["12"]), max_new_tokens=2)
    assert tok.decode(ep.completion_ids) == "12" and ep.info == {"end": "won"}
    # poker: an unreadable action is played as a fold and costs invalid_penalty
    chatml = build_chatml_char_tokenizer()
    poker = PokerAdapter({"bot_samples": 6, "invalid_penalty": 2.5}, chatml)
    task = {"deal_seed": 3, "hero_seat": 0, "opponents": ["station"]}  # the policy acts
    [samples] = play_groups(poker, [make_group(task, n=2)], lambda turn: "I fold? maybe")
    for s in samples:
        assert s.info["invalid"] == s.info["decisions"] >= 1
        assert s.reward == pytest.approx(s.info["net_chips"] / 2 - 2.5 * s.info["invalid"])
        turns = [t for h in s.info["log"]["hands"] for t in h["turns"]]
        assert all(t["action"] == "I fold? maybe" for t in turns)


def test_a_policy_reply_must_be_what_a_model_could_generate(game: EpisodeAdapter) -> None:
    with pytest.raises(ValueError, match="vocabulary"):
        play_episode(game, {"pile": 7}, lambda turn: [10_000])
    with pytest.raises(ValueError, match="one or more"):
        play_episode(game, {"pile": 7}, lambda turn: [])
    with pytest.raises(TypeError, match="text or a list"):
        play_episode(game, {"pile": 7}, lambda turn: 3)
    with pytest.raises(IndexError, match="decision 1 asked, 1 scripted"):
        play_episode(game, {"pile": 9}, scripted(["1"]), max_new_tokens=2)


class Broken(EpisodeAdapter):
    """An adapter whose episodes break the contract in the way ``how`` names."""

    max_completion_tokens = 8

    def __init__(self, how: str, tokenizer: Any):
        super().__init__({}, tokenizer)
        self.how = how

    def prompts(self, rng: random.Random) -> Any:
        while True:
            yield Prompt(prompt_ids=[5, 6], task={})

    def episode(self, task: dict[str, Any], seed: int, sample_idx: int) -> Any:
        tr = Transcript()
        tr.add_context([7])
        while True:
            # "partial": yields only the new tokens, not the prompt and the whole transcript
            ids, lps = yield ([7] if self.how == "partial" else [5, 6] + tr.ids)
            if self.how == "reordered":
                tr.add_context([8])  # the environment's token before the decision's ids
            tr.add_action(ids, lps)
            if self.how != "endless":
                break
        if self.how == "empty":
            return EpisodeSample([], [], [], 1.0)
        if self.how == "long":
            tr.add_context([7] * 8)
        reward = float("nan") if self.how == "nan" else 1.0
        return EpisodeSample(tr.ids, tr.logprobs, tr.mask, reward)


@pytest.mark.parametrize(
    "how, message",
    [
        ("fine", None),
        ("partial", "start with its context"),
        ("reordered", "start with its context"),
        ("endless", "still running after 64 decisions"),
        ("empty", "0 completion tokens"),
        ("long", "= 8 are admitted"),
        ("nan", "not finite"),
    ],
)
def test_the_kit_refuses_an_episode_that_breaks_the_contract(
    tok: Any, how: str, message: str | None
) -> None:
    ad = Broken(how, tok)
    groups = make_groups(ad, count=2, n=3)
    if message is None:
        out = play_groups(ad, groups, lambda turn: [4], max_new_tokens=4)
        assert [[s.completion_ids for s in g] for g in out] == [[[7, 4]] * 3] * 2
        return
    with pytest.raises(AdapterError, match=message):
        play_groups(ad, groups, lambda turn: [4], max_new_tokens=4)
    # without the prompt's ids the context cannot be located, and is not checked
    if how in ("partial", "reordered"):
        play_episode(ad, {}, lambda turn: [4], max_new_tokens=4)


def test_make_groups_are_the_groups_a_worker_is_granted(game: EpisodeAdapter, tok: Any) -> None:
    from echo_rl.learner.evaluation import seeded_groups

    groups = make_groups(game, count=3, n=4, seed=5)
    prompts = game.prompts(random.Random(5))
    first = [next(prompts) for _ in range(3)]
    # the wire's Group, with the prompts' ids and tasks, n, and echo-rl eval's seeds
    assert all(type(g) is wire.Group for g in groups)
    assert groups == seeded_groups(first, 4, 5, "test")
    assert [(g.prompt_ids, g.task, g.n) for g in groups] == [
        (p.prompt_ids, p.task, 4) for p in first
    ]
    assert len({g.seed for g in groups}) == 3
    # what a worker receives: the learner's grant, through the wire, unchanged
    frame = wire.encode(wire.WorkGrant(groups=groups))
    received = wire.decode(frame, 1 << 20)
    assert isinstance(received, wire.WorkGrant) and received.groups == groups
    # and each group's episodes are those of its seed and sample index
    out = play_groups(game, groups, scripted(["1"] * 5), max_new_tokens=2)
    for g, samples in zip(groups, out):
        assert len(samples) == 4
        for i, s in enumerate(samples):
            text, reward, _ = by_the_rules(g.task["pile"], g.seed, i, [1] * 5)
            assert (tok.decode(s.completion_ids), s.reward) == (text, reward)
    # a task's own token budget travels in the group, as the learner grants it
    g = make_group(Prompt([1, 2], {"a": 1}, max_new_tokens=3), n=2, seed=9, group_id="x")
    assert g == wire.Group(
        group_id="x", prompt_ids=[1, 2], n=2, seed=9, task={"a": 1}, max_new_tokens=3
    )


@pytest.mark.parametrize("adapter", ["take-last", "poker"])
def test_the_kit_plays_what_the_worker_plays(request: pytest.FixtureRequest, adapter: str) -> None:
    """The worker's own driver (``echo_rl.worker.scoring.generate_and_score``), given the kit's
    stand-in backend, gives the very episodes the kit returns: the kit cannot drift."""
    from echo_rl.worker.scoring import generate_and_score

    if adapter == "poker":
        ad: EpisodeAdapter = PokerAdapter({"bot_samples": 6}, build_chatml_char_tokenizer())
        replies = ["Action: Call", "Action: Check", "Action: Raise 4", "Action: Fold"]
        max_new = 16
    else:
        ad = request.getfixturevalue("game")
        replies, max_new = ["1", "2", "3"], 2

    def policy(turn: Turn) -> str:  # a random player, deterministic per call and place
        return random.Random(f"{turn.seed}/{turn.slot}").choice(replies)

    groups = make_groups(ad, count=3, n=3, seed=2)
    kit = play_groups(ad, groups, policy, max_new_tokens=max_new)
    backend = PolicyBackend(policy, ad.tokenizer)
    wv = {"max_new_tokens": max_new, "temperature": 1.0}
    worker = generate_and_score(backend, ad, wv, threading.Event(), groups)
    assert backend.calls >= 2  # several rounds of decisions
    assert [[(s.completion_ids, s.logprobs, s.loss_mask, s.reward) for s in g] for g in kit] == [
        [(s.completion_ids, s.logprobs, s.loss_mask, r) for s, r in g] for g in worker
    ]
    rewards = {s.reward for g in kit for s in g}
    assert len(rewards) > 1  # the random player's episodes differ


def test_the_docs_kit_example_passes(tutorial: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/adapters.md's "Testing a multi-turn adapter" tests, run against the tutorial's
    game; each must have asserted something."""
    mod = _module("test_takelast_doc", tutorial / "tests" / "test_takelast.py", monkeypatch)
    tests = [f for name, f in vars(mod).items() if name.startswith("test_")]
    assert len(tests) == 4
    for test in tests:
        test()
