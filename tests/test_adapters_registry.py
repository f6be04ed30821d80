"""Adapters are found through the ``echo_rl.adapters`` entry-point group, and a bad one fails at
start-up with a message that says what to implement."""

import json
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

from echo_rl.data.adapter import AdapterError, load_adapter
from echo_rl.data.records import Record
from echo_rl.data.testing import write_entry_points

THIRD_PARTY = '''
import random
from echo_rl.data.adapter import Adapter, Prompt


class EchoTask(Adapter):
    """Reward 1 when the completion repeats the prompt's first token."""

    def prompts(self, rng: random.Random):
        while True:
            d = rng.randrange(10)
            yield Prompt(self.tokenizer.encode(f"{d}=", add_special_tokens=False), {"d": d})

    def reward(self, task, completion_ids, completion_text):
        return float(completion_text[:1] == str(task["d"]))
'''

BAD = """
import random
from echo_rl.data.adapter import Adapter, Prompt


class NoReward(Adapter):
    def prompts(self, rng):
        yield Prompt([5], {})


class NotAnAdapter:
    pass


class Base(Adapter):
    def reward(self, task, completion_ids, completion_text):
        return 0.0


class TuplePrompts(Base):
    def prompts(self, rng):
        while True:
            yield ([5, 6], {})


class TextIds(Base):
    def prompts(self, rng):
        while True:
            yield Prompt("12+7=", {})


class NumpyIds(Base):
    def prompts(self, rng):
        while True:
            yield Prompt([5.0, 6.0], {})


class HugeIds(Base):
    def prompts(self, rng):
        while True:
            yield Prompt([10**6], {})


class Finite(Base):
    def prompts(self, rng):
        return iter([])


class SetTask(Base):
    def prompts(self, rng):
        while True:
            yield Prompt([5], {"answers": {1, 2}})


from echo_rl.data.episodes import EpisodeAdapter


class NoEpisode(EpisodeAdapter):
    def prompts(self, rng):
        yield Prompt([5], {})


class BadInit(Base):
    def __init__(self, tokenizer):
        pass

    def prompts(self, rng):
        yield Prompt([5], {})


class BadOption(Base):
    def __init__(self, options, tokenizer):
        super().__init__(options, tokenizer)
        self.n = int(options.get("n", "three"))  # a ValueError, not an AdapterError

    def prompts(self, rng):
        yield Prompt([5], {})
"""


@pytest.fixture
def site(tmp_path, monkeypatch):
    site = tmp_path / "site"
    (site / "echo_thirdparty_demo").mkdir(parents=True)
    (site / "echo_thirdparty_demo" / "__init__.py").write_text(THIRD_PARTY)
    (site / "echo_bad_adapters.py").write_text(BAD)
    monkeypatch.syspath_prepend(str(site))
    return site


def test_third_party_adapter_is_found_through_its_entry_point(site, tokenizer, rng):
    with pytest.raises(AdapterError, match="not found"):
        load_adapter("echo-demo", {}, tokenizer)
    write_entry_points(site, "echo-thirdparty-demo", {"echo-demo": "echo_thirdparty_demo:EchoTask"})
    ad = load_adapter("echo-demo", {}, tokenizer)
    assert type(ad).__module__ == "echo_thirdparty_demo"
    p = next(ad.prompts(rng))
    assert ad.reward(p.task, [], str(p.task["d"])) == 1.0
    # the default materialise serves it: single-turn tasks need nothing more
    recs = [Record("g", i, p.prompt_ids, [5 + i], [-0.5], float(i), 0, "w") for i in range(2)]
    batch = ad.materialise([recs])
    assert batch.loss_mask.tolist() == [[0, 1], [0, 1]]


