import json
import random
import threading
from pathlib import Path

import pytest

from echo_rl.adapters.math import MathAdapter
from echo_rl.adapters.mathcheck import MathChecker, as_fraction, extract_answer
from echo_rl.data.adapter import AdapterError, Prompt, check_adapter
from echo_rl.data.testing import build_chatml_char_tokenizer

DATA = Path(__file__).resolve().parents[1] / "examples" / "data"


@pytest.fixture(scope="module")
def chatml():
    return build_chatml_char_tokenizer()


@pytest.fixture(scope="module")
def checker():
    c = MathChecker(timeout_s=2)
    yield c
    c.close()


@pytest.mark.parametrize(
    "text,answer",
    [
        ("12+7=19", "19"),
        ("so the answer is \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),
        ("first \\boxed{a{b}c} then \\boxed{42}", "42"),
        ("we get 3-8=-5", "-5"),
        ("about 1,000 apples", "1,000"),
        ("it is 3 / 4", "3/4"),
        ("no answer here", None),
        ("\\boxed{", None),
    ],
)
def test_extract_answer(text, answer):
    assert extract_answer(text) == answer


def test_plain_numbers_compare_exactly_without_the_child():
    assert as_fraction("1,000") == 1000 and as_fraction("-3.50") == as_fraction("-7/2")
    assert as_fraction("x+1") is None and as_fraction("1/0") is None
    c = MathChecker()
    assert c.equal("19", "19.0") and not c.equal("19", "18")
    assert c.stats == {"fast": 2, "verified": 0, "timeouts": 0} and c._proc is None


def test_math_verify_runs_in_a_child_and_from_threads(checker):
    # signal-based timeouts only work in a main thread; the checker must work from any thread
    # (the worker scores in asyncio.to_thread).
    out = {}

    def score():
        out["half"] = checker.equal("\\frac{1}{2}", "0.5")
        out["sqrt"] = checker.equal("2\\sqrt{2}", "\\sqrt{8}")
        out["wrong"] = checker.equal("\\frac{1}{3}", "0.5")

    t = threading.Thread(target=score)
    t.start()
    t.join(60)
    assert out == {"half": True, "sqrt": True, "wrong": False}
    assert checker.stats["verified"] == 3 and checker.stats["timeouts"] == 0


def test_a_hung_check_is_bounded_and_the_checker_recovers(checker, monkeypatch):
    import os
    import signal

    checker.equal("\\pi", "\\pi")  # child started
    os.kill(checker._proc.pid, signal.SIGSTOP)  # the child hangs, as on a pathological input
    monkeypatch.setattr(type(checker), "call_budget_s", property(lambda self: 0.3))
    # scored as wrong; the counted timeout shows the budget ended the call (a call the budget
    # failed to bound would hang until pytest's timeout)
    assert checker.equal("\\pi", "\\pi") is False
    assert checker.stats["timeouts"] == 1 and checker._proc is None
    monkeypatch.undo()
    assert checker.equal("\\pi", "\\pi") is True  # a fresh child


def test_math_adapter_with_tiny_tokenizer(tokenizer, rng):
    ad = MathAdapter({"path": str(DATA / "arith.jsonl"), "format_reward": 0.1}, tokenizer)
    check_adapter(ad, tokenizer, "math")
    p = next(ad.prompts(rng))
    assert isinstance(p, Prompt) and all(type(t) is int for t in p.prompt_ids)
    text = tokenizer.decode(p.prompt_ids)
    assert text.startswith("<bos>") and text.endswith("<bos>a=")  # chat template + gen prompt
    ans = p.task["answer"]
    good = tokenizer.encode(ans, add_special_tokens=False) + [tokenizer.eos_token_id]
    assert ad.reward(p.task, good, tokenizer.decode(good, skip_special_tokens=True)) == 1.0
    assert ad.reward(p.task, [], f"{int(ans) + 1}") == 0.1
    assert ad.reward(p.task, [], "abc") == 0.0


def test_prompt_stream_depends_only_on_the_rng(tokenizer):
    ad = MathAdapter({"path": str(DATA / "arith.jsonl")}, tokenizer)
    a = [next(ad.prompts(random.Random(5))).prompt_ids for _ in range(3)]
    it1, it2 = ad.prompts(random.Random(7)), ad.prompts(random.Random(7))
    assert [next(it1).prompt_ids for _ in range(5)] == [next(it2).prompt_ids for _ in range(5)]
    assert a[0] == a[1] == a[2]


def test_word_problems_need_a_real_tokenizer(tokenizer, chatml, rng):
    with pytest.raises(AdapterError, match="cannot encode.*tiny-qwen3"):
        MathAdapter({"path": str(DATA / "arith_words.jsonl")}, tokenizer).items()
    ad = MathAdapter({"path": str(DATA / "arith_words.jsonl"), "system": "Be brief."}, chatml)
    p = next(ad.prompts(rng))
    text = chatml.decode(p.prompt_ids)
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n")
    assert text.endswith("<|im_start|>assistant\n")
    answer = f"Reasoning... so \\boxed{{{p.task['answer']}}}"
    assert ad.reward(p.task, [], answer) == 1.0


def test_options_and_data_errors(tokenizer, tmp_path):
    with pytest.raises(AdapterError, match="unknown option"):
        MathAdapter({"pth": "x"}, tokenizer)
    with pytest.raises(AdapterError, match="set options.path"):
        check_adapter(MathAdapter({}, tokenizer), tokenizer, "math")
    with pytest.raises(AdapterError, match="no such file"):
        MathAdapter({"path": str(tmp_path / "nope.jsonl")}, tokenizer).items()
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"q": "1+1=", "a": "2"}) + "\n")
    with pytest.raises(AdapterError, match="bad.jsonl:1.*question_key"):
        MathAdapter({"path": str(bad)}, tokenizer).items()
    ad = MathAdapter(
        {"path": str(bad), "question_key": "q", "answer_key": "a", "chat_template": False},
        tokenizer,
    )
    assert tokenizer.decode(next(ad.prompts(random.Random(0))).prompt_ids) == "1+1="


def test_shipped_data_is_what_the_generator_writes(tmp_path):
    import subprocess
    import sys

    subprocess.run(
        [sys.executable, str(DATA / "make_math.py"), "--out", str(tmp_path)],
        check=True,
        capture_output=True,
    )
    for name in ("arith.jsonl", "arith_words.jsonl"):
        assert (tmp_path / name).read_text() == (DATA / name).read_text()
    rows = [json.loads(x) for x in (DATA / "arith.jsonl").read_text().splitlines()]
    assert len(rows) == 400 and all(set(r["question"]) <= set("0123456789+-*=") for r in rows)
    assert all(str(eval(r["question"][:-1])) == r["answer"] for r in rows)


def test_chat_template_is_used_when_the_tokenizer_has_one(chatml):
    """Unset chat_template: the template if there is one, else the raw question; set to true
    without a template: an error saying how to fix it."""
    from echo_rl.data.testing import build_chatml_char_tokenizer

    bare = build_chatml_char_tokenizer()
    bare.chat_template = None
    opts = {"path": str(DATA / "arith.jsonl")}
    assert chatml.decode(MathAdapter(opts, chatml).encode("1+1=")).endswith(
        "<|im_start|>assistant\n"
    )
    assert bare.decode(MathAdapter(opts, bare).encode("1+1=")) == "1+1="
    with pytest.raises(AdapterError, match="no chat template.*chat_template = false"):
        MathAdapter({**opts, "chat_template": True}, bare)
