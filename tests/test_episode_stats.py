"""Episode statistics (issue 56, item 4): a multi-turn run showed nothing of its games. Now the
numbers of an episode's ``EpisodeSample.info`` travel as the record's ``stats`` (bounded names,
finite values, at most 16; the rest stays on the worker with one warning naming the adapter),
the learner refuses a malformed ``stats`` field with a named reason, a step's row carries the
per-name means (``episode_stats``), and episodes cut at a limit count in ``completions_cut``
(the record's ``cut``; before, it was null on every multi-turn step)."""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import random
import sys
import types
from types import SimpleNamespace
from typing import Any

import pytest
from test_adapters_registry import MULTI_TURN, tutorial_files
from worker_doubles import ScriptedClient, make_generation

from echo_rl.core import wire
from echo_rl.core.control_stats import ControlStats
from echo_rl.core.models import build_tiny_tokenizer
from echo_rl.data.adapter import Prompt
from echo_rl.data.buffer import ReplayBuffer
from echo_rl.data.episodes import EpisodeAdapter, EpisodeSample, episode_cut
from echo_rl.data.records import Limits, Record, RecordError, episode_stats, parse_record
from echo_rl.data.testing import PolicyBackend, Turn, make_groups, play_groups
from echo_rl.learner.rows import CutWatch, RunTotals, cut_share, episode_means, metrics_row
from echo_rl.worker.records import episode_fields, record

pytestmark = pytest.mark.timeout(120)

LIMITS = Limits(vocab_size=64, max_new_tokens=32, group_size=2)


def wire_record(gid: str = "g", i: int = 0, **extra: Any) -> dict[str, Any]:
    return {
        "group_id": gid,
        "sample_idx": i,
        "prompt_ids": [1, 2],
        "completion_ids": [5, 6, 7],
        "logprobs": [-0.5, 0.0, -0.5],
        "reward": 1.0,
        "version": 0,
        "worker_id": "w0",
        "gen_s": 0.1,
        "loss_mask": [1, 0, 1],
        **extra,
    }


def episode(info: dict[str, Any], n: int = 3, cut: bool = False) -> EpisodeSample:
    return EpisodeSample([5] * n, [-0.5] * n, [1] * n, 1.0, info=info, cut=cut)


# ------------------------------------------------------------------ the worker


def test_an_episodes_info_numbers_become_the_records_stats_and_the_rest_stays(caplog, monkeypatch):
    """Numbers under short names travel (bools as 0/1); text and logs stay silently (the
    adapter's free-form use); numbers that cannot travel stay with one warning per key naming
    the adapter, and the record passes the learner's own check."""
    from echo_rl.worker import records

    monkeypatch.setattr(records, "_warned", set())
    adapter = SimpleNamespace(name="guess-word", max_completion_tokens=64)
    info = {
        "solved": True,
        "moves": 3,
        "net": -2.5,
        "end": "won",  # text: the adapter's, never sent, no warning
        "log": {"turns": [1, 2]},
        "Bad-Name": 1.0,
        "nan_rate": math.nan,
        "huge": 1e300,
        "x" * 33: 1,
    }
    g = wire.Group(group_id="g", prompt_ids=[1, 2], n=1, seed=0)
    with caplog.at_level(logging.WARNING, logger="echo.worker"):
        fields = episode_fields(episode(info), adapter)
        again = episode_fields(episode(info), adapter)  # same keys: no second warning
    assert fields == again == {"cut": False, "stats": {"solved": 1.0, "moves": 3.0, "net": -2.5}}
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "guess-word" in warning
    assert all(k in warning for k in ("Bad-Name", "nan_rate", "huge", "x" * 33))
    assert "'end'" not in warning and "'log'" not in warning
    rec = {**record(g, 0, episode(info), 1.0, "w0", 0.1, 0), **fields}
    [back] = wire.unpack_records(wire.pack_records([rec]), 2**20)
    admitted = parse_record(back, LIMITS)
    assert admitted.stats == {"solved": 1.0, "moves": 3.0, "net": -2.5} and admitted.cut is False