def test_an_adapter_in_the_old_entry_point_group_loads_with_a_deprecation_line(
    site, tokenizer, rng
):
    """Installed adapters registered before the package was renamed (group ``echo.adapters``)
    keep working; the warning names the adapter, its distribution and the group to move to.
    The current group wins where both name an adapter."""
    write_entry_points(
        site, "echo-old-demo", {"echo-demo": "echo_thirdparty_demo:EchoTask"}, group="echo.adapters"
    )
    with pytest.warns(FutureWarning, match=r"'echo-demo' \(echo-old-demo\).*echo_rl\.adapters"):
        ad = load_adapter("echo-demo", {}, tokenizer)
    assert type(ad).__module__ == "echo_thirdparty_demo"
    write_entry_points(site, "echo-new-demo", {"echo-demo": "echo_thirdparty_demo:EchoTask"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the current group's entry is taken: no warning
        assert type(load_adapter("echo-demo", {}, tokenizer)).__module__ == "echo_thirdparty_demo"


@pytest.mark.parametrize(
    "target,message",
    [
        (
            "echo_bad_adapters:NoReward",
            r"does not implement \['reward'\].*reward\(self, task, "
            r"completion_ids, completion_text\) -> float",
        ),
        ("echo_bad_adapters:NotAnAdapter", "not a subclass of echo_rl.data.adapter.Adapter"),
        ("echo_bad_adapters:Missing", "cannot import echo_bad_adapters:Missing"),
        ("no_such_module_xyz:Adapter", "cannot import no_such_module_xyz"),
        ("echo_bad_adapters:TuplePrompts", "yielded a tuple, expected echo_rl.data.adapter.Prompt"),
        ("echo_bad_adapters:TextIds", "prompt_ids must be a non-empty list of int"),
        ("echo_bad_adapters:NumpyIds", "prompt_ids must be a non-empty list of int"),
        ("echo_bad_adapters:HugeIds", "outside the tokenizer's vocabulary"),
        ("echo_bad_adapters:Finite", "yielded nothing; it must be an endless iterator"),
        ("echo_bad_adapters:SetTask", "task must travel to workers as msgpack"),
        ("echo_bad_adapters:BadInit", r"its __init__ must take \(options: dict, tokenizer\)"),
        (
            "echo_bad_adapters:BadOption",
            r"BadOption\(options, tokenizer\) failed \(ValueError: invalid "
            r"literal.*check the adapter's options \(\[adapter.options\], "
            r"\[adapter.presets.bad\]\)",
        ),
        (
            "echo_bad_adapters:NoEpisode",
            r"does not implement \['episode'\]: add episode\(self, task",
        ),
    ],
)
def test_bad_adapters_fail_at_start_up_saying_what_to_fix(site, tokenizer, target, message):
    write_entry_points(site, "echo-bad-adapters", {"bad": target})
    with pytest.raises(AdapterError, match=message):
        load_adapter("bad", {}, tokenizer)


def test_workers_can_skip_the_prompt_probe(site, tokenizer):
    # a worker never calls prompts() (and need not hold the data set)
    write_entry_points(site, "echo-bad-adapters", {"bad": "echo_bad_adapters:Finite"})
    assert load_adapter("bad", {}, tokenizer, check_prompts=False) is not None


@pytest.mark.parametrize(
    "name,target",
    [
        ("math", "echo_rl.adapters.math:MathAdapter"),
        ("poker", "echo_rl.adapters.poker:PokerAdapter"),
    ],
)
def test_in_repo_adapters_load_by_name(site, tokenizer, monkeypatch, name, target):
    # pyproject.toml declares these; a dist-info here makes the test independent of whether
    # the editable install was refreshed since.
    write_entry_points(site, "echo-inrepo-adapters", {name: target})
    options = {"math": {"path": "examples/data/arith.jsonl"}, "poker": {"obs_format": "compact"}}[
        name
    ]
    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    assert type(load_adapter(name, options, tokenizer)).__name__ == target.split(":")[1]


@pytest.mark.integration
def test_pip_installed_third_party_package(tmp_path, tokenizer):
    """The real thing: build and pip-install (offline, into a target folder) a package that
    declares an adapter, then find it from a fresh interpreter."""
    pkg = tmp_path / "pkg"
    (pkg / "echo_thirdparty_demo").mkdir(parents=True)
    (pkg / "echo_thirdparty_demo" / "__init__.py").write_text(THIRD_PARTY)
    (pkg / "pyproject.toml").write_text(
        textwrap.dedent("""
        [build-system]
        requires = ["setuptools>=68"]
        build-backend = "setuptools.build_meta"

        [project]
        name = "echo-thirdparty-demo"
        version = "0.1.0"

        [project.entry-points."echo_rl.adapters"]
        echo-demo = "echo_thirdparty_demo:EchoTask"

        [tool.setuptools]
        packages = ["echo_thirdparty_demo"]
    """)
    )
    target = tmp_path / "target"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-index",
            "--no-build-isolation",
            "--target",
            str(target),
            str(pkg),
        ],
        check=True,
        capture_output=True,
    )
    code = (
        "from echo_rl.data.adapter import load_adapter; from echo_rl.core.models import build_tiny_tokenizer;"
        "print(type(load_adapter('echo-demo', {}, build_tiny_tokenizer())).__name__)"
    )
    import os

    env = {**os.environ, "PYTHONPATH": str(target)}
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, env=env
    )
    assert out.stdout.strip() == "EchoTask"


