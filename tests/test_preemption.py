"""Preemption and owner-first yield (docs/preemption.md): prefixes a preempted worker hands back
are checked by the learner, continued by another worker, delivered unchanged and audited as
the continuing worker's own tokens; the backend cuts generation at once when told."""

from __future__ import annotations

import itertools
import threading
from collections import Counter

import pytest

from echo_rl.control.handback import PrefixLimits, check_prefixes, expand
from echo_rl.control.intake import Intake, IntakeChecks
from echo_rl.control.reputation import Reputation
from echo_rl.control.work import WorkQueue
from echo_rl.core import wire
from echo_rl.data.adapter import Prompt
from echo_rl.data.buffer import ReplayBuffer
from echo_rl.data.records import Limits, RecordError, parse_record
from echo_rl.worker.backends.base import Sample
from echo_rl.worker.records import runs, versions

LIM = PrefixLimits(vocab_size=100, max_new_tokens=8, min_logprob=-1e4, staleness=2)


def group(**kw):
    return wire.Group(group_id="g", prompt_ids=[1, 2], n=3, seed=5, **kw)


def prefix(i=0, ids=(5, 6), lps=(-0.5, -1.0), versions=((4, 2),)):
    return wire.Prefix(
        sample_idx=i, ids=list(ids), logprobs=list(lps), versions=[list(v) for v in versions]
    )


def test_a_sound_prefix_is_kept_and_each_hostile_one_is_refused_by_name():
    refused: Counter = Counter()
    good = prefix(0)
    hostile = [
        prefix(7),  # no such sample
        prefix(1, ids=(5, 500)),  # outside the vocabulary
        prefix(1, lps=(-0.5, 0.5)),  # a probability above 1
        prefix(1, ids=range(9), lps=[-0.1] * 9, versions=((4, 9),)),  # longer than max_new_tokens
        prefix(1, versions=((4, 1),)),  # versions cover 1 token of 2
        prefix(1, versions=((4, 1), (4, 1))),  # two runs of one version
        prefix(1, versions=((6, 2),)),  # a version not published yet
        prefix(2, versions=((1, 2),)),  # stale at version 4 with S = 2
        prefix(0, ids=(9,), lps=(-0.1,), versions=((4, 1),)),  # a second prefix for sample 0
    ]
    kept = check_prefixes(group(), [good, *hostile], 4, LIM, refused)
    assert kept == [good]
    assert refused == Counter(
        {
            "bad_sample_idx": 1,
            "out_of_vocab": 1,
            "bad_logprob": 1,
            "bad_length": 1,
            "bad_versions": 2,
            "future_version": 1,
            "stale": 1,
            "duplicate_sample": 1,
        }
    )


def test_a_second_handback_must_extend_the_first_prefix():
    first = prefix(0, ids=(5, 6), versions=((3, 2),))
    g = group(prefixes=[first])
    longer = prefix(0, ids=(5, 6, 7), lps=(-0.5, -1.0, -0.2), versions=((3, 2), (4, 1)))
    rewritten = prefix(0, ids=(9, 6, 7), lps=(-0.5, -1.0, -0.2), versions=((3, 2), (4, 1)))
    refused: Counter = Counter()
    assert check_prefixes(g, [longer], 4, LIM, refused) == [longer]
    assert check_prefixes(g, [rewritten], 4, LIM, refused) == [first]  # the earlier one stays
    assert refused == Counter({"prefix_mismatch": 1})


def test_record_versions_are_runs_from_the_oldest_token():
    lim = Limits(vocab_size=100, max_new_tokens=8, group_size=2)
    rec = {
        "group_id": "g",
        "sample_idx": 0,
        "prompt_ids": [1],
        "completion_ids": [5, 6, 7],
        "logprobs": [-1.0, -0.5, -0.1],
        "reward": 1.0,
        "version": 3,
        "worker_id": "w",
        "gen_s": 0.1,
    }
    ok = parse_record({**rec, "versions": [[3, 2], [4, 1]]}, lim)
    assert ok.versions == [[3, 2], [4, 1]] and expand(ok.versions) == [3, 3, 4]
    for bad in ([[4, 2], [5, 1]], [[3, 2]], [[3, 2], [3, 1]], [[3, 0], [4, 3]], "x", [[3, 1.5]]):
        with pytest.raises(RecordError) as err:
            parse_record({**rec, "versions": bad}, lim)
        assert err.value.reason == "bad_versions"


def test_worker_versions_append_its_own_run_to_the_prefix():
    cont = Sample([5, 6, 7, 8], [-1.0] * 4, prefix_len=2, prefix_versions=[[3, 2]])
    assert runs(cont, 5) == [[3, 2], [5, 2]]
    assert versions(cont, 5) == {"version": 3, "versions": [[3, 2], [5, 2]]}
    same = Sample([5, 6, 7], [-1.0] * 3, prefix_len=2, prefix_versions=[[5, 2]])
    assert versions(same, 5) == {"version": 5}
    assert versions(Sample([1, 2], [-0.1, -0.2]), 4) == {"version": 4}


