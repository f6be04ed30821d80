"""``echo-worker doctor`` and ``echo-rl doctor`` (issue 30, item 3) against real learners on
loopback (port 0): a healthy learner passes; a port nobody listens on, a listener that never
answers, a learner whose public address does not reach its snapshot port and reflectors (the
issue's unreachable advertised address), a wrong key, a missing token and a relay port nobody
can connect to each fail, naming the port, the key or flag behind it and the fix."""

from __future__ import annotations

import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from echo_rl.cli.rl import main as rl_main
from echo_rl.cli.worker import main as worker_main
from echo_rl.core.config import EchoConfig, dump_toml
from echo_rl.core.procs import ProcessGroup, python_argv, wait_ready

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


class Learner:
    def __init__(self, tmp: Path, cfg: EchoConfig, *sets: str):
        self.run_dir, self.group = tmp / "run", ProcessGroup()
        conf = tmp / "learner.toml"
        conf.write_text(dump_toml(cfg))
        argv = python_argv(
            "echo_rl.cli.rl",
            "learn",
            str(conf),
            "--run-dir",
            str(self.run_dir),
            *[a for s in sets for a in ("--set", s)],
        )
        proc = self.group.start("learner", argv, tmp / "learner.log", pipe_stdout=True)
        self.line = wait_ready(proc, timeout=120)

    def stop(self) -> None:
        self.group.stop_all()


def _cfg() -> EchoConfig:
    return EchoConfig.model_validate(
        {
            "learner": {"max_steps": 100_000, "prompts_per_step": 4, "group_size": 4},
            "broadcast": {"dtype": "float32", "chunk_mib": 0.0625},
        }
    )


@pytest.fixture(scope="module")
def healthy(tmp_path_factory) -> Iterator[Learner]:
    learner = Learner(tmp_path_factory.mktemp("healthy"), _cfg())
    yield learner
    learner.stop()


@pytest.fixture(scope="module")
def blocked(tmp_path_factory) -> Iterator[Learner]:
    """Binds 127.0.0.1 and hands out 127.0.0.2, where nothing listens: the join line (fixed
    by hand below) reaches it, its snapshot port and reflectors do not. Joining by token."""
    learner = Learner(
        tmp_path_factory.mktemp("blocked"),
        _cfg(),
        "learner.public_host=127.0.0.2",
        "security.join=token",
    )
    yield learner
    learner.stop()


def _worker_doctor(capsys, *argv: str) -> tuple[int, str]:
    rc = worker_main(["doctor", *argv, "--identity", "/nonexistent/worker.key"])
    return rc, capsys.readouterr().out


def _rl_doctor(capsys, *argv: str) -> tuple[int, str]:
    rc = rl_main(["doctor", *argv])
    return rc, capsys.readouterr().out


def _lines(out: str, name: str) -> str:
    """A check's verdict line and its fix line."""
    lines = out.splitlines()
    i = next(k for k, line in enumerate(lines) if f"] {name}:" in line)
    return "\n".join(lines[i : i + 2])


# ----------------------------------------------------------------------------- echo-worker doctor


def test_a_healthy_learner_passes_every_check(healthy, capsys):
    rc, out = _worker_doctor(capsys, healthy.line)
    assert rc == 0, out
    assert "[ok  ] learner port" in out and "holds the key in the join line" in out
    assert "[ok  ] snapshot port" in out and "punchable" in out  # loopback: one mapping per port
    rc, out = _worker_doctor(capsys, healthy.line, "--relay-port", "0")  # a relay others dial
    assert rc == 0, out
    assert "reachable" in _lines(out, "NAT") and "[ok  ] relay port" in out


