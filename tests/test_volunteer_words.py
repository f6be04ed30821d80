"""Volunteers are told what is happening (issue 30, item 5): a learner that does not answer is
explained after 30 s (address, port, firewall, the join line's key) and --give-up-after ends
the wait; the status says "installing" until the first snapshot is in; the provisioner's
decisions reach the volunteer as a sentence before the numbers. Fake clocks, port 0."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import random
import socket

import pytest
from fakes import FakeClock

from echo_rl.broadcast.snapshot import RunKey
from echo_rl.control.parts import Inputs
from echo_rl.control.server import LearnerServer
from echo_rl.control.work import WorkQueue
from echo_rl.core import wire
from echo_rl.core.security import JoinLine
from echo_rl.data.adapter import load_adapter
from echo_rl.data.buffer import ReplayBuffer
from echo_rl.data.records import Limits
from echo_rl.learner.main import LearnerStall, shutdown_reason
from echo_rl.provisioning.controller import ACTIVATE, RELEASE, Controller, Decision, Policy
from echo_rl.provisioning.words import SENTENCES, in_words
from echo_rl.worker.agent import Worker, WorkerError, WorkerSettings
from echo_rl.worker.status import StatusBoard, WorkerStatus, rows, state_of
from echo_rl.worker.unreachable import Unreachable

pytestmark = pytest.mark.timeout(60)

LEARNER = "tcp://203.0.113.7:5555"


# ----------------------------------------------------------------------------- a silent learner


def test_after_30_s_of_silence_the_volunteer_is_told_what_to_check():
    clock = FakeClock()
    u = Unreachable(LEARNER, clock=clock)
    u.trying()
    said = []
    for t in range(5, 400, 5):  # a join times out every 5 s
        clock.t = float(t)
        said.append((t, u.silent()))
    hints = [(t, text) for t, text in said if text]
    assert [t for t, _ in hints] == [30, 330]  # then every 5 minutes, not every retry
    text = hints[0][1]
    for words in (
        "203.0.113.7 port 5555",
        "join line",
        "firewall",
        "TCP 5555",
        "docs/ports.md",
        "key",
        "still trying",
        "--give-up-after SECONDS",
    ):
        assert words in text, words
    assert u.given_up() == ""  # no limit: never gives up


def test_give_up_after_ends_the_wait_and_says_why():
    clock = FakeClock()
    u = Unreachable(LEARNER, 60.0, clock=clock)
    u.trying()
    clock.t = 30.0
    assert "giving up 60 s after the first try" in u.silent()
    clock.t = 59.0
    assert u.given_up() == ""
    clock.t = 60.0
    assert u.given_up().startswith(
        "gave up after 60 s without an answer from the learner at "
        "tcp://203.0.113.7:5555 (--give-up-after 60)"
    )
    u.answered()  # an answer resets the clock: a later silence starts from zero
    clock.t = 100.0
    u.trying()
    clock.t = 110.0
    assert u.given_up() == "" and u.silent() == ""


def test_a_worker_facing_a_silent_learner_hints_then_gives_up(caplog, tmp_path):
    """The real join loop against a port nobody answers on (the clock runs 10 s per reading,
    so half a minute passes in a few short request timeouts)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # released: nothing listens there
    ticks = itertools.count(0, 10)
    worker = Worker(
        JoinLine(f"tcp://127.0.0.1:{port}", None),
        WorkerSettings(join_timeout_s=0.05, give_up_after_s=120),
        clock=lambda: float(next(ticks)),
    )
    caplog.set_level(logging.WARNING, logger="echo_rl.worker.agent")
    with pytest.raises(BaseExceptionGroup) as eg:
        asyncio.run(worker.run())
    fatal, rest = eg.value.split(WorkerError)
    assert rest is None
    assert "gave up after" in str(fatal.exceptions[0]) and "firewall" in str(fatal.exceptions[0])
    hints = [
        r.getMessage() for r in caplog.records if "no answer from the learner" in r.getMessage()
    ]
    assert hints and f"127.0.0.1 port {port}" in hints[0]
    assert worker.status.doc.problem == hints[-1]
    # the status says why from its one closing write: a reader polling it (echo-worker status,
    # a multi-run owner) never meets a bare "error" before the reason
    assert worker.status.doc.exit.startswith("gave up after")