MULTI_TURN = "takelast/"  # the multi-turn tutorial's files live under this folder


def tutorial_files(folder: str = "") -> dict[str, str]:
    """Code blocks of docs/adapters.md whose fence names a file (```python file=PATH): the
    single-turn tutorial's (no folder), or those under ``folder`` (the multi-turn one's,
    ``takelast/``), with paths relative to it."""
    import re

    doc = (Path(__file__).resolve().parents[1] / "docs" / "adapters.md").read_text()
    blocks = {
        m.group(1): m.group(2) for m in re.finditer(r"```\w+ file=(\S+)\n(.*?)```", doc, re.DOTALL)
    }
    if not folder:
        return {k: v for k, v in blocks.items() if not k.startswith(MULTI_TURN)}
    return {k[len(folder) :]: v for k, v in blocks.items() if k.startswith(folder)}


def test_the_tutorial_has_a_package_a_registration_and_a_config():
    files = tutorial_files()
    assert {"echo_sort/__init__.py", "pyproject.toml", "sort.toml"} <= set(files)
    assert "echo_rl.adapters" in files["pyproject.toml"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_tutorial_builds_installs_and_trains(tmp_path):
    """docs/adapters.md's tutorial, as a newcomer would use it: its blocks written out, the
    package pip-installed (offline, into a target folder), a learner and a worker training it for
    a few steps, and echo-rl sample showing completions and rewards. The tutorial cannot rot."""
    import json
    import os

    pkg = tmp_path / "pkg"
    for name, text in tutorial_files().items():
        (pkg / name).parent.mkdir(parents=True, exist_ok=True)
        (pkg / name).write_text(text)
    target = tmp_path / "target"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-index",
            "--no-build-isolation",
            "--target",
            str(target),
            str(pkg),
        ],
        check=True,
        capture_output=True,
    )
    env = {**os.environ, "PYTHONPATH": str(target)}  # the learner and its workers find it
    run = tmp_path / "run"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "echo_rl.cli.rl",
            "quickstart",
            "--config",
            str(pkg / "sort.toml"),
            "--workers",
            "1",
            "--run-dir",
            str(run),
            "--set",
            "learner.max_steps=3",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and all(0.0 <= row["reward_mean"] <= 1.0 for row in rows)
    out = tmp_path / "sample.json"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "echo_rl.cli.rl",
            "sample",
            str(run),
            "--n",
            "2",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    samples = json.loads(out.read_text())
    assert len(samples) == 4 and all(
        s["prompt"].endswith("=") and s["tokens"] <= 6 for s in samples
    )


def _install(files: dict[str, str], tmp_path: Path) -> Path:
    """Write the files out and pip-install them offline into a target folder."""
    pkg = tmp_path / "pkg"
    for name, text in files.items():
        (pkg / name).parent.mkdir(parents=True, exist_ok=True)
        (pkg / name).write_text(text)
    target = tmp_path / "target"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-index",
            "--no-build-isolation",
            "--target",
            str(target),
            str(pkg),
        ],
        check=True,
        capture_output=True,
    )
    return target


