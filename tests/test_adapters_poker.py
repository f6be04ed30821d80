"""Poker sandbox and the Appendix D pipeline: raw logs -> messages -> ids -> turn indices ->
assistant masks (next-token aligned) -> returns -> group-normalised advantages."""

import math
import random
from types import SimpleNamespace as Group

import pytest

from echo_rl.adapters.poker import PokerAdapter
from echo_rl.adapters.poker.game import (
    Action,
    TableConfig,
    fresh_deck,
    legalise,
    parse_action,
    play_hand,
)
from echo_rl.adapters.poker.pipeline import (
    log_messages,
    read_logs,
    records_from_logs,
    sample_from_log,
    simulate_logs,
    write_logs,
)
from echo_rl.adapters.poker.players import CallingStation, Maniac, TightAggressive, chen_score
from echo_rl.data.adapter import AdapterError, check_adapter
from echo_rl.data.advantages import group_advantages
from echo_rl.data.episodes import EpisodeRecord, backend_generate_fn, drive, token_advantages
from echo_rl.data.multiturn import ChatBuilder, ChatFormat, target_mask, turn_indices
from echo_rl.data.records import Limits, parse_record
from echo_rl.data.testing import build_chatml_char_tokenizer

FAST = {"bot_samples": 6}


@pytest.fixture(scope="module")
def chatml():
    return build_chatml_char_tokenizer()


def scripted(tok, text):
    """A generate() that always answers ``text`` (then end-of-turn), counting its calls."""
    ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]

    def generate(prompts):
        generate.calls.append(len(prompts))
        return [(list(ids), [-0.25] * len(ids)) for _ in prompts]

    generate.calls = []
    generate.max_new_tokens = len(ids)
    return generate


def run_hand(players, seed, cfg=TableConfig()):
    g = play_hand(players, seed, cfg)
    try:
        next(g)
    except StopIteration as stop:
        return stop.value
    raise AssertionError("no external seat, yet the hand yielded")


# ----------------------------------------------------------------------------- the sandbox


@pytest.mark.parametrize(
    "text,action",
    [
        ("Action: Call", Action("call")),
        ("action: raise 40", Action("raise", 40)),
        ("I think... Action: Bet 12 chips", Action("raise", 12)),
        ("<think>fold? no</think>Action: All-in", Action("allin")),
        ("Fold.", Action("fold")),
        ("check", Action("check")),
        ("b12", Action("raise", 12)),
        ("c", Action("call")),
        ("f", Action("fold")),
        ("a", Action("allin")),
        ("Action: Raise", None),
        ("I will think about it", None),
        ("", None),
    ],
)
def test_parse_action(text, action):
    assert parse_action(text) == action


def test_legalise_folds_invalid_text_and_clamps_sizes():
    from echo_rl.adapters.poker.game import Decision

    d = Decision(1, 0, "big blind", ("Ah", "Kd"), (), "preflop", 6, 2, 196, 2, 8, 198, [], [], 2)
    assert legalise(None, d) == (Action("fold"), True)  # unparseable: fold, invalid
    assert legalise(Action("check"), d) == (Action("fold"), True)  # check facing a bet
    assert legalise(Action("raise", 3), d) == (Action("raise", 8), False)  # clamped up
    assert legalise(Action("raise", 999), d) == (Action("raise", 198), False)
    assert legalise(Action("allin"), d) == (Action("raise", 198), False)
    free = Decision(1, 0, "big blind", ("Ah", "Kd"), (), "flop", 4, 0, 198, 0, 2, 198, [], [], 2)
    assert legalise(None, free) == (Action("check"), True)
    assert legalise(Action("fold"), free) == (Action("check"), False)  # a free fold checks


@pytest.mark.parametrize("seats", [2, 3, 6])
def test_hands_are_zero_sum_and_deltas_add_up(seats):
    cfg = TableConfig(seats=seats)
    kinds = [TightAggressive, CallingStation, Maniac]
    for seed in range(6):
        players = [kinds[i % 3](seed=seed + i, samples=6) for i in range(seats)]
        r = run_hand(players, seed, cfg)
        assert sum(r.net) == 0
        for i in range(seats):
            if r.logs[i]:
                assert sum(t.chip_delta for t in r.logs[i]) == r.net[i]
        assert sum(r.invalid) == 0


