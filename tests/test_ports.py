"""Ports an operator can open (issue 30, item 2; docs/ports.md): the learner's fixed layout
(learner.port, chunks + 1, reflectors + 2 and + 3, dashboard + 4), port 0 still meaning "the
OS picks" for every socket, ports reused on --resume, a worker's --relay-port, and a port that is
taken said with the key or flag that sets it."""

from __future__ import annotations

import json
import socket

import pytest
import zmq
import zmq.asyncio

from echo_rl.broadcast.nat.reflect import punch_port_free, reuse_socket
from echo_rl.broadcast.relay import Relay, RelayConfig, RelayPortTaken
from echo_rl.cli.worker import relay_ports
from echo_rl.core.config import ConfigError, EchoConfig, ListenPorts, dump_toml, load_config
from echo_rl.core.errors import EchoError
from echo_rl.core.procs import pin_learner_port
from echo_rl.learner.startup import reuse_ports

pytestmark = pytest.mark.timeout(60)

PUBLIC = ["learner.host=0.0.0.0", "learner.public_host=203.0.113.7"]


def free_ports(n: int) -> list[int]:
    """``n`` ports the OS hands out now (bound to port 0, then released)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


# ----------------------------------------------------------------------------- the layout


def test_a_learner_beyond_loopback_listens_on_the_documented_layout():
    ports = load_config(None, PUBLIC).listen_ports()
    assert ports == ListenPorts(5555, 5556, (5557, 5558), 5559)
    ports = load_config(None, PUBLIC + ["learner.port=7000"]).listen_ports()
    assert ports == ListenPorts(7000, 7001, (7002, 7003), 7004)


def test_port_0_leaves_every_port_to_the_os_and_loopback_does_by_default():
    """Tests, the quickstart and side-by-side runs on one machine never collide."""
    assert EchoConfig().listen_ports() == ListenPorts(0, 0, (0, 0), 0)
    assert load_config(None, PUBLIC + ["learner.port=0"]).listen_ports() == ListenPorts(
        0, 0, (0, 0), 0
    )


def test_a_pinned_learner_port_leaves_the_other_sockets_to_the_os():
    """The restart drill's learner comes back on its port; the derived ports beside it (+1..+4)
    are not reserved by anything and once lost a CI run to an outgoing connection holding one."""
    cfg = EchoConfig()
    port = pin_learner_port(cfg)
    assert port > 0 and cfg.listen_ports() == ListenPorts(port, 0, (0, 0), 0)


def test_a_key_that_is_set_wins_over_the_layout():
    cfg = load_config(
        None,
        PUBLIC
        + ["learner.chunk_port=6000", "learner.reflector_ports=[6001, 6002]", "metrics.port=0"],
    )
    assert cfg.listen_ports() == ListenPorts(5555, 6000, (6001, 6002), 0)


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["learner.port=65533"], ["learner.port=65533", "learner.port <= 65531"]),
        (
            ["learner.port=7000", "learner.chunk_port=7002"],
            ["learner.chunk_port and learner.reflector_ports[0] are both 7002", "change one"],
        ),
        (
            ["learner.port=7000", "metrics.port=7000"],
            ["learner.port and metrics.port are both 7000"],
        ),
        (["learner.reflector_ports=[5557]"], ["learner.reflector_ports", "two ports"]),
        (["learner.port=70000"], ["learner.port = 70000", "--set learner.port="]),
    ],
)
def test_bad_ports_stop_at_load_naming_the_key_and_the_fix(overrides, words):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    for w in words:
        assert w in str(err.value)


def test_an_unused_socket_frees_its_port():
    """Without NAT traversal or metrics, their ports may coincide with another's."""
    load_config(
        None, ["learner.port=7000", "learner.chunk_port=7002", "broadcast.nat_traversal=false"]
    )
    load_config(
        None,
        [
            "learner.port=7000",
            "metrics.port=7001",
            "learner.chunk_port=7005",
            "metrics.enabled=false",
        ],
    )


def test_unset_ports_survive_the_run_folders_config_toml(tmp_path):
    """TOML has no null: an unset key is left out of config.toml, and reads back unset."""
    cfg = EchoConfig()
    (tmp_path / "config.toml").write_text(dump_toml(cfg))
    again = load_config(tmp_path / "config.toml")
    assert again.learner.port is None and again.listen_ports() == cfg.listen_ports()


# ----------------------------------------------------------------------------- the learner binds them


from test_addresses import _plane  # noqa: E402 (one control-plane builder for both)


def _with(cfg: EchoConfig, **learner) -> EchoConfig:
    data = cfg.model_dump()
    data["learner"].update(learner)
    data["broadcast"]["nat_traversal"] = True
    return EchoConfig.model_validate(data)


def test_the_control_plane_listens_on_every_configured_port(small_cfg, tokenizer):
    a, b, c, d = free_ports(4)
    plane = _plane(_with(small_cfg, port=a, chunk_port=b, reflector_ports=[c, d]), tokenizer)
    plane.start()
    try:
        assert plane.endpoint == f"tcp://127.0.0.1:{a}"
        assert plane.snapshot_endpoint == f"tcp://127.0.0.1:{b}"
        assert plane.reflector.endpoints == [f"127.0.0.1:{c}", f"127.0.0.1:{d}"]
        assert plane.bound_ports() == {"control": a, "chunks": b, "reflectors": [c, d]}
    finally:
        plane.shutdown("test over")


def test_port_0_gives_four_distinct_ports_the_os_picked(small_cfg, tokenizer):
    plane = _plane(_with(small_cfg, port=0), tokenizer)
    plane.start()
    try:
        got = plane.bound_ports()
        ports = [got["control"], got["chunks"], *got["reflectors"]]
        assert 0 not in ports and len(set(ports)) == 4
    finally:
        plane.shutdown("test over")