def test_give_up_after_must_be_a_positive_number(tmp_path, capsys):
    from echo_rl.cli import worker as cli

    rc = cli.main(
        [
            "join",
            "tcp://127.0.0.1:9",
            "--insecure",
            "--give-up-after",
            "0",
            "--identity",
            str(tmp_path / "k"),
        ]
    )
    assert rc == 2 and "--give-up-after 0: give a number of seconds > 0" in capsys.readouterr().err


# ----------------------------------------------------------------------------- installing


def _doc(**fields):
    doc = {
        "worker_id": "w-1",
        "learner": LEARNER,
        "activity": "idle",
        "installed_version": -1,
        "account": {"state": "active"},
        "exit": None,
        "problem": None,
    }
    doc.update(fields)
    return WorkerStatus.model_validate(doc)


def test_status_says_installing_until_the_first_install():
    assert state_of(_doc()) == "active · installing (model and first snapshot)"
    assert (
        state_of(_doc(account={"state": "standby"}))
        == "standby · installing (model and first snapshot)"
    )
    assert state_of(_doc(installed_version=0)) == "active · idle"
    assert state_of(_doc(installed_version=3, activity="generating")) == "active · generating"
    assert state_of(_doc(activity="yielded")) == "active · yielded"
    assert state_of(_doc(exit="signal SIGTERM")) == "active, exited"


def test_echo_worker_status_prints_installing_from_the_file(tmp_path, capsys):
    from echo_rl.cli import worker as cli

    path = tmp_path / "w.json"
    path.write_text(json.dumps({"schema": 1, "pid": 0, "updated_at": 0, **_doc().to_json()}))
    assert cli.main(["status", str(path)]) == 0
    assert "installing" in capsys.readouterr().out


def test_a_problem_shows_as_its_own_row_until_the_worker_exits():
    assert ("problem", "no answer") in rows(_doc(problem="no answer"))
    assert not [r for r in rows(_doc(problem="no answer", exit="gave up")) if r[0] == "problem"]


def test_a_worker_that_never_ran_a_rollout_says_so_not_an_idle_share():
    """Issue 55, item 7d: the device's idle clock starts at the model's load, so a volunteer
    never given work read "device idle 86%"."""
    sharing = {"runs": 1, "share": 1.0, "device_s": 2.0, "switches": 0, "idle_fraction": 0.86}
    assert ("device idle", "no rollout yet") in rows(_doc(sharing=sharing))
    busy = _doc(sharing=sharing, groups_generated=3, samples_generated=12)
    assert ("device idle", "86% since the model loaded") in rows(busy)


def test_status_of_an_exited_worker_ages_the_learner_s_word_from_the_exit(tmp_path, capsys):
    """Issue 55, item 7e: an hour after the exit, `echo-worker status` said "run complete (0 s
    ago)": the age the learner gave when it said it, frozen in the file."""
    import time

    from echo_rl.cli import worker as cli

    exited = time.time() - 3600
    account = {"state": "left", "message": "run complete", "message_age_s": 0.0}
    doc = _doc(account=account, exit="learner shut down: run complete", updated_at=exited)
    assert ("learner says", "run complete (60 min ago)") in rows(doc, now=exited + 3600)
    assert ("learner says", "run complete (5 s ago)") in rows(doc, now=exited + 5)
    board = StatusBoard("w-1", LEARNER, 0.0, None)  # the worker stamps the books it is told
    board.account(wire.Account(state="left", message="run complete", message_age_s=2.0))
    told = board.doc.account_at
    assert told is not None and abs(told - time.time()) < 60
    assert ("learner says", "run complete (62 s ago)") in rows(board.doc, now=told + 60)
    path = tmp_path / "w.json"
    path.write_text(json.dumps({"schema": 1, "pid": 0, **doc.to_json()}))
    assert cli.main(["status", str(path)]) == 0
    out = capsys.readouterr().out
    assert "exited 60 min ago" in out and "run complete (60 min ago)" in out