def test_deals_are_a_function_of_the_seed():
    assert fresh_deck(3) == fresh_deck(3) != fresh_deck(4)
    a = run_hand([CallingStation(samples=6), CallingStation(samples=6)], 11)
    b = run_hand([CallingStation(samples=6), CallingStation(samples=6)], 11)
    assert a.board == b.board and a.shown == b.shown and a.net == b.net


def test_three_rule_based_styles_differ():
    from echo_rl.adapters.poker.game import Decision

    weak = Decision(
        1,
        0,
        "big blind",
        ("7c", "2d"),
        (),
        "preflop",
        10,
        6,
        196,
        2,
        10,
        198,
        [(1, 192, 8, False)],
        [],
        2,
    )
    assert chen_score(("As", "Ah")) == 20 and chen_score(("7c", "2d")) < 2
    assert TightAggressive(samples=6).act(weak) == "Action: Fold"
    assert CallingStation(samples=6).act(weak) == "Action: Call"
    strong = Decision(
        1,
        0,
        "big blind",
        ("As", "Ah"),
        (),
        "preflop",
        10,
        6,
        196,
        2,
        10,
        198,
        [(1, 192, 8, False)],
        [],
        2,
    )
    assert TightAggressive(samples=6).act(strong).startswith("Action: Raise")
    m = Maniac(seed=1, samples=6)
    picks = {m.act(weak) for _ in range(40)}
    assert len(picks) >= 4 and m.last_logprob == pytest.approx(-math.log(5))


# ----------------------------------------------------------------------------- hand-built log

LOG = {
    "system": "Rules.",
    "seat": 0,
    "player": "tag",
    "hands": [
        {
            "turns": [
                {
                    "observation": "Hand: [Ah, Kd], Pot: 3",
                    "action": "Action: Call",
                    "chip_delta": -2,
                    "invalid": False,
                    "logprob": 0.0,
                },
                {
                    "observation": "Board: [Qs, Th, 2c], Pot: 4",
                    "action": "Action: Bet 4",
                    "chip_delta": 8,
                    "invalid": False,
                    "logprob": -0.7,
                },
            ],
            "result": "You win 6 chips.",
            "net": 6,
            "invalid": 0,
        },
        {
            "turns": [
                {
                    "observation": "Hand: [7c, 2d], Pot: 3",
                    "action": "bogus",
                    "chip_delta": -1,
                    "invalid": True,
                    "logprob": 0.0,
                }
            ],
            "result": "You lose 1 chips.",
            "net": -1,
            "invalid": 1,
        },
    ],
}


def test_log_to_messages_to_masks_by_hand(chatml):
    msgs = log_messages(LOG)
    assert [m["role"] for m in msgs] == [
        "system",
        "user",
        "assistant",
        "user",
        "assistant",
        "user",
        "user",
        "assistant",
        "user",
    ]
    assert msgs[5]["content"] == "You win 6 chips."  # the reward message sits between turns
    prompt, s = sample_from_log(chatml, LOG)
    assert chatml.decode(prompt) == "<|im_start|>system\nRules.<|im_end|>\n"
    ids, mask = prompt + s.completion_ids, [0] * len(prompt) + s.loss_mask
    # the trained tokens are exactly the three actions with their end-of-turn tokens
    trained = chatml.decode([t for t, m in zip(ids, mask) if m])
    assert trained == "Action: Call<|im_end|>Action: Bet 4<|im_end|>bogus<|im_end|>"
    # turn index: the system turn is 1, then one per message; never trained outside assistant turns
    fmt = ChatFormat.learn(chatml)
    turns = turn_indices(ids, fmt.turn_start)
    assert turns[0] == 1 and max(turns) == len(msgs)
    roles = [m["role"] for m in msgs]
    assert all(roles[c - 1] == "assistant" for c, m in zip(turns, mask) if m)
    # no header token is trained: the token before every trained run is the header's "\n"
    starts = [j for j in range(1, len(mask)) if mask[j] and not mask[j - 1]]
    assert len(starts) == 3 and all(chatml.decode([ids[j - 1]]) == "\n" for j in starts)
    # return: net chips in big blinds (2 chips) minus one invalid-action penalty
    assert s.reward == pytest.approx((6 - 1) / 2 - 1.0)
    # the behaviour log-prob of an action sits on its first token
    assert [chatml.decode([s.completion_ids[j]]) for j, lp in enumerate(s.logprobs) if lp] == ["A"]


