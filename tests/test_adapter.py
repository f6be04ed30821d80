import pytest

from echo_rl.adapters.toy_add import ToyAddAdapter
from echo_rl.data.adapter import AdapterError, load_adapter
from echo_rl.data.records import Record


def test_toy_prompts_and_rewards(tokenizer, rng):
    ad = load_adapter("toy-add", {"max_sum": 9}, tokenizer)
    p = next(ad.prompts(rng))
    text = tokenizer.decode(p.prompt_ids)
    a, b = int(text[0]), int(text[2])
    assert text.endswith("=") and a + b == p.task["answer"] <= 9
    digit = lambda d: tokenizer.convert_tokens_to_ids(str(d))  # noqa: E731
    eos = tokenizer.eos_token_id
    ans = p.task["answer"]
    assert ad.reward(p.task, [digit(ans), eos], "") == 1.0
    assert ad.reward(p.task, [digit(ans), digit(ans)], "") == 0.5  # never ends
    assert ad.reward(p.task, [digit(ans), digit(ans), eos], "") == 0.75  # ends one token late
    assert ad.reward(p.task, [digit(ans), digit(ans), digit(ans), eos], "") == pytest.approx(
        0.5 + 0.5 / 3
    )
    assert ad.reward(p.task, [digit((ans + 1) % 10), eos], "") == 0.1
    assert ad.reward(p.task, [eos], "") == 0.0


def test_bad_adapter_options_and_names(tokenizer):
    with pytest.raises(AdapterError, match="max_sum"):
        ToyAddAdapter({"max_sum": 12}, tokenizer)
    with pytest.raises(AdapterError, match="unknown option"):
        ToyAddAdapter({"colour": 1}, tokenizer)
    with pytest.raises(AdapterError, match="not found.*toy-add"):
        load_adapter("no-such-task", {}, tokenizer)


def test_materialise_aligns_masks_with_next_token_targets(tokenizer):
    ad = ToyAddAdapter({}, tokenizer)
    recs = [
        Record(
            "g", i, [4, 14, 5, 17], comp, [-0.1 * (j + 1) for j in range(len(comp))], reward, 0, "w"
        )
        for i, (comp, reward) in enumerate([([11, 1], 1.0), ([12], 0.0)])
    ]
    b = ad.materialise([recs])
    assert b.input_ids.tolist() == [[4, 14, 5, 17, 11, 1], [4, 14, 5, 17, 12, 0]]
    # position j predicts token j+1: completion tokens at 4..5 are predicted from 3..4
    assert b.loss_mask.tolist() == [[0, 0, 0, 1, 1], [0, 0, 0, 1, 0]]
    assert b.behaviour_logprobs[0, 3:].tolist() == pytest.approx([-0.1, -0.2])
    assert b.advantages[0] > 0 > b.advantages[1]
    assert b.attention_mask[1].tolist() == [1, 1, 1, 1, 1, 0]