# ----------------------------------------------------------------------------- learner intake


@pytest.fixture
def intake(tmp_path):
    prompts = (Prompt([1, 2], {"i": i}) for i in itertools.count())
    work = WorkQueue(prompts, group_size=2, max_outstanding=8, lease_timeout_s=60, prefix="r")
    buffer = ReplayBuffer(staleness=2, capacity_groups=8, group_size=2)
    buffer.set_version(4)
    audits = []
    rep = Reputation(tmp_path, 2, lambda: 0)
    it = Intake(
        limits=Limits(100, 8, 2),
        buffer=buffer,
        work=work,
        reputation=rep,
        checks=IntakeChecks(audit=audits.append, audit_rate=1.0),
    )
    return it, work, buffer, audits


def _record(gid, i, ids, lps, version, versions=None, worker="B"):
    rec = {
        "group_id": gid,
        "sample_idx": i,
        "prompt_ids": [1, 2],
        "completion_ids": ids,
        "logprobs": lps,
        "reward": 0.5,
        "version": version,
        "worker_id": worker,
        "gen_s": 0.1,
    }
    return {**rec, **({"versions": versions} if versions else {})}


def test_a_continued_group_is_admitted_and_audited_on_the_continuers_tokens(intake):
    it, work, buffer, audits = intake
    (g,) = work.grant("A", 1, 0)
    cut = prefix(0, ids=(5, 6), lps=(-0.5, -1.0), versions=((3, 2),))
    work.hand_back(g.group_id, [cut])
    (again,) = work.grant("B", 1, 0)
    assert again.group_id == g.group_id and again.prefixes == [cut]
    out = it.batch(
        "B",
        "kB",
        [
            _record(g.group_id, 0, [5, 6, 7], [-0.5, -1.0, -0.3], 3, [[3, 2], [4, 1]]),
            _record(g.group_id, 1, [8, 9], [-0.2, -0.4], 4),
        ],
    )
    assert len(out.accepted) == 2 and not out.rejected
    (job,) = audits
    assert job.version == 4  # B's own snapshot, not the prefix's
    assert job.records[0].loss_mask == [0, 0, 1]  # A's tokens are not B's to answer for
    assert buffer.take(1, 0.1)[0][0].version == 3  # the staleness rule sees the oldest token


def test_a_continuer_that_rewrites_the_prefix_is_refused_with_a_strike(intake):
    it, work, buffer, audits = intake
    (g,) = work.grant("A", 1, 0)
    work.hand_back(g.group_id, [prefix(0, ids=(5, 6), lps=(-0.5, -1.0), versions=((3, 2),))])
    work.grant("B", 1, 0)
    forged = [
        _record(g.group_id, 0, [5, 7, 7], [-0.5, -1.0, -0.3], 3, [[3, 2], [4, 1]]),
        _record(g.group_id, 1, [8, 9], [-0.2, -0.4], 4),
    ]
    out = it.batch("B", "kB", forged)
    assert out.rejected == Counter({"prefix_mismatch": 2}) and not out.accepted
    assert it.reputation.strikes["B"] == 1
    assert work.holder(g.group_id) == "B"  # still leased: B may deliver the honest group


def test_a_stale_continuation_is_generated_again_from_scratch(intake):
    it, work, buffer, audits = intake
    (g,) = work.grant("A", 1, 0)
    work.hand_back(g.group_id, [prefix(0, ids=(5,), lps=(-0.5,), versions=((2, 1),))])
    work.grant("B", 1, 0)
    buffer.set_version(5)  # the prefix's version 2 is now out of the window
    out = it.batch(
        "B",
        "kB",
        [
            _record(g.group_id, 0, [5, 6], [-0.5, -0.1], 2, [[2, 1], [5, 1]]),
            _record(g.group_id, 1, [8], [-0.2], 5),
        ],
    )
    assert [r.sample_idx for r in out.accepted] == [1] and buffer.stats.dropped_stale == 1
    (fresh,) = work.grant("C", 1, 0)
    assert fresh.group_id == g.group_id and fresh.prefixes == []


# ----------------------------------------------------------------------------- the backend


@pytest.fixture(scope="module")
def backend():
    from echo_rl.core.config import ModelConfig
    from echo_rl.worker.backends.transformers import TransformersBackend

    return TransformersBackend(ModelConfig(max_positions=128), threads=1)


