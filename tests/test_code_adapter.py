"""The code adapter (echo_rl/adapters/code.py) and the expensive-reward audits off the learner's step
(echo_rl/control/reward_audit.py; docs/scheduling.md, "A reward pool")."""

import itertools
import random
import threading

import pytest

from echo_rl.adapters.code import TASKS, CodeAdapter
from echo_rl.control.intake import Intake, IntakeChecks
from echo_rl.control.reputation import Reputation, Verdict
from echo_rl.control.reward_audit import RewardAuditor, RewardJob
from echo_rl.control.work import WorkQueue
from echo_rl.data.adapter import AdapterError, Prompt
from echo_rl.data.buffer import ReplayBuffer
from echo_rl.data.records import Limits, Record

pytestmark = pytest.mark.timeout(120)

# A right body for each task family (the test's reference, not the adapter's).
RIGHT = {
    "linear": lambda t: "    return x * {a} + ({b})\n".format(**_consts(t)),
    "digit_sum": lambda t: "    return sum(int(d) for d in str(x))\n",
    "count_char": lambda t: f"    return x.count({_quoted(t)})\n",
    "reverse": lambda t: "    return list(reversed(x))\n",
    "spread": lambda t: "    return max(x) - min(x)\n",
    "divisible": lambda t: "    return x % {k} == 0\n".format(**_consts(t)),
    "clamp": lambda t: "    return min(max(x, {lo}), {hi})\n".format(**_consts(t)),
    "squares": lambda t: "    return sum(i * i for i in range(1, x + 1))\n",
    "vowels": lambda t: "    return sum(c in 'aeiou' for c in x)\n",
}


def _consts(task):
    """The constants, read back from the header the policy sees."""
    import re

    doc = task["header"]
    nums = [int(n) for n in re.findall(r"-?\d+", doc)]
    if task["kind"] == "linear":
        return {"a": nums[0], "b": nums[1]}
    if task["kind"] == "divisible":
        return {"k": nums[0]}
    return {"lo": nums[0], "hi": nums[1]}


def _quoted(task):
    return repr(task["header"].split("'")[1])


@pytest.fixture(scope="module")
def adapter(tokenizer):
    return CodeAdapter({"calls": 4}, tokenizer)


def test_every_task_family_scores_a_right_body_1_and_a_wrong_one_0(adapter):
    rng = random.Random(0)
    seen = set()
    for p in itertools.islice(adapter.prompts(rng), 200):
        kind = p.task["kind"]
        if kind in seen:
            continue
        seen.add(kind)
        assert p.prompt_ids and p.task["header"].startswith("def f(x):")
        right = RIGHT[kind](p.task)
        assert adapter.reward(p.task, [], right) == 1.0, (kind, right)
        assert adapter.reward(p.task, [], "    return None\n") == 0.0
        assert adapter.reward(p.task, [], "    while True: pass\n") == 0.0
    p = next(q for q in adapter.prompts(rng) if q.task["kind"] == "divisible")
    wrong_type = "    return int(x % {k} == 0)\n".format(**_consts(p.task))  # 1/0, not True/False
    assert adapter.reward(p.task, [], wrong_type) == 0.0
    assert seen == set(TASKS)


def test_a_program_that_prints_the_answers_earns_nothing(adapter):
    p = next(adapter.prompts(random.Random(1)))
    claim = '{"results": ' + repr(p.task["expected"]).replace("'", '"') + ', "status": "ok"}'
    body = f"    pass\nprint({claim!r})\nimport os\nos._exit(0)\n"
    assert adapter.reward(p.task, [], body) == 0.0


def test_chat_prompts_run_the_reply_s_code_block(tokenizer):
    """prompt = "chat": the task goes through the chat template; the reply's first fenced
    block (or the whole reply) is the program, and it must define f itself."""
    chat = CodeAdapter({"prompt": "chat", "tasks": ["reverse"]}, tokenizer)
    p = next(chat.prompts(random.Random(0)))
    assert p.task["chat"] and p.prompt_ids != tokenizer.encode(p.task["header"])
    reply = "Here it is:\n```python\ndef f(x):\n    return x[::-1]\n```\nIt reverses x."
    assert chat.reward(p.task, [], reply) == 1.0
    assert chat.reward(p.task, [], "def f(x):\n    return x[::-1]\n") == 1.0  # no fence
    assert chat.reward(p.task, [], "```python\n    return x[::-1]\n```") == 0.0  # no def f


def test_bad_options_are_refused_naming_them(tokenizer):
    with pytest.raises(AdapterError, match="unknown option"):
        CodeAdapter({"timeout": 3}, tokenizer)
    with pytest.raises(AdapterError, match="tasks"):
        CodeAdapter({"tasks": ["sorting"]}, tokenizer)
    with pytest.raises(AdapterError, match="prompt"):
        CodeAdapter({"prompt": "json"}, tokenizer)
    with pytest.raises(AdapterError, match="sandbox_network"):
        CodeAdapter({"sandbox_network": "yes"}, tokenizer)


# ------------------------------------------------------------ rewards audited off the step