def test_only_sixteen_numbers_travel_and_the_rest_are_named():
    info = {f"n{k:02d}": k for k in range(20)}
    kept, dropped = episode_stats(info)
    assert list(kept) == [f"n{k:02d}" for k in range(16)]
    assert dropped == ["n16", "n17", "n18", "n19"]
    assert episode_stats("not a dict") == ({}, [])


class Game(EpisodeAdapter):
    """One decision per episode, then an episode of its length's reward."""

    name = "one-move"
    max_completion_tokens = 8

    def prompts(self, rng: random.Random) -> Any:
        while True:
            yield Prompt([1, 2], {})

    def episode(self, task: dict[str, Any], seed: int, sample_idx: int) -> Any:
        ids, lps = yield [1, 2]
        return EpisodeSample(list(ids), list(lps), [1] * len(ids), 1.0, info={"n": len(ids)})


def test_a_decision_at_max_new_tokens_without_end_of_sequence_cuts_its_episode():
    """``drive`` marks an episode whose decision stopped at worker.max_new_tokens without
    end-of-sequence; one that ended on it is not; nor is one whose answer set has no
    end-of-sequence (one token per decision by design); and a transcript that fills
    max_completion_tokens is cut."""
    tok = build_tiny_tokenizer()
    game = Game({}, tok)
    eos = tok.eos_token_id
    digit = tok.convert_tokens_to_ids("7")
    groups = make_groups(game, count=1, n=1)

    def play(reply: list[int], max_new: int, answers: tuple[int, ...] | None = None) -> Any:
        from echo_rl.data.episodes import backend_generate_fn

        backend = PolicyBackend(lambda turn: reply, tok)
        backend.answer_tokens = answers  # type: ignore[attr-defined]
        gen = backend_generate_fn(backend, max_new, 1.0, 0)
        return game.rollout(groups, gen)[0][0]

    assert play([digit, digit, digit], 3).cut is True  # stopped at the limit
    assert play([digit, digit, eos], 3).cut is False  # ended on end-of-sequence
    assert play([digit, digit], 3).cut is False  # ended early
    assert play([digit], 1, answers=(digit,)).cut is False  # no end to reach
    assert play([digit], 1).cut is True
    assert episode_cut(episode({}, n=8), game) and not episode_cut(episode({}, n=7), game)
    assert episode_cut(episode({}, n=2, cut=True), game)  # the adapter says so


# ------------------------------------------------------------------ the learner


@pytest.mark.parametrize(
    "stats, detail",
    [
        ("solved", "map"),
        ({f"n{k}": 1.0 for k in range(17)}, "at most 16"),
        ({"Solved": 1.0}, "Solved"),
        ({"": 1.0}, "''"),
        ({"a" * 33: 1.0}, "aaa"),
        ({"rate": math.nan}, "rate"),
        ({"rate": math.inf}, "rate"),
        ({"rate": 1e16}, "rate"),
        ({"rate": "0.5"}, "rate"),
        ({"rate": True}, "rate"),
        ({"rate": [1.0]}, "rate"),
        ({"rate": 10**400}, "rate"),
    ],
)
def test_malformed_stats_are_refused_with_a_named_reason(stats, detail):
    with pytest.raises(RecordError) as err:
        parse_record(wire_record(stats=stats), LIMITS)
    assert err.value.reason == "bad_stats" and detail in err.value.detail
    with pytest.raises(RecordError) as err:
        parse_record(wire_record(cut="yes"), LIMITS)
    assert err.value.reason == "invalid_fields" and "cut" in err.value.detail


