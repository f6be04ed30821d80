"""Slim installs (echo_rl/core/extras.py, pyproject.toml extras): a volunteer's `pip install echo-rl`
brings none of the simulator's, the reports' or the poker sandbox's packages, a learner and a
worker train without them, and a command that needs one names the extra that brings it."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from test_integration import Cluster, wait_rows

from echo_rl.core.extras import EXTRA_OF
from echo_rl.core.procs import wait_ready

ROOT = Path(__file__).resolve().parents[1]
OPTIONAL = ("scipy", "simpy", "matplotlib", "pandas", "pyarrow", "pokerkit")

pytestmark = pytest.mark.timeout(240)

# Put first on PYTHONPATH, this makes the optional packages invisible to the process (as if
# never installed): every finder answers "not found" for them.
BLOCKER = """
import sys
BLOCKED = set({blocked!r})

class _Hide:
    def __init__(self, inner):
        self.inner = inner

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            return None
        find = getattr(self.inner, "find_spec", None)
        return find(name, path, target) if find else None

    def __getattr__(self, attr):
        return getattr(self.inner, attr)

sys.meta_path[:] = [_Hide(f) for f in sys.meta_path]
"""


@pytest.fixture
def without_optional(tmp_path) -> dict[str, str]:
    """The environment of a process that cannot import the optional packages."""
    site = tmp_path / "blocker"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCKER.format(blocked=list(OPTIONAL)))
    return {"PYTHONPATH": f"{site}:{ROOT}"}


def test_the_core_install_leaves_the_optional_packages_to_extras():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = {
        d.split(">")[0].split("=")[0].split("[")[0].strip().lower() for d in meta["dependencies"]
    }
    assert core.isdisjoint(OPTIONAL)
    extras = meta["optional-dependencies"]
    for module, extra in EXTRA_OF.items():
        assert any(d.startswith(module) for d in extras[extra]), (module, extra)
    assert extras["all"] == ["echo-rl[sim,report,poker]"]


def test_the_blocker_hides_them(without_optional):
    import os

    run = subprocess.run(
        [
            sys.executable,
            "-c",
            "import importlib.util as u; print([u.find_spec(m) is None for m in %r])" % (OPTIONAL,),  # noqa: UP031
        ],
        capture_output=True,
        text=True,
        env={**os.environ, **without_optional},
        timeout=60,
    )
    assert run.stdout.strip() == str([True] * len(OPTIONAL)), run.stderr


@pytest.mark.slow
def test_a_learner_and_a_worker_train_without_the_optional_packages(
    tmp_path, small_cfg, without_optional
):
    cluster = Cluster(tmp_path, small_cfg)
    try:
        conf = tmp_path / "cfg.toml"
        from echo_rl.core.config import dump_toml

        conf.write_text(dump_toml(small_cfg))
        run = tmp_path / "run"
        learner = cluster.group.start(
            "learner",
            [sys.executable, "-m", "echo_rl.cli.rl", "learn", str(conf), "--run-dir", str(run)],
            tmp_path / "learner.err",
            pipe_stdout=True,
            env=without_optional,
        )
        line = wait_ready(learner, timeout=120)
        cluster.group.start(
            "w0",
            [
                sys.executable,
                "-m",
                "echo_rl.cli.worker",
                "join",
                line,
                "--id",
                "w0",
                "--plain",
                "--identity",
                str(tmp_path / "w0.key"),
            ],
            tmp_path / "w0.log",
            env=without_optional,
        )
        wait_rows(run, 2)
    finally:
        cluster.group.stop_all()


@pytest.mark.parametrize(
    "argv, extra",
    [
        (["sim", "--help"], "sim"),
        (["report", "nowhere"], "report"),
    ],
)
def test_a_command_that_needs_an_extra_names_it(argv, extra, without_optional):
    import os

    run = subprocess.run(
        [sys.executable, "-m", "echo_rl.cli.rl", *argv],
        capture_output=True,
        text=True,
        env={**os.environ, **without_optional},
        timeout=120,
        cwd=ROOT,
    )
    assert run.returncode == 2, run.stderr[-2000:]
    assert f"pip install 'echo-rl[{extra}]'" in run.stderr and "Traceback" not in run.stderr


def test_the_poker_adapter_names_its_extra(without_optional):
    import os

    code = (
        "from echo_rl.data.adapter import AdapterError, load_adapter\n"
        "from echo_rl.core.models import build_tiny_tokenizer\n"
        "try:\n    load_adapter('poker', {}, build_tiny_tokenizer(), check_prompts=False)\n"
        "except AdapterError as err:\n    print(err)\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, **without_optional},
        timeout=120,
        cwd=ROOT,
    )
    assert "the poker adapter needs pokerkit" in run.stdout, run.stderr[-2000:]
    assert "pip install 'echo-rl[poker]'" in run.stdout