class FakeExpensive:
    """An adapter whose reward is expensive: it counts its calls; ``flaky`` answers differ."""

    recomputes_rewards = True
    expensive_reward = True

    def __init__(self, tokenizer, flaky=False):
        self.tokenizer, self.flaky, self.calls = tokenizer, flaky, 0
        self._rng = random.Random(0)
        self.gate = threading.Event()  # a reward is computed only once this is set
        self.gate.set()

    def reward(self, task, ids, text):
        assert self.gate.wait(30)
        self.calls += 1
        return self._rng.random() if self.flaky else float(len(ids) % 2)


def _recs(gid, rewards, worker="w"):
    return [
        Record(
            group_id=gid,
            sample_idx=i,
            prompt_ids=[1, 2],
            completion_ids=[5] * (i + 1),
            logprobs=[-0.5] * (i + 1),
            reward=r,
            version=0,
            worker_id=worker,
            gen_s=0.1,
        )
        for i, r in enumerate(rewards)
    ]


def test_a_misreported_reward_is_a_strike_an_honest_one_is_not(tmp_path, tokenizer):
    rep = Reputation(tmp_path, 3, lambda: 0)
    audit = RewardAuditor(FakeExpensive(tokenizer), 8, rep.record)
    assert audit.check(RewardJob("w", "k", {}, _recs("g1", [1.0, 0.0]), False))
    assert not audit.check(RewardJob("w", "k", {}, _recs("g2", [1.0, 1.0]), False))
    assert rep.strikes["w"] == 1 and audit.failed == 1 and audit.audited == 2


def test_a_reward_that_changes_between_recomputes_blames_nobody(tmp_path, tokenizer):
    rep = Reputation(tmp_path, 1, lambda: 0)
    audit = RewardAuditor(FakeExpensive(tokenizer, flaky=True), 8, rep.record)
    assert audit.check(RewardJob("w", "k", {}, _recs("g", [0.5, 0.5]), False))
    assert rep.strikes["w"] == 0 and audit.nondeterministic == 2


def test_the_queue_is_bounded_and_keeps_probation_jobs(tmp_path, tokenizer):
    rep = Reputation(tmp_path, 3, lambda: 0)
    audit = RewardAuditor(FakeExpensive(tokenizer), 2, rep.record)  # not started: jobs wait
    audit.submit(RewardJob("w", "k", {}, _recs("p", [1.0]), True))
    for i in range(3):
        audit.submit(RewardJob("w", "k", {}, _recs(f"g{i}", [1.0]), False))
    assert audit.waiting == 2 and audit.dropped == 2
    assert [j.records[0].group_id for j in audit._jobs] == ["p", "g2"]


def test_intake_admits_at_once_and_the_thread_strikes_a_liar(tmp_path, tokenizer):
    """With an expensive reward the learner does not recompute inline: the lying group is
    admitted (the trade log-prob audits make too), and the auditor's thread strikes it."""
    fake = FakeExpensive(tokenizer)
    struck = threading.Event()
    rep = Reputation(tmp_path, 1, lambda: 0)

    def record(v: Verdict) -> None:
        if rep.record(v) is not None:  # the worker's quarantine, for its caller to carry out
            struck.set()

    auditor = RewardAuditor(fake, 8, record)
    prompts = (Prompt([1, 2], {"i": i}) for i in itertools.count())
    work = WorkQueue(prompts, group_size=2, max_outstanding=8, lease_timeout_s=60, prefix="r")
    buffer = ReplayBuffer(staleness=2, capacity_groups=8, group_size=2)
    intake = Intake(
        limits=Limits(100, 8, 2),
        buffer=buffer,
        work=work,
        reputation=rep,
        checks=IntakeChecks(adapter=fake, reward_audit=auditor, reward_audit_rate=1.0),
    )
    (g,) = work.grant("w", 1, 0)
    raw = [r.to_wire() for r in _recs(g.group_id, [1.0, 1.0])]  # sample 1's is 0.0: a lie
    fake.gate.clear()  # a recompute would block: intake must not make one
    auditor.start()
    try:
        out = intake.batch("w", "k", raw)
        assert len(out.accepted) == 2 and fake.calls == 0 and auditor.waiting + 1 >= 1
        fake.gate.set()
        assert struck.wait(30)  # the thread found the lie and quarantined (1 strike)
    finally:
        auditor.close()
    assert auditor.failed == 1 and "w" in rep.quarantined


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_code_example_runs_and_checks_a_sample_of_rewards_off_the_step(tmp_path):
    """docs/scheduling.md's command, shortened: the learner admits every group and rechecks
    only the probation groups and a share of the rest (its step rows say how many)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    run = tmp_path / "run"
    argv = [
        sys.executable, "-m", "echo_rl.cli.rl", "quickstart", "--config", "examples/code.toml",
        "--run-dir", str(run), "--workers", "2", "--set", "learner.max_steps=4",
    ]  # fmt: skip
    subprocess.run(argv, cwd=root, check=True, stdout=subprocess.DEVNULL, timeout=280)
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x]
    assert len(rows) == 4
    audit = rows[-1]["reward_audit"]
    assert audit["audited"] >= 1 and audit["failed"] == 0  # honest workers: no strike
    # a sample: the 8 groups of the two workers' probation and about 10 % of the rest, not all
    assert audit["audited"] + audit["waiting"] < rows[-1]["admitted"] // 8