def test_materialise_aligns_masks_with_next_token_targets(chatml):
    prompt, s = sample_from_log(chatml, LOG)
    rec = EpisodeRecord(
        "g", 0, prompt, s.completion_ids, s.logprobs, s.reward, 0, "w", loss_mask=s.loss_mask
    )
    other = EpisodeRecord(
        "g",
        1,
        prompt,
        s.completion_ids[:50],
        s.logprobs[:50],
        0.0,
        0,
        "w",
        loss_mask=s.loss_mask[:50],
    )
    ad = PokerAdapter({**FAST}, chatml)
    b = ad.materialise([[rec, other]])
    token_mask = [0] * len(prompt) + s.loss_mask
    assert b.loss_mask[0].tolist() == target_mask(token_mask)  # position j predicts token j+1
    n = len(prompt) + 50
    assert b.attention_mask[1].tolist() == [1] * n + [0] * (b.input_ids.shape[1] - n)
    lp = b.behaviour_logprobs[0].tolist()
    assert [j for j, x in enumerate(lp) if x] == [
        j - 1 for j, x in enumerate(token_mask) if j >= len(prompt) and s.logprobs[j - len(prompt)]
    ]


def test_group_normalised_advantages_broadcast_to_assistant_tokens(chatml):
    prompt, s = sample_from_log(chatml, LOG)
    rewards = [[3.0, -1.0, 1.0, -3.0], [5.0, 5.0, 5.0, 5.0]]
    groups = [
        [
            EpisodeRecord(
                f"g{k}", i, prompt, s.completion_ids, s.logprobs, r, 0, "w", loss_mask=s.loss_mask
            )
            for i, r in enumerate(rs)
        ]
        for k, rs in enumerate(rewards)
    ]
    ad = PokerAdapter({**FAST}, chatml)
    b = ad.materialise(groups, adv_eps=1e-4)
    expect = group_advantages(rewards[0], 1e-4) + [0.0] * 4  # a tied group teaches nothing
    assert b.advantages.tolist() == pytest.approx(expect)
    tok_adv = token_advantages(b)
    assert (tok_adv[b.loss_mask == 0] == 0).all()
    assert tok_adv[0][b.loss_mask[0] == 1].tolist() == pytest.approx(
        [expect[0]] * int(b.loss_mask[0].sum())
    )
    # grouping across the whole batch instead
    ad_b = PokerAdapter({**FAST, "group_by": "batch"}, chatml)
    flat = [r for rs in rewards for r in rs]
    assert ad_b.materialise(groups).advantages.tolist() == pytest.approx(group_advantages(flat))


# ----------------------------------------------------------------------------- live episodes


def test_prompts_and_start_up_check(chatml, tokenizer):
    ad = PokerAdapter({**FAST}, chatml)
    check_adapter(ad, chatml, "poker")
    p = next(ad.prompts(random.Random(0)))
    assert chatml.decode(p.prompt_ids).startswith("<|im_start|>system\nYou are playing no-limit")
    assert set(p.task) == {"deal_seed", "hero_seat", "opponents"} and len(p.task["opponents"]) == 1
    tiny = PokerAdapter({**FAST, "obs_format": "compact", "seats": 3}, tokenizer)
    check_adapter(tiny, tokenizer, "poker")
    assert len(next(tiny.prompts(random.Random(0))).task["opponents"]) == 2