def test_the_entry_point_exits_non_zero_on_a_failure(healthy):
    done = subprocess.run(
        python_argv("echo_rl.cli.worker", "doctor", healthy.line[:-2] + "00"),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 1
    assert "[FAIL] learner key" in done.stdout and "copy the join line" in done.stdout


def test_a_port_nobody_listens_on(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    rc, out = _worker_doctor(capsys, f"tcp://127.0.0.1:{port}", "--insecure")
    assert rc == 1
    check = _lines(out, "learner port")
    assert f"nothing listens on 127.0.0.1 port {port}" in check
    assert "docs/ports.md" in check and "learner is running" in check


def test_a_listener_that_never_answers(capsys):
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        rc, out = _worker_doctor(capsys, f"tcp://127.0.0.1:{silent.getsockname()[1]}", "--insecure")
    assert rc == 1
    assert "accepts connections but never speaks: not an Echo learner" in _lines(
        out, "learner port"
    )


def test_closed_snapshot_and_reflector_ports_and_a_missing_token(blocked, capsys):
    rc, out = _worker_doctor(capsys, blocked.line.replace("127.0.0.2", "127.0.0.1"))
    assert rc == 1
    assert "[ok  ] learner port" in out
    assert "admits workers by token" in _lines(out, "learner key")
    snap = _lines(out, "snapshot port")
    assert "[FAIL]" in snap and "nothing listens on 127.0.0.2" in snap
    assert "learner.chunk_port" in snap and "never receives a snapshot" in snap
    nat = _lines(out, "NAT")
    assert "[FAIL]" in nat and "will not relay" in nat and "learner.reflector_ports" in nat


def test_a_relay_port_nobody_can_connect_to(healthy, capsys):
    with socket.socket() as held:  # bound, never listening: every connection is refused
        held.bind(("127.0.0.1", 0))
        rc, out = _worker_doctor(capsys, healthy.line, "--relay-port", str(held.getsockname()[1]))
    assert rc == 1
    relay = _lines(out, "relay port")
    assert "[FAIL]" in relay and "could not connect" in relay and "open TCP" in relay


def _closed_ports(host: str, n: int) -> tuple[list[socket.socket], list[int]]:
    """Ports bound on ``host`` and never listening: a connection there is refused."""
    held = [socket.socket() for _ in range(n)]
    for s in held:
        s.bind((host, 0))
    return held, [s.getsockname()[1] for s in held]


def test_closed_reflectors_name_the_address_workers_dial_and_the_skipped_relay_port(capsys):
    """Issue 55, item 7b and c: the fix names the reflectors' address as the learner hands it
    out (learner.public_host; here 127.0.0.2, the learner bound elsewhere) and the security
    group; the relay port, which the reflector would have dialled, is printed as skipped."""
    import asyncio

    from echo_rl.core.doctor import show
    from echo_rl.worker.doctor import _nat_checks

    held, ports = _closed_ports("127.0.0.2", 2)
    try:
        reflectors = [f"127.0.0.2:{p}" for p in ports]
        nat, relay = asyncio.run(_nat_checks(reflectors, "127.0.0.1", 0, "127.0.0.1"))
    finally:
        for s in held:
            s.close()
    assert nat.status == "fail" and "did not answer a probe: connection refused" in nat.verdict
    assert f"TCP {ports[0]} and {ports[1]} to workers on 127.0.0.2" in nat.fix
    assert "learner.public_host" in nat.fix and "security group" in nat.fix
    assert (relay.name, relay.status) == ("relay port", "skip")
    assert relay.verdict.startswith("not checked: the learner's NAT reflector connects back")
    assert show([nat, relay]) == 1
    out = capsys.readouterr().out
    assert "[skip] relay port: not checked" in out
    assert out.splitlines()[-1] == "0 of 1 checks passed; failed: NAT; skipped: relay port"


def test_a_relay_on_loopback_says_its_port_was_not_checked_and_why(capsys):
    """Issue 55, item 7c: behind a home router (--relay-host 127.0.0.1, no --relay-port) the
    relay port check was left out of the report without a word."""
    import asyncio

    from echo_rl.broadcast.nat.reflect import Reflector
    from echo_rl.core.doctor import show
    from echo_rl.worker.doctor import _nat_checks

    async def body():
        ref = Reflector("127.0.0.1")
        await ref.start()
        try:
            return await _nat_checks(ref.endpoints, "127.0.0.1", None, "127.0.0.1")
        finally:
            ref.close()

    nat, relay = asyncio.run(body())
    assert nat.status == "ok"
    assert (relay.name, relay.status) == ("relay port", "skip")
    assert "not checked: --relay-host 127.0.0.1 is loopback" in relay.verdict
    assert "--relay-host YOUR_PUBLIC_IP" in relay.fix
    assert show([nat, relay]) == 0
    out = capsys.readouterr().out
    assert "[skip] relay port: not checked" in out and "       fix: nothing to do" in out
    assert out.splitlines()[-1] == "1 of 1 checks passed; skipped: relay port"


# ----------------------------------------------------------------------------- echo-rl doctor


def test_the_operator_s_doctor_on_a_healthy_learner(healthy, capsys):
    rc, out = _rl_doctor(capsys, "--run-dir", str(healthy.run_dir))
    assert rc == 0, out
    for key in (
        "learner.port",
        "learner.chunk_port",
        "learner.reflector_ports[0]",
        "learner.reflector_ports[1]",
        "metrics.port",
    ):
        assert f"[ok  ] {key}:" in out, key
    assert "[ok  ] learner: answers" in out and "echo-worker join 'echo://" in out
    assert "[warn] public address" in out  # loopback: only this machine's workers reach it


def test_the_operator_s_doctor_when_the_public_address_does_not_reach_the_ports(blocked, capsys):
    rc, out = _rl_doctor(capsys, "--run-dir", str(blocked.run_dir))
    assert rc == 1
    check = _lines(out, "learner.chunk_port")
    assert "bound on 127.0.0.1, but on the public address, one of this host's own" in check
    # 127.0.0.2 is this host's (all of 127/8 is), and nothing listens there: not a firewall
    assert "learner.public_host (127.0.0.2) names an address the learner does not" in check
    assert "learner.host=0.0.0.0" in check and "ufw" not in check


def test_the_operator_s_doctor_when_the_learner_is_not_running(tmp_path, capsys):
    learner = Learner(tmp_path, _cfg())
    learner.stop()
    rc, out = _rl_doctor(capsys, "--run-dir", str(learner.run_dir))
    assert rc == 1
    check = _lines(out, "learner.port")
    assert "nothing listens on 127.0.0.1" in check and "start it (echo-rl learn" in check


def test_the_operator_s_doctor_on_a_config_that_hands_out_a_wildcard(capsys, tmp_path):
    conf = tmp_path / "c.toml"
    conf.write_text(dump_toml(_cfg()))
    rc, out = _rl_doctor(capsys, "--config", str(conf), "--set", "learner.host=0.0.0.0")
    assert rc == 1
    assert "[FAIL] config" in out and "learner.public_host" in out


# ----------------------------------------------------------------------------- the README's lines


def _readme_doctor_lines() -> list[list[str]]:
    """The doctor commands of README "Running for real", as argv lists (comments cut)."""
    import shlex

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    block = readme.split("## Running for real", 1)[1].split("```", 2)[1]
    return [
        shlex.split(line.split("#", 1)[0])
        for line in block.splitlines()
        if line.split()[:2] in (["echo-rl", "doctor"], ["echo-worker", "doctor"])
    ]


def test_the_readme_s_doctor_lines_run_as_written(healthy, capsys):
    """Only the run folder and the join line are put in: HOST, the key and the token are the
    operator's. Both pass against a healthy learner on this host."""
    lines = _readme_doctor_lines()
    assert [argv[0] for argv in lines] == ["echo-rl", "echo-worker"]
    for argv in lines:
        argv = [
            str(healthy.run_dir)
            if a == "runs/r1"
            else healthy.line
            if a.startswith("echo://HOST")
            else a
            for a in argv
        ]
        rc, out = (_rl_doctor if argv[0] == "echo-rl" else _worker_doctor)(capsys, *argv[2:])
        assert rc == 0, (argv, out)


def test_an_allowlist_learner_that_refuses_the_check_s_key_still_answers(monkeypatch):
    """With security.join = allowlist the learner refuses the throwaway key the operator's
    doctor asks with: that refusal is the learner's own answer, with its key."""
    from echo_rl.control import doctor

    async def refused(*args, **kwargs):
        return None, (
            "tcp://127.0.0.1:5555 refused this worker's key (banned, not on its "
            "allow-list, or the learner is full): ask its operator"
        )

    monkeypatch.setattr(doctor, "ask_learner", refused)
    info = {"endpoint": "tcp://127.0.0.1:5555", "public_key": "k" * 40}
    asked = doctor._ask(info, doctor.Where("127.0.0.1", "127.0.0.1"), 5555)
    check = doctor._answer_check(info, asked)
    assert check.status == "ok" and "allowlist" in check.verdict


def test_the_operator_s_doctor_tells_a_dropping_firewall_from_a_stopped_learner(monkeypatch):
    """A port that times out even from the learner's own host is a firewall rule dropping it,
    not a learner that is not running (refused): the fix names the firewall (the netns README
    test, tests/test_readme_real.py, drops learner.chunk_port with iptables and sees this)."""
    from echo_rl.control import doctor

    cfg = _cfg()
    for found, words, fix in (
        ("timeout", "a firewall on this host drops", "ufw allow 5556/tcp"),
        ("refused", "the learner is not running", "start it"),
    ):
        monkeypatch.setattr(doctor, "tcp_greeting", lambda host, port, f=found: f)
        here = doctor.Where("127.0.0.1", "127.0.0.1")
        check = doctor._port_check("learner.chunk_port", 5556, "zmq", here, cfg, None)
        assert check.status == "fail" and words in check.verdict and fix in check.fix, check


def test_the_operator_s_doctor_says_it_did_not_ask_the_learner_after_a_port_failed(
    monkeypatch, tmp_path
):
    """Issue 55, item 7c: with a port failing, the learner's own answer was not asked for and
    the report said nothing of it; now it is a skipped check, with the reason."""
    import json

    from echo_rl.control import doctor
    from echo_rl.core.doctor import Check

    def closed(key, port, kind, where, cfg, ack):
        return Check(key, "fail", "nothing listens", "start it")

    def never(info, asked):
        raise AssertionError("judged the learner's answer although a port failed")

    monkeypatch.setattr(doctor, "_port_check", closed)
    monkeypatch.setattr(doctor, "_answer_check", never)
    (tmp_path / "learner.json").write_text(json.dumps({"endpoint": "tcp://127.0.0.1:5555"}))
    last = doctor.diagnose(_cfg(), tmp_path)[-1]
    assert (last.name, last.status) == ("learner", "skip")
    assert "not judged" in last.verdict and "a port above failed" in last.verdict


def test_an_older_learner_without_the_doctor_request_is_a_warning_not_a_failure():
    from echo_rl.core import wire
    from echo_rl.core.security import JoinLine, KeyPair
    from echo_rl.worker.doctor import _key_check

    line = JoinLine("tcp://127.0.0.1:5555", KeyPair.generate().public)
    check = _key_check(
        line,
        wire.Error(reason="unknown_type", detail="doctor is not a request the learner serves"),
        "",
    )
    assert check.status == "warn" and "older than this echo-worker" in check.verdict


# ----------------------------------------------------------------------------- behind a 1:1 NAT


def test_addresses_are_told_apart_by_who_can_reach_them():
    from echo_rl.core.addresses import reach

    assert [reach(h) for h in ("127.0.0.1", "localhost", "::1")] == ["loopback"] * 3
    private = ("10.0.0.2", "172.20.1.1", "192.168.1.9", "100.64.3.3", "169.254.1.1", "fd00::1")
    assert {reach(h) for h in private} == {"private"}
    # documentation ranges stand for public addresses (examples, the NAT lab)
    public = ("198.51.100.10", "203.0.113.7", "192.0.2.1", "8.8.8.8", "2001:db8::1")
    assert {reach(h) for h in public} == {"public"}
    assert reach("learner.example.org") == "name"


def test_a_config_that_tells_workers_a_private_address_fails_unless_the_fleet_is_local(
    capsys, tmp_path
):
    """Issue 55, item 1: learner.host=10.0.0.2 with no public_host (a cloud VM behind a 1:1
    NAT, configured wrong) passed 8 of 8 checks; volunteers on the internet cannot reach it."""
    conf = tmp_path / "c.toml"
    conf.write_text(dump_toml(_cfg()))
    rc, out = _rl_doctor(capsys, "--config", str(conf), "--set", "learner.host=10.0.0.2")
    assert rc == 1
    check = _lines(out, "public address")
    assert "[FAIL]" in check and "10.0.0.2, a private address" in check
    assert "learner.public_host" in check and "1:1 NAT" in check and "--lan" in check
    from echo_rl.control.doctor import config_checks

    cfg = EchoConfig.model_validate({"learner": {"host": "10.0.0.2"}})
    assert config_checks(cfg, lan=True)[0].status == "ok"


def _behind_nat(monkeypatch, ack=None):
    """The learner bound on 0.0.0.0 here, told to workers as 198.51.100.10, an address of no
    interface here; the local probe answers, the one to the public address gets no answer
    (no hairpin)."""
    from echo_rl.control import doctor

    monkeypatch.setattr(
        doctor, "tcp_greeting", lambda host, port: "zmtp" if host == "127.0.0.1" else "timeout"
    )
    where = doctor.Where("127.0.0.1", "198.51.100.10")
    assert not where.here
    return lambda key, port: doctor._port_check(key, port, "zmq", where, _cfg(), ack)


def test_behind_a_1to1_nat_no_port_is_failed_for_a_hairpin_this_host_cannot_take(monkeypatch):
    """Before, the correct set-up failed 4 of 7 checks and advised `ufw allow` for open ports.
    Without a worker from outside yet, the doctor says it cannot tell, and who can."""
    check = _behind_nat(monkeypatch)("learner.port", 5555)
    assert check.status == "skip", check
    assert "198.51.100.10 is not an address of this host" in check.verdict
    assert "echo-worker doctor" in check.fix and "ufw" not in check.fix


def test_behind_a_1to1_nat_the_learner_s_view_of_outside_workers_decides(monkeypatch):
    from echo_rl.core import wire

    def ack(**kw):
        base = dict(run_id="r", instance_id="i", snapshot_endpoint="", join="token", version=3)
        return wire.DoctorAck(**{**base, **kw})

    seen = _behind_nat(monkeypatch, ack(outside_joined=2, outside_installed=1))
    control, chunks = seen("learner.port", 5555), seen("learner.chunk_port", 5556)
    assert control.status == "ok" and "2 worker(s) from outside joined" in control.verdict
    assert chunks.status == "ok" and "1 worker(s) from outside installed" in chunks.verdict
    said = "2 worker(s) (w0, w1) report that they cannot fetch snapshots ... port 5556"
    closed = _behind_nat(monkeypatch, ack(outside_joined=2, snapshot_path=said))
    check = closed("learner.chunk_port", 5556)
    assert check.status == "fail" and said in check.verdict
    assert "security group" in check.fix and "ufw" not in check.fix


def test_the_learner_counts_workers_whose_nat_probe_came_from_outside():
    from types import SimpleNamespace

    from echo_rl.control.outside import outside_view

    workers = [
        SimpleNamespace(worker_id="a", nat_address="198.51.100.100:5561"),
        SimpleNamespace(worker_id="b", nat_address="203.0.113.9:40000"),
        SimpleNamespace(worker_id="c", nat_address="10.0.0.7:5561"),  # same network
        SimpleNamespace(worker_id="d", nat_address=""),  # not probed (yet)
    ]
    peers = {"a": SimpleNamespace(installed={4: 0.3}), "b": SimpleNamespace(installed={})}
    assert outside_view(workers, SimpleNamespace(peers=peers)) == (2, 1)
    assert outside_view(workers, None) == (2, 0)