def test_records_without_the_new_fields_are_admitted_as_before():
    rec = parse_record(wire_record(), LIMITS)
    assert rec.stats is None and rec.cut is None
    rec = parse_record(wire_record(stats={"won": 1, "rate": 0.25}, cut=True), LIMITS)
    assert rec.stats == {"won": 1.0, "rate": 0.25} and rec.cut is True
    assert isinstance(rec.stats["won"], float)


def test_the_intake_refuses_a_bad_stats_record_and_admits_the_others(tmp_path):
    """A hostile batch: one record's stats malformed. That record is refused and counted
    under bad_stats; the intake goes on, another group of the same batch is admitted."""
    from echo_rl.control.intake import Intake
    from echo_rl.control.reputation import Reputation
    from echo_rl.control.work import WorkQueue

    prompts = (Prompt([1, 2], {"i": i}) for i in itertools.count())
    work = WorkQueue(prompts, group_size=2, max_outstanding=8, lease_timeout_s=60, prefix="r")
    buffer = ReplayBuffer(staleness=2, capacity_groups=8, group_size=2)
    it = Intake(
        limits=LIMITS,
        buffer=buffer,
        work=work,
        reputation=Reputation(tmp_path, 2, lambda: 0),
    )
    bad_g, good_g = work.grant("w0", 2, 0)
    batch = [
        wire_record(bad_g.group_id, 0, stats={"rate": math.nan}),
        wire_record(good_g.group_id, 0, stats={"won": 1.0}, cut=False),
        wire_record(good_g.group_id, 1, stats={"won": 0.0}, cut=True),
    ]
    out = it.batch("w0", "k", batch)
    assert out.rejected == {"bad_stats": 1} and out.rejected_idx == [0]
    assert "rate" in out.details["bad_stats"]
    assert [r.group_id for r in out.accepted] == [good_g.group_id] * 2
    assert [r.stats for r in out.accepted] == [{"won": 1.0}, {"won": 0.0}]


def rec(
    stats: dict[str, float] | None = None, cut: bool | None = None, mask: bool = True
) -> Record:
    ids = [5, 6, 7]
    return Record(
        "g",
        0,
        [1],
        ids,
        [-0.5] * 3,
        1.0,
        0,
        "w0",
        0.1,
        loss_mask=[1, 0, 1] if mask else None,
        stats=stats,
        cut=cut,
    )


def test_a_steps_row_carries_the_per_name_means_over_the_records_that_carry_them():
    groups = [
        [rec({"won": 1.0, "moves": 4.0}), rec({"won": 0.0, "moves": 2.0})],
        [rec({"won": 1.0}), rec(None)],  # a record without stats counts for no name
    ]
    row = metrics_row(
        0,
        0,
        groups,
        {},
        0.1,
        0.2,
        0.0,
        RunTotals(),
        ReplayBuffer(staleness=2, capacity_groups=8, group_size=2),
        ControlStats(),
    )
    assert row.episode_stats == {"moves": 3.0, "won": round(2 / 3, 5)}
    assert episode_means([rec(None), rec(None, mask=False)]) is None
    assert row.to_json()["episode_stats"] == {"moves": 3.0, "won": round(2 / 3, 5)}


def test_a_row_keeps_the_sixteen_names_the_most_records_carry():
    """Workers are strangers: names they make up cannot grow a row (or the gauge) without
    bound."""
    common = {f"c{k:02d}": 1.0 for k in range(16)}
    records = [rec(common), rec(common), rec({"junk_a": 5.0, "junk_b": 5.0})]
    means = episode_means(records)
    assert means is not None and set(means) == set(common)


