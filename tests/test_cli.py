import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run(*args, **kw):
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, cwd=ROOT, timeout=60, **kw
    )


def test_help_does_not_import_torch():
    code = (
        "import sys, contextlib, io\n"
        "import echo_rl.cli.rl, echo_rl.cli.worker\n"
        "for m in (echo_rl.cli.rl, echo_rl.cli.worker):\n"
        "    with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
        "        m.main(['--help'])\n"
        "heavy = [m for m in ('torch', 'transformers', 'zmq') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    r = run("-c", code)
    assert r.returncode == 0, r.stderr


def test_bad_config_exits_2_with_key_named(tmp_path):
    r = run(
        "-m",
        "echo_rl.cli.rl",
        "learn",
        "examples/quickstart.toml",
        "--set",
        "learner.group_size=1",
        "--run-dir",
        str(tmp_path / "run"),
    )
    assert r.returncode == 2
    assert "learner.group_size" in r.stderr and "--set learner.group_size" in r.stderr


@pytest.mark.integration
def test_missing_model_is_a_clear_error(tmp_path):
    r = run(
        "-m",
        "echo_rl.cli.rl",
        "learn",
        "examples/quickstart.toml",
        "--set",
        f"model.name={tmp_path / 'nope'}",
        "--run-dir",
        str(tmp_path / "run"),
    )
    assert r.returncode == 1
    assert "no such directory" in r.stderr and "Traceback" not in r.stderr


def test_worker_rejects_bad_address():
    r = run("-m", "echo_rl.cli.worker", "join", "localhost:5555")
    assert r.returncode == 2 and "tcp://HOST:PORT" in r.stderr


def test_worker_says_why_it_stopped_when_the_error_is_nested(tmp_path, capsys):
    """A refusal met by a delivery task comes out of two TaskGroups: its words must still show."""
    from echo_rl.cli import worker as cli
    from echo_rl.worker.agent import WorkerError

    class Banned:
        def __init__(self, *args, **kwargs):
            pass

        async def run(self):
            raise ExceptionGroup(
                "worker",
                [
                    ExceptionGroup(
                        "deliveries",
                        [WorkerError("the learner banned this worker's key: quarantined")],
                    )
                ],
            )

    rc = cli.main(
        ["join", "tcp://127.0.0.1:9", "--insecure", "--identity", str(tmp_path / "k")],
        make_worker=Banned,
    )
    assert rc == 1
    assert (
        "echo-worker: the learner banned this worker's key: quarantined" in capsys.readouterr().err
    )


def test_quickstart_progress_is_plain_lines_without_a_terminal(capsys, monkeypatch):
    """Piped (CI, a log file), the quickstart prints whole lines, not a bar cut to 80 columns."""
    from echo_rl.cli import quickstart
    from echo_rl.core.config import EchoConfig
    from echo_rl.core.steprow import StepRow

    rows = [
        StepRow(
            step=i,
            reward_mean=0.1 * i,
            staleness_max=1,
            bubble_ratio=0.0,
            active_workers=2,
            standby_workers=0,
        )
        for i in range(3)
    ]

    class Tail:
        def __init__(self):
            self.batches = [[rows[0]], [], [rows[1], rows[2]]]

        def poll(self):
            return self.batches.pop(0) if self.batches else []

    class Learner:  # exits once the tail has given everything
        def __init__(self, tail):
            self.tail = tail

        def poll(self):
            return 0 if not self.tail.batches else None

        def wait(self, seconds):
            return None

    monkeypatch.setattr(quickstart, "PLAIN_EVERY_S", 0.0)
    cfg = EchoConfig.model_validate({"learner": {"max_steps": 3}})
    tail = Tail()
    quickstart._follow_plain(cfg, Learner(tail), tail)
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        "step 1/3  reward 0.000  staleness 1  bubble 0.00  workers 2 active / 0 standby",
        "step 3/3  reward 0.200  staleness 1  bubble 0.00  workers 2 active / 0 standby",
    ]


def test_sample_shows_what_a_runs_checkpoint_generates_for_its_task(tmp_path, capsys):
    """echo-rl sample RUN_DIR: the run's adapter, the latest checkpoint's weights, the worker's
    generation settings; a folder that is not a run is explained."""
    import json

    from echo_rl.cli import rl as cli
    from echo_rl.core.config import dump_toml, load_config
    from echo_rl.core.models import load_model, load_tokenizer
    from echo_rl.learner.checkpoint import save_checkpoint

    run = tmp_path / "run"
    run.mkdir()
    cfg = load_config(None, ['adapter.name="toy-add"', "worker.max_new_tokens=3"])
    (run / "config.toml").write_text(dump_toml(cfg))
    model = load_model(cfg.model, load_tokenizer(cfg.model), "float32")
    save_checkpoint(run, 1, {"model": model.state_dict()})
    out = tmp_path / "rows.json"
    assert cli.main(["sample", str(run), "--n", "3", "--samples", "2", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert len(rows) == 6 and all(r["tokens"] <= 3 for r in rows)
    assert all("+" in r["prompt"] and r["reward"] >= 0 for r in rows)  # toy-add's "a+b=" prompts
    printed = capsys.readouterr().out
    assert "mean reward" in printed and "cut at max_new_tokens" in printed
    assert cli.main(["sample", str(tmp_path)]) == 1
    assert "not an Echo run folder" in capsys.readouterr().err
    # another checkpoint, or the model the run started from; the table says which
    assert cli.main(["sample", str(run), "--checkpoint", "2", "--n", "1"]) == 0  # after-00000002.pt
    # the table's title holds the run folder's path, which rich wraps at the console's width
    assert "checkpoint 2" in " ".join(capsys.readouterr().out.split())
    assert cli.main(["sample", str(run), "--untrained", "--n", "1", "--json", str(out)]) == 0
    assert "untrained" in capsys.readouterr().out and json.loads(out.read_text())[0]["task"]
    assert cli.main(["sample", str(run), "--checkpoint", "7"]) == 1
    assert "no checkpoint of step 7" in capsys.readouterr().err


def test_every_subcommand_is_in_help_with_a_line_of_its_own(capsys):
    """One parser tree: every echo-rl subcommand is listed with its help, and the lab
    subcommands are gone from the product CLI (python -m labs.broadcast_bench instead)."""
    import contextlib

    from echo_rl.cli import rl as cli

    with contextlib.suppress(SystemExit):
        cli.main(["--help"])
    shown = capsys.readouterr().out
    names = (
        "learn",
        "quickstart",
        "doctor",
        "model",
        "eval",
        "report",
        "sample",
        "token",
        "workers",
        "worker",
        "sim",
    )
    for name in names:
        assert f"\n    {name}" in shown, name
    assert "bench" not in shown


def test_a_passthrough_subcommand_gets_its_arguments_in_order():
    from echo_rl.cli import rl as cli

    args, rest = cli.build_parser().parse_known_args(
        ["sample", "--checkpoint", "3", "RUN", "--n", "-1"]
    )
    assert args.passthrough and args.cmd == "sample"
    assert rest == ["--checkpoint", "3", "RUN", "--n", "-1"]