@pytest.mark.parametrize(
    "fmt,action", [("text", "Action: Call"), ("compact", "c"), ("strength", "c")]
)
def test_live_transcript_equals_the_log_pipeline(chatml, tokenizer, fmt, action):
    tok = chatml if fmt == "text" else tokenizer
    ad = PokerAdapter({**FAST, "obs_format": fmt, "hands": 2}, tok)
    task = {"deal_seed": 7, "hero_seat": 0, "opponents": ["station"]}
    gen = scripted(tok, action)
    (samples,) = ad.rollout([Group(task=task, n=2, seed=5)], gen)
    for s in samples:
        prompt, from_log = sample_from_log(tok, s.info["log"])
        assert prompt == ad.builder.start()
        assert from_log.completion_ids == s.completion_ids  # same ids, token for token
        assert from_log.loss_mask == s.loss_mask
        assert from_log.reward == pytest.approx(s.reward)
        trained = [lp for lp, m in zip(s.logprobs, s.loss_mask) if m]
        assert trained == [-0.25] * len(trained)  # generated log-probs kept on their ids
        assert all(lp == 0 for lp, m in zip(s.logprobs, s.loss_mask) if not m)
    # the two episodes (same deal, deterministic players) decided in lockstep: one call per round
    assert all(n == 2 for n in gen.calls)


def test_group_by_deal_shares_cards_random_does_not(chatml):
    task = {"deal_seed": 99, "hero_seat": 1, "opponents": ["maniac"]}
    boards = {}
    for mode in ("deal", "random"):
        ad = PokerAdapter({**FAST, "group_by": mode}, chatml)
        (samples,) = ad.rollout([Group(task=task, n=4, seed=1)], scripted(chatml, "Action: Call"))
        obs = [s.info["log"]["hands"][0]["turns"][0]["observation"] for s in samples]
        boards[mode] = {o.split("\n")[1].split(",")[0:2].__str__() for o in obs}
    assert len(boards["deal"]) == 1 and len(boards["random"]) > 1


def test_invalid_actions_fold_with_a_penalty_and_are_counted(chatml):
    ad = PokerAdapter({**FAST, "invalid_penalty": 2.5}, chatml)
    task = {"deal_seed": 3, "hero_seat": 0, "opponents": ["station"]}
    (samples,) = ad.rollout([Group(task=task, n=3, seed=0)], scripted(chatml, "I fold? maybe"))
    for s in samples:
        assert s.info["invalid"] == s.info["decisions"] >= 1
        assert s.reward == pytest.approx(s.info["net_chips"] / 2 - 2.5 * s.info["invalid"])
        turns = [t for h in s.info["log"]["hands"] for t in h["turns"]]
        assert all(t["invalid"] and t["action"] == "I fold? maybe" for t in turns)
    assert ad.stats["invalid_actions"] == sum(s.info["invalid"] for s in samples)


def test_strength_observations_hold_street_strength_and_the_bet_faced(tokenizer):
    import re

    ad = PokerAdapter({**FAST, "obs_format": "strength"}, tokenizer)
    task = {"deal_seed": 11, "hero_seat": 1, "opponents": ["station"]}
    (samples,) = ad.rollout([Group(task=task, n=1, seed=0)], scripted(tokenizer, "c"))
    turns = [t for h in samples[0].info["log"]["hands"] for t in h["turns"]]
    obs = [t["observation"] for t in turns]
    assert obs and all(re.fullmatch(r"[de][0-9][+=]", o) for o in obs)
    assert obs[0][0] == "d" and obs[0][2] == "+"  # the button faces the big blind preflop
    assert samples[0].info["invalid"] == 0