@pytest.mark.parametrize("key", ["port", "chunk_port", "reflector_ports"])
def test_a_taken_port_stops_the_learner_naming_its_key(small_cfg, tokenizer, key):
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    taken = holder.getsockname()[1]
    spare = free_ports(1)[0]
    ports = {"port": 0, "chunk_port": 0, "reflector_ports": [0, 0]}
    ports[key] = [taken, spare] if key == "reflector_ports" else taken
    plane = _plane(_with(small_cfg, **ports), tokenizer)
    try:
        with pytest.raises(
            RuntimeError, match=rf"port {taken}.*learner\.{key}.*set learner\.{key}"
        ) as got:
            plane.start()
        assert isinstance(got.value, EchoError) and got.value.reason == "port_taken"
    finally:
        holder.close()


# ----------------------------------------------------------------------------- --resume


def test_resume_reuses_every_port_the_os_picked_last_time(tmp_path):
    (tmp_path / "learner.json").write_text(
        json.dumps(
            {
                "endpoint": "tcp://127.0.0.1:41000",
                "ports": {
                    "control": 41000,
                    "chunks": 41007,
                    "reflectors": [41003, 41009],
                    "metrics": 41011,
                },
            }
        )
    )
    cfg = EchoConfig()  # loopback: every port the OS's
    reuse_ports(cfg, tmp_path)
    assert cfg.listen_ports() == ListenPorts(41000, 41007, (41003, 41009), 41011)


def test_resume_keeps_ports_the_config_fixes(tmp_path):
    (tmp_path / "learner.json").write_text(
        json.dumps(
            {
                "endpoint": "tcp://127.0.0.1:41000",
                "ports": {
                    "control": 41000,
                    "chunks": 41007,
                    "reflectors": [41003, 41009],
                    "metrics": 41011,
                },
            }
        )
    )
    cfg = load_config(None, ["learner.port=7000", "learner.chunk_port=0"])
    reuse_ports(cfg, tmp_path)
    assert cfg.listen_ports() == ListenPorts(7000, 41007, (7002, 7003), 7004)


def test_resume_of_a_run_from_before_the_layout_reuses_its_control_port(tmp_path):
    (tmp_path / "learner.json").write_text(json.dumps({"endpoint": "tcp://127.0.0.1:41000"}))
    cfg = EchoConfig()
    reuse_ports(cfg, tmp_path)
    assert cfg.listen_ports() == ListenPorts(41000, 0, (0, 0), 0)
    reuse_ports(fresh := EchoConfig(), tmp_path / "nowhere")  # no learner.json: nothing to reuse
    assert fresh.listen_ports() == ListenPorts(0, 0, (0, 0), 0)


# ----------------------------------------------------------------------------- a worker's relay


@pytest.mark.parametrize(
    "host, relay, punch, want",
    [
        ("203.0.113.9", None, None, (5560, 5561)),  # public: fixed, documented
        ("127.0.0.1", None, None, (0, 0)),  # loopback: several workers on one machine
        ("203.0.113.9", 6000, None, (6000, 6001)),
        ("203.0.113.9", 6000, 0, (6000, 0)),
        ("203.0.113.9", 0, None, (0, 0)),
    ],
)
def test_relay_ports_default_to_fixed_ones_beyond_loopback(host, relay, punch, want):
    assert relay_ports(host, relay, punch) == want


def test_a_relay_listens_on_its_port_and_says_which_flag_when_it_is_taken():
    port = free_ports(1)[0]
    ctx = zmq.asyncio.Context()
    try:
        relay = Relay(ctx, RelayConfig(port=port))
        assert relay.endpoint == f"tcp://127.0.0.1:{port}"
        with pytest.raises(RelayPortTaken, match=rf"port {port}.*--relay-port"):
            Relay(ctx, RelayConfig(port=port))
        relay.close()
    finally:
        ctx.term()


def test_a_fixed_punch_port_another_worker_listens_on_is_seen():
    """Punch sockets share their port (SO_REUSEPORT): a second worker would bind it silently."""
    listener = reuse_socket("127.0.0.1", 0)
    listener.listen(1)
    port = listener.getsockname()[1]
    try:
        assert not punch_port_free("127.0.0.1", port)
        second = reuse_socket("127.0.0.1", port)  # what the second worker would have done
        second.close()
    finally:
        listener.close()
    assert punch_port_free("127.0.0.1", port)


@pytest.mark.slow
def test_echo_worker_says_its_relay_port_is_taken_and_exits(tmp_path):
    # A real process: echo-worker leaves with os._exit while torch still loads on its warm-up
    # thread (echo_rl/cli/worker_join.py _leave_now), which would end a pytest process calling main() in it.
    import subprocess
    import sys

    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    port = holder.getsockname()[1]
    try:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "echo_rl.cli.worker",
                "join",
                "tcp://127.0.0.1:9",
                "--insecure",
                "--relay-port",
                str(port),
                "--identity",
                str(tmp_path / "k"),
                "--status-file",
                str(tmp_path / "s.json"),
                "--plain",
            ],
            capture_output=True,
            text=True,
            timeout=50,
        )
    finally:
        holder.close()
    err = proc.stderr
    assert proc.returncode == 1 and f"port {port} for the relay" in err and "--relay-port" in err
    assert "Traceback" not in err


def test_echo_worker_refuses_a_port_out_of_range(tmp_path, capsys):
    from echo_rl.cli import worker as cli

    rc = cli.main(
        [
            "join",
            "tcp://127.0.0.1:9",
            "--insecure",
            "--relay-port",
            "70000",
            "--identity",
            str(tmp_path / "k"),
        ]
    )
    assert rc == 2 and "--relay-port 70000 is not a port" in capsys.readouterr().err