@pytest.mark.parametrize(
    "outcome, said",
    [
        ("complete", "run complete"),
        ("stopped: the policy collapsed at step 5", "run ended before learner.max_steps"),
        (KeyboardInterrupt(), "learner stopped"),
        (LearnerStall("no 4 admissible groups within 600s"), "learner stalled: no 4 admissible"),
        (RuntimeError("publish timed out"), "learner failed (RuntimeError): the run did not"),
    ],
)
def test_workers_are_told_run_complete_only_when_the_run_completed(outcome, said):
    """Issue 55, item 7e: a learner that stalled or crashed told its workers "run complete"."""
    assert shutdown_reason(outcome).startswith(said)
    if outcome != "complete":
        assert "run complete" not in shutdown_reason(outcome)


# ----------------------------------------------------------------------------- decisions in words


@pytest.mark.parametrize("action, cause", sorted(SENTENCES))
def test_every_decision_starts_with_a_sentence_and_ends_with_the_numbers(action, cause):
    d = Decision(
        0.0, action, "w1", "C_eff 334.8/s < alpha*mu_req = 1.1 x 400 = 440/s", 334.8, 440.0, cause
    )
    text = in_words(d)
    state = "active" if action == ACTIVATE else "standby"
    assert text.startswith(f"{state}") and "C_eff" not in text.split("(provisioner:")[0]
    assert text.endswith("(provisioner: C_eff 334.8/s < alpha*mu_req = 1.1 x 400 = 440/s)")


def test_a_surplus_release_by_the_controller_reads_enough_capacity():
    clock = FakeClock()
    ctl = Controller(Policy(window_s=3.0, warmup_s=0.0), clock=clock)
    for wid, price in (("w1", 0.1), ("w2", 0.9)):
        ctl.add_worker(wid, price, state="active", mu_prior=10.0)
    ctl.set_requirement(1.0)
    released = []
    for t in range(10):
        clock.t = float(t)
        released += [d for d in ctl.tick() if d.action == RELEASE]
    assert released and released[0].worker_id == "w2"
    assert in_words(released[0]).startswith("standby: the fleet has enough capacity")
    assert "C_eff" in in_words(released[0])


def test_the_learner_tells_the_volunteer_in_words(small_cfg, tokenizer):
    """The control plane's provisioning step puts the sentence in the worker's account."""
    small_cfg.provisioning.enabled = True
    lc = small_cfg.learner
    adapter = load_adapter("toy-add", {}, tokenizer)
    plane = LearnerServer(
        small_cfg,
        Inputs(
            run_id="t",
            key=RunKey.generate(),
            buffer=ReplayBuffer(lc.staleness, 16, lc.group_size),
            work=WorkQueue(
                adapter.prompts(random.Random(0)),
                group_size=lc.group_size,
                max_outstanding=8,
                lease_timeout_s=30,
                prefix="t",
            ),
            limits=Limits(24, small_cfg.worker.max_new_tokens, lc.group_size),
        ),
    )
    plane.accounts.open("w1", "key1", 0.35, True, "joined: active")

    class Decides:
        def tick(self):
            return [
                Decision(
                    1.0,
                    RELEASE,
                    "w1",
                    "C_eff 30/s > (alpha+delta)*mu_req = 13/s",
                    30.0,
                    11.0,
                    "surplus",
                )
            ]

    plane.members.controller = Decides()
    plane.members.provision()
    message = plane.accounts.account("w1").message
    assert message.startswith("standby: the fleet has enough capacity")
    assert message.endswith("(provisioner: C_eff 30/s > (alpha+delta)*mu_req = 13/s)")