def test_an_episode_the_policy_never_acted_in_still_has_a_completion(tokenizer):
    """Without result notes, a hand the opponent folded before the policy's first turn left an
    empty transcript: admission refused it (bad_length) and struck the honest worker."""
    ad = PokerAdapter({**FAST, "obs_format": "strength", "show_results": False}, tokenizer)
    empty = None
    for seed in range(40):  # the tag opponent (button, first to act) folds most hands
        task = {"deal_seed": seed, "hero_seat": 0, "opponents": ["tag"]}
        (samples,) = ad.rollout([Group(task=task, n=1, seed=0)], scripted(tokenizer, "c"))
        if samples[0].info["decisions"] == 0:
            empty = samples[0]
            break
    assert empty is not None, "no deal where the opponent folded first"
    assert len(empty.completion_ids) >= 1 and not any(empty.loss_mask)
    assert empty.reward == pytest.approx(1 / 2)  # won the small blind: +1 chip = +0.5 bb


def test_episode_budget_forces_untrained_check_fold(chatml):
    ad = PokerAdapter({**FAST, "max_episode_tokens": 700, "max_decisions": 1}, chatml)
    task = {"deal_seed": 3, "hero_seat": 0, "opponents": ["station"]}
    (samples,) = ad.rollout([Group(task=task, n=2, seed=0)], scripted(chatml, "Action: Call"))
    for s in samples:
        assert len(s.completion_ids) <= 700
        assert s.info["decisions"] <= 1 or ad.stats["forced"] > 0
        assert len(s.completion_ids) == len(s.loss_mask) == len(s.logprobs)