def test_multi_turn_cut_episodes_count_in_completions_cut(caplog):
    """Before, completions_cut was None for every multi-turn step. Episodes count as the
    records say; those from a worker that does not say are left out; single-turn records keep
    their rule; most episodes cut warns, naming the limits to raise."""
    episodes = [rec(cut=True), rec(cut=False), rec(cut=True), rec(cut=None)]
    assert cut_share(episodes, 32, 2) == pytest.approx(2 / 3)
    assert cut_share([rec(cut=None)], 32, 2) is None
    single = Record("g", 1, [1], [7, 7], [-0.5] * 2, 1.0, 0, "w0", 0.1)  # cut at 2, no eos
    assert cut_share([single, rec(cut=False)], 2, 9) == 0.5
    watch = CutWatch(max_new_tokens=4, eos_token_id=2, adapter="take-last")
    with caplog.at_level(logging.WARNING, logger="echo.learner"):
        assert watch.share(0, [rec(cut=True), rec(cut=True), rec(cut=False)]) == round(2 / 3, 4)
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "episodes stopped at a limit" in warning and "max_completion_tokens" in warning
    assert "take-last" in warning


def test_the_dashboard_and_the_gauge_show_the_means():
    from echo_rl.core.metrics import LearnerMetrics

    m = LearnerMetrics()
    m.update({"step": 0, "completions_cut": 0.25, "episode_stats": {"won": 0.5, "moves": 3.0}})
    text = m.prometheus_text().decode()
    assert 'echo_episode_stat{name="won"} 0.5' in text and "echo_completions_cut 0.25" in text
    row = m.state()["rows"][-1]
    assert row["episode_stats"] == {"won": 0.5, "moves": 3.0} and row["completions_cut"] == 0.25
    m.update({"step": 1, "episode_stats": {"won": 1.0}})  # a name gone is removed
    text = m.prometheus_text().decode()
    assert 'name="moves"' not in text and 'echo_episode_stat{name="won"} 1.0' in text


def test_the_console_line_shows_the_cut_share_and_the_means():
    from echo_rl.cli.quickstart import _describe
    from echo_rl.core.steprow import StepRow

    row = StepRow(
        step=3,
        reward_mean=0.5,
        staleness_max=1,
        bubble_ratio=0.1,
        active_workers=1,
        standby_workers=0,
        completions_cut=0.25,
        episode_stats={"illegal": 0.125, "won": 0.5},
    )
    assert _describe(row).endswith("  cut 25%  illegal 0.125  won 0.5")


# ------------------------------------------------------------------ end to end


@pytest.fixture
def takelast(monkeypatch: pytest.MonkeyPatch) -> Any:
    """docs/adapters.md's multi-turn tutorial game, its info given numbers: whether the game
    was won, whether it ended on an illegal move, and the policy's tokens."""
    mod = types.ModuleType("echo_takelast")
    monkeypatch.setitem(sys.modules, "echo_takelast", mod)
    exec(tutorial_files(MULTI_TURN)["echo_takelast/__init__.py"], mod.__dict__)

    class Counted(mod.TakeLast):  # type: ignore[name-defined,misc]
        name = "take-last"

        def end(self, tr: Any, reward: float, how: str) -> EpisodeSample:
            s: EpisodeSample = super().end(tr, reward, how)
            s.info.update(won=how == "won", illegal=how == "illegal", tokens=sum(s.loss_mask))
            return s

    return Counted({}, build_tiny_tokenizer())


def policy(turn: Turn) -> str:
    """Episode ``slot`` of the first decision answers "12": two tokens, no end-of-sequence, at
    max_new_tokens = 2 (a cut decision; "1" is taken) when ``slot % 3 == 0``; every other
    decision is a random 1, 2, 3 or an illegal 9."""
    if turn.decision == 0 and turn.slot % 3 == 0:
        return "12"
    return random.Random(f"{turn.seed}/{turn.slot}/{turn.decision}").choice("1239")