@pytest.mark.integration  # pip-installs the tutorial and plays it in a child
@pytest.mark.timeout(120)
def test_the_multi_turn_tutorials_game_keeps_the_episode_contract(tmp_path):
    """docs/adapters.md's take-last game, played with scripted decisions through the test kit
    (``echo_rl.data.testing``, as a worker plays it): every context it
    yields is the prompt plus the transcript so far, environment tokens carry log-prob 0.0 and
    mask 0, the page's example transcript is what it builds, and replaying the same decisions
    (a preemption's continuation) gives the same episode."""
    import os

    files = tutorial_files(MULTI_TURN)
    assert {"echo_takelast/__init__.py", "pyproject.toml", "takelast.toml"} <= set(files)
    target = _install(files, tmp_path)
    code = r"""
import json
from echo_rl.data.adapter import Prompt, load_adapter
from echo_rl.data.testing import play_episode, scripted
from echo_rl.core.models import build_tiny_tokenizer
tok = build_tiny_tokenizer()
ad = load_adapter("take-last", {}, tok)
prompt = tok.encode("7=", add_special_tokens=False)
seen = []
script = scripted(["2", "1", "1", "1", "1"])
def policy(turn):
    seen.append(turn.ids)
    return script(turn)
# the page's example: pile 7; the policy takes 2, 1, 1 (the opponent's moves come from the seed)
for seed in range(200):
    seen.clear()
    ep = play_episode(ad, Prompt(prompt, {"pile": 7}), policy, seed=seed, max_new_tokens=2)
    if tok.decode(ep.completion_ids) == "2<eos>4=1<eos>1=1<eos>":
        break
ok_prefix = len(seen) == 3 and all(
    c == prompt + ep.completion_ids[:len(c) - len(prompt)] for c in seen)
env = [i for i, m in enumerate(ep.loss_mask) if m == 0]
again = play_episode(ad, Prompt(prompt, {"pile": 7}), policy, seed=seed, max_new_tokens=2)
print(json.dumps({"text": tok.decode(ep.completion_ids), "reward": ep.reward, "info": ep.info,
                  "prefix": ok_prefix, "env_lp": [ep.logprobs[i] for i in env],
                  "mask": ep.loss_mask, "same": again.completion_ids == ep.completion_ids,
                  "bound": ad.max_completion_tokens, "recomputes": ad.recomputes_rewards}))
"""
    env = {**os.environ, "PYTHONPATH": str(target)}
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        check=False,
        text=True,
        env=env,
        timeout=90,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout)
    assert (
        r["text"] == "2<eos>4=1<eos>1=1<eos>" and r["reward"] == 1.0 and r["info"] == {"end": "won"}
    )
    assert r["prefix"] and r["same"]
    assert r["env_lp"] == [0.0] * 4 and r["mask"] == [1, 1, 0, 0, 1, 1, 0, 0, 1, 1]
    assert r["recomputes"] is False and r["bound"] == 32


@pytest.mark.slow
@pytest.mark.timeout(360)
def test_the_multi_turn_tutorial_builds_installs_and_trains(tmp_path):
    """docs/adapters.md's multi-turn tutorial as a newcomer would use it: its blocks written out,
    the package pip-installed offline, a learner and a worker training it for a few steps,
    echo-rl sample showing the rendered prompts and transcripts before and after."""
    import os

    files = tutorial_files(MULTI_TURN)
    target = _install(files, tmp_path)
    env = {**os.environ, "PYTHONPATH": str(target)}
    run = tmp_path / "run"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "echo_rl.cli.rl",
            "quickstart",
            "--config",
            str(tmp_path / "pkg" / "takelast.toml"),
            "--workers",
            "1",
            "--run-dir",
            str(run),
            "--set",
            "learner.max_steps=3",
        ],
        capture_output=True,
        check=False,
        text=True,
        env=env,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and all(0.0 <= row["reward_mean"] <= 1.0 for row in rows)
    # the workers say which episodes were cut (null on every multi-turn step before)
    assert all(0.0 <= row["completions_cut"] <= 1.0 for row in rows)
    assert sorted(p.name for p in (run / "checkpoints").glob("*.pt")) == [
        "after-00000002.pt",
        "after-00000003.pt",
    ]
    for which in (["--untrained"], []):
        out = tmp_path / "sample.json"
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "echo_rl.cli.rl",
                "sample",
                str(run),
                "--n",
                "2",
                "--json",
                str(out),
                *which,
            ],
            capture_output=True,
            check=False,
            text=True,
            env=env,
            timeout=120,
        )
        assert r.returncode == 0, r.stderr[-2000:]
        samples = json.loads(out.read_text())
        assert len(samples) == 4
        for s in samples:  # the prompt as the model reads it, not the task dict
            assert s["prompt"] == f"{s['task']['pile']}=" and s["reward"] in (0.0, 1.0)
            assert 1 <= s["tokens"] <= 32 and s["cut"] in (True, False) and s["stats"] == {}