def test_backend_continues_prefixes_within_the_budget_that_is_left(backend):
    eos = backend.tokenizer.eos_token_id
    done = wire.Prefix(sample_idx=2, ids=[7, eos], logprobs=[-0.1, -0.2], versions=[[1, 2]])
    cut = wire.Prefix(sample_idx=0, ids=[7, 8, 9], logprobs=[-0.1, -0.2, -0.3], versions=[[1, 3]])
    g = wire.Group(group_id="g", prompt_ids=[3, 4], n=3, seed=1, prefixes=[cut, done])
    (samples,) = backend.generate([g], 6, 1.0)
    first, fresh, finished = samples
    assert first.completion_ids[:3] == [7, 8, 9] and first.prefix_len == 3
    assert first.logprobs[:3] == [-0.1, -0.2, -0.3] and len(first.completion_ids) <= 6
    assert first.prefix_versions == [[1, 3]] and first.finished
    assert fresh.prefix_len == 0 and 1 <= len(fresh.completion_ids) <= 6
    assert finished.completion_ids == [7, eos] and finished.prefix_len == 2  # nothing to add


def test_a_stop_cuts_every_unfinished_sample_at_the_next_token(backend):
    stop = threading.Event()
    stop.set()
    g = wire.Group(group_id="g", prompt_ids=[3, 4], n=4, seed=2)
    before = backend.tokens_sampled
    (samples,) = backend.generate([g], 50, 1.0, stop=stop)
    eos = backend.tokenizer.eos_token_id
    assert all(len(s.completion_ids) == 1 for s in samples)
    assert all(s.finished == (s.completion_ids == [eos]) for s in samples)
    assert backend.tokens_sampled - before == 4


# ----------------------------------------------------------------------------- multi-turn


def test_a_cut_episode_is_replayed_at_its_turn_boundary_and_ends_as_if_never_cut():
    """Poker episodes cut after two rounds of decisions are handed back as their decisions;
    another worker replays them in the environment and plays on: the transcripts, masks and
    rewards are those of an uncut run, and the record passes the intake's prefix check."""
    import random

    from echo_rl.adapters.poker.adapter import PokerAdapter
    from echo_rl.control.intake import own_tokens
    from echo_rl.data.episodes import Cut
    from echo_rl.data.testing import build_chatml_char_tokenizer
    from echo_rl.worker.records import cut_episodes, episode_versions

    tok = build_chatml_char_tokenizer()
    ad = PokerAdapter({"bot_samples": 6, "obs_format": "compact", "opponents": ["station"]}, tok)
    task = next(ad.prompts(random.Random(3))).task
    g = wire.Group(group_id="g", prompt_ids=[1], n=3, seed=11, task=task)
    act = {a: tok.encode(a, add_special_tokens=False) + [tok.eos_token_id] for a in "cb"}

    def scripted(cut_after=None):
        calls = itertools.count()

        def generate(prompts):
            k = next(calls)
            if cut_after is not None and k >= cut_after:
                raise Cut()
            # a deterministic policy: raise on even calls, call on odd ones
            return [(act["b" if (k + len(p)) % 2 else "c"], [-0.5] * 2) for p in prompts]

        return generate

    whole = ad.rollout([g], scripted())[0]
    with pytest.raises(Cut) as cut:
        ad.rollout([g], scripted(cut_after=2))
    (cut_samples,) = [[s for s, _ in row] for row in cut_episodes([g], cut.value.decisions)]
    prefixes = [
        wire.Prefix(
            sample_idx=i,
            ids=s.completion_ids,
            logprobs=s.logprobs,
            versions=[[3, len(s.completion_ids)]],
            turns=s.turns,
        )
        for i, s in enumerate(cut_samples)
        if s.completion_ids
    ]
    assert prefixes and all(len(p.turns) >= 1 for p in prefixes)
    assert (
        check_prefixes(
            g, prefixes, 4, PrefixLimits(10_000, 4096, -1e4, 2, multi_turn=True), Counter()
        )
        == prefixes
    )
    cont = g.model_copy(update={"prefixes": prefixes})
    # the continuing worker's policy differs (it only calls): replayed decisions come first
    resumed = ad.rollout([cont], lambda ps: [(act["c"], [-0.1] * 2) for _ in ps])[0]
    for p in prefixes:
        s = resumed[p.sample_idx]
        mine = [t for t, m in zip(s.completion_ids, s.loss_mask) if m]
        assert mine[: len(p.ids)] == p.ids  # the decisions made before the cut, unchanged
        full = whole[p.sample_idx]
        if len(p.turns) == sum(1 for h in full.info["log"]["hands"] for _ in h["turns"]):
            assert s.completion_ids == full.completion_ids and s.reward == full.reward
        v = episode_versions(s.loss_mask, p, 5)  # the continuing worker holds version 5
        rec = _record("g", p.sample_idx, s.completion_ids, s.logprobs, v["version"])
        assert v["version"] == 3 and v["versions"][0][0] == 3
        rec = parse_record({**rec, "loss_mask": s.loss_mask, **v}, Limits(10_000, 4096, 3))
        assert intake_continues(cont, rec)
        (masked,), at = own_tokens([rec], {p.sample_idx: len(p.ids)})
        assert at == 5 and sum(masked.loss_mask) == sum(s.loss_mask) - len(p.ids)


def intake_continues(group, rec) -> bool:
    return Intake._continues(None, group, rec)