def test_llm_opponent_is_a_frozen_policy_callable(chatml):
    seen = []

    def policy(messages):
        seen.append([m["role"] for m in messages])
        return "Action: Call"

    ad = PokerAdapter({**FAST, "opponents": ["llm"], "opponent_model": "unused"}, chatml)
    ad.set_llm_opponent(policy)
    task = {"deal_seed": 4, "hero_seat": 0, "opponents": ["llm"]}
    (samples,) = ad.rollout([Group(task=task, n=1, seed=0)], scripted(chatml, "Action: Check"))
    assert seen and all(r[0] == "system" and r[-1] == "user" for r in seen)
    assert all(r[1:] == ["user", "assistant"] * ((len(r) - 2) // 2) + ["user"] for r in seen)


# ----------------------------------------------------------------------------- off-policy data


def test_rule_based_logs_are_ingested_as_off_policy_records(chatml, tmp_path):
    logs = simulate_logs(["tag", "maniac"], episodes=3, seed=2, samples=6)
    assert len(logs) == 6 and {l["player"] for l in logs} == {"tag", "maniac"}  # noqa: E741
    write_logs(tmp_path / "logs.jsonl", logs)
    assert read_logs(tmp_path / "logs.jsonl") == logs
    groups = records_from_logs(chatml, logs, group_size=2)
    assert len(groups) == 3
    ad = PokerAdapter({**FAST}, chatml)
    b = ad.materialise(groups)
    assert b.loss_mask.sum() > 0 and b.input_ids.shape[0] == 6
    for k, (rec, lp) in enumerate(zip([r for g in groups for r in g], b.behaviour_logprobs)):
        log = logs[k]
        nonzero = [x for x in lp.tolist() if x]
        acted = any(h["turns"] for h in log["hands"])
        if log["player"] == "tag" or not acted:  # deterministic: probability 1 for its action
            assert nonzero == []
        else:  # the maniac's own probability, once per action
            assert len(nonzero) == sum(len(h["turns"]) for h in log["hands"])
            assert all(x < 0 for x in nonzero)
        assert (sum(rec.loss_mask) > 0) == acted
        # the records pass the learner's checks (loss_mask aside, which records.py must learn)
        wire = {k: v for k, v in rec.to_wire().items() if k != "loss_mask"}
        parse_record(wire, Limits(len(chatml), 1 << 16, 2))


def test_worker_can_mix_rule_based_stand_ins(chatml):
    ad = PokerAdapter({**FAST, "offpolicy_player": "maniac", "offpolicy_fraction": 1.0}, chatml)
    task = {"deal_seed": 8, "hero_seat": 0, "opponents": ["tag"]}
    gen = scripted(chatml, "Action: Call")
    (samples,) = ad.rollout([Group(task=task, n=3, seed=0)], gen)
    assert gen.calls == []  # nothing generated: the stand-in played
    for s in samples:
        assert s.info["offpolicy"] and sum(s.loss_mask) > 0
        firsts = [lp for lp in s.logprobs if lp]
        assert len(firsts) == s.info["decisions"]


# ----------------------------------------------------------------------------- with a model


def test_worker_path_to_a_learner_step(tokenizer, small_cfg):
    """What the worker will do (backend -> generate fn -> rollout -> records with loss_mask)
    and what the learner does with them (materialise -> one GRPO step), on the tiny model."""
    import torch

    from echo_rl.core.config import ModelConfig
    from echo_rl.learner.trainer import Trainer
    from echo_rl.worker.backends.transformers import TransformersBackend

    mc = ModelConfig(max_positions=512)
    backend = TransformersBackend(mc, threads=1)
    ad = PokerAdapter(
        {**FAST, "obs_format": "compact", "max_episode_tokens": 400}, backend.tokenizer
    )
    prompts = ad.prompts(random.Random(0))
    groups = [Group(task=next(prompts).task, n=4, seed=s) for s in range(2)]
    gen = backend_generate_fn(backend, max_new_tokens=4, temperature=1.0, seed=0)
    out = ad.rollout(groups, gen)
    prompt = ad.builder.start()
    recs = [
        [
            EpisodeRecord(
                f"g{k}",
                i,
                prompt,
                s.completion_ids,
                s.logprobs,
                s.reward,
                0,
                "w",
                loss_mask=s.loss_mask,
            )
            for i, s in enumerate(g)
        ]
        for k, g in enumerate(out)
    ]
    for g in recs:
        for r in g:
            assert 1 <= len(r.completion_ids) <= ad.max_completion_tokens
            assert all(x <= 0 for x in r.logprobs)
    batch = ad.materialise(recs, 1e-4)
    model = backend.model.train()
    trainer = Trainer(model, small_cfg.learner, seed=0)
    stats = trainer.step(batch)
    assert math.isfinite(stats["loss"]) and stats["is_weight_mean"] > 0
    # the generated tokens' behaviour log-probs match the model that generated them
    assert torch.isfinite(batch.behaviour_logprobs).all()


def test_chat_builder_refuses_templates_that_do_not_compose():
    from echo_rl.data.testing import build_chatml_char_tokenizer as build

    tok = build()
    tok.chat_template = (
        "{% for m in messages %}{% if loop.last %}LAST{% endif %}<|im_start|>"
        "{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    with pytest.raises(AdapterError):
        ChatBuilder(tok, "Rules.").user("hello")


def test_drive_runs_episodes_in_lockstep():
    def ep(k):
        got = []
        for _ in range(k):
            out = yield [k]
            got.append(out[0][0])
        from echo_rl.data.episodes import EpisodeSample

        return EpisodeSample(got, [0.0] * len(got), [1] * len(got), float(k))

    calls = []

    def gen(prompts):
        calls.append(len(prompts))
        return [([p[0] * 10], [-1.0]) for p in prompts]

    res = drive([ep(1), ep(3), ep(0)], gen)
    assert [r.completion_ids for r in res] == [[10], [30, 30, 30], []]
    assert calls == [2, 1, 1]


@pytest.mark.parametrize(
    "options, match",
    [
        ({"obs_format": "text", "answer_letters": "fcb"}, "letter obs_format"),
        ({"obs_format": "strength", "allin": False, "answer_letters": "fcba"}, "drop 'a'"),
        ({"obs_format": "strength", "answer_letters": "fcx"}, "distinct letters"),
        ({"obs_format": "strength", "answer_letters": "ff"}, "distinct letters"),
    ],
)
def test_bad_answer_letters_name_the_fix(options, match):
    from echo_rl.core.config import ModelConfig
    from echo_rl.core.models import load_tokenizer

    with pytest.raises(AdapterError, match=match):
        PokerAdapter(options, load_tokenizer(ModelConfig()))