def test_a_multi_turn_run_shows_its_games_in_the_step_row(small_cfg, takelast, tmp_path):
    """The tutorial's game, played by the worker's own generation (its records as it sends
    them), admitted by the learner's checks and trained in one learner step: the step's row
    has the share of games won, ended illegally and the tokens, and the share of episodes cut,
    as the same episodes played by the test kit say."""
    from echo_rl.learner.main import Learner
    from echo_rl.learner.policy import Policy

    groups = make_groups(takelast, count=4, n=4, seed=0)
    kit = [ep for g in play_groups(takelast, groups, policy, max_new_tokens=2) for ep in g]
    backend = PolicyBackend(policy, takelast.tokenizer)
    backend.tokens_sampled = 0  # type: ignore[attr-defined]
    worker = make_generation(ScriptedClient(lambda msg: None), backend, takelast, version=0)
    view = dict(worker.session.view, episode_stats=True)
    worker.session.view = dict(view, worker={**view["worker"], "max_new_tokens": 2})
    assert asyncio.run(worker.rollout(groups)) is True
    (batch,) = worker.deliveries.unacked.values()
    sent = wire.unpack_records(batch.payload, 2**20)
    assert sent[0]["stats"].keys() == {"won", "illegal", "tokens"}

    small_cfg.worker.max_new_tokens = 32  # the learner admits the tutorial's transcripts
    small_cfg.metrics.enabled = False
    lrn = Learner(small_cfg, tmp_path, Policy(small_cfg))
    try:
        lrn.start(False)
        for obj in sent:
            lrn.buffer.admit(parse_record(obj, lrn.limits))
        row = lrn._one_step()
    finally:
        lrn.close("test over")

    def mean(values: list[float]) -> float:
        return round(sum(values) / len(values), 5)

    assert row.episode_stats == {
        "illegal": mean([ep.info["end"] == "illegal" for ep in kit]),
        "tokens": mean([sum(ep.loss_mask) for ep in kit]),
        "won": mean([ep.info["end"] == "won" for ep in kit]),
    }
    assert 0 < row.episode_stats["won"] < 1 and 0 < row.episode_stats["illegal"] < 1
    assert row.completions_cut == round(6 / 16, 4)  # slots 0, 3, 6, 9, 12, 15 of 16
    assert row.to_json()["episode_stats"] == row.episode_stats


def test_the_sample_commands_cut_column_fills_for_episodes(takelast):
    """``echo-rl sample`` on a multi-turn run: ``cut`` by the worker's rule (it was always
    blank), and the JSON rows carry the stats a worker would send."""
    from echo_rl.cli.commands.sample import _episodes

    groups = make_groups(takelast, count=2, n=3, seed=0)
    backend = PolicyBackend(policy, takelast.tokenizer)
    rows = _episodes(takelast, backend, groups, 2, 1.0)
    assert [r["cut"] for r in rows] == [k % 3 == 0 for k in range(6)]
    assert all(r["stats"].keys() == {"won", "illegal", "tokens"} for r in rows)


def test_a_learner_that_does_not_say_it_admits_them_gets_no_stats_nor_cut():
    """An older learner refuses unknown record fields, and a refused sample leaves its group
    partial (a strike): the worker sends ``stats`` and ``cut`` only when the join view says
    ``episode_stats``, which this learner's does."""
    from echo_rl.core.config import EchoConfig

    assert EchoConfig().worker_view()["episode_stats"] is True
    tok = build_tiny_tokenizer()
    game = Game({}, tok)
    groups = make_groups(game, count=1, n=2)

    def sent(view_flag: bool) -> list[dict[str, Any]]:
        backend = PolicyBackend(lambda turn: "77", tok)
        backend.tokens_sampled = 0  # type: ignore[attr-defined]
        worker = make_generation(ScriptedClient(lambda msg: None), backend, game, version=0)
        if view_flag:
            worker.session.view = dict(worker.session.view, episode_stats=True)
        assert asyncio.run(worker.rollout(groups)) is True
        (batch,) = worker.deliveries.unacked.values()
        return wire.unpack_records(batch.payload, 2**20)

    old = sent(False)
    assert all("stats" not in r and "cut" not in r for r in old)
    new = sent(True)
    assert [(r["stats"], r["cut"]) for r in new] == [({"n": 3.0}, False)] * 2
