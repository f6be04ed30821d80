"""The learner's public address (echo_rl.core.addresses): what it hands out, how addresses compare,
and the refusal to start when it would hand out one no worker can use (issue 30)."""

import asyncio
import random

import pytest
import zmq
import zmq.asyncio
from hypothesis import given, settings
from hypothesis import strategies as st

from echo_rl.broadcast.fetch import fetch_snapshot
from echo_rl.broadcast.snapshot import RunKey, Snapshot, build_manifest
from echo_rl.broadcast.tickets import Source
from echo_rl.control.parts import Inputs
from echo_rl.control.server import LearnerServer
from echo_rl.control.work import WorkQueue
from echo_rl.core import wire
from echo_rl.core.addresses import (
    canonical_endpoint,
    canonical_host,
    is_loopback,
    public_endpoint,
    public_host_problem,
    same_endpoint,
)
from echo_rl.core.config import ConfigError, EchoConfig, load_config
from echo_rl.core.security import JoinLine, KeyPair, curve_client
from echo_rl.data.adapter import load_adapter
from echo_rl.data.buffer import ReplayBuffer
from echo_rl.data.records import Limits

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(
    "a, b",
    [
        ("tcp://localhost:5555", "tcp://127.0.0.1:5555"),
        ("TCP://LocalHost.:5555", "tcp://127.0.0.1:5555"),
        ("tcp://[::1]:5555", "tcp://[0:0:0:0:0:0:0:1]:5555"),
        ("tcp://[::ffff:127.0.0.1]:5555", "tcp://127.0.0.1:5555"),
        ("tcp://Learner.Example.org.:7000", "tcp://learner.example.org:7000"),
        (" tcp://10.0.0.1:80 ", "tcp://10.0.0.1:80"),
    ],
)
def test_one_spelling_per_endpoint(a, b):
    assert canonical_endpoint(a) == canonical_endpoint(b)
    assert same_endpoint(a, b)


@pytest.mark.parametrize(
    "a, b",
    [
        ("tcp://127.0.0.1:5555", "tcp://127.0.0.1:5556"),  # another port
        ("tcp://127.0.0.1:5555", "tcp://127.0.0.2:5555"),  # another loopback address
        ("tcp://10.0.0.1:5555", "tcp://10.0.0.10:5555"),
    ],
)
def test_different_endpoints_stay_different(a, b):
    assert not same_endpoint(a, b)


def test_canonical_forms():
    assert canonical_endpoint("tcp://[2001:DB8:0::1]:9") == "tcp://[2001:db8::1]:9"
    assert canonical_host("localhost") == "127.0.0.1"
    assert canonical_endpoint("not an endpoint") == "not an endpoint"  # left alone, no crash
    assert is_loopback("localhost") and is_loopback("127.3.2.1") and is_loopback("::1")
    assert not is_loopback("0.0.0.0") and not is_loopback("example.org")


def test_the_public_host_replaces_the_bound_one_and_keeps_the_port():
    assert (
        public_endpoint("tcp://0.0.0.0:4242", "0.0.0.0", "203.0.113.7") == "tcp://203.0.113.7:4242"
    )
    assert (
        public_endpoint("tcp://0.0.0.0:4242", "0.0.0.0", "learner.example.org")
        == "tcp://learner.example.org:4242"
    )
    assert public_endpoint("tcp://[::]:4242", "::", "2001:db8::1") == "tcp://[2001:db8::1]:4242"
    assert public_endpoint("tcp://127.0.0.1:4242", "127.0.0.1", "") == "tcp://127.0.0.1:4242"
    # a NAT'd cloud VM: bound to its private address, announced at its public one
    assert (
        public_endpoint("tcp://10.0.0.5:4242", "10.0.0.5", "203.0.113.7")
        == "tcp://203.0.113.7:4242"
    )
    with pytest.raises(ValueError, match="learner.public_host"):
        public_endpoint("tcp://0.0.0.0:4242", "0.0.0.0", "")


@pytest.mark.parametrize(
    "host, public, fine",
    [
        ("127.0.0.1", "", True),  # tests and the quickstart: loopback, no public_host
        ("localhost", "", True),
        ("10.1.2.3", "", True),
        ("0.0.0.0", "203.0.113.7", True),
        ("::", "learner.example.org", True),
        ("0.0.0.0", "", False),
        ("::", "", False),
        ("*", "", False),
        ("0.0.0.0", "0.0.0.0", False),
        ("0.0.0.0", "tcp://203.0.113.7:5555", False),
        ("0.0.0.0", "203.0.113.7:5555", False),
    ],
)
def test_which_addresses_a_learner_may_announce(host, public, fine):
    assert (public_host_problem(host, public) == "") is fine


def test_a_wildcard_host_without_public_host_is_refused_at_load_naming_the_key():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["learner.host=0.0.0.0"])
    text = str(err.value)
    assert (
        "learner.public_host" in text and "0.0.0.0" in text and "--set learner.public_host=" in text
    )
    cfg = load_config(None, ["learner.host=0.0.0.0", "learner.public_host=203.0.113.7"])
    assert cfg.learner.public_host == "203.0.113.7"
    assert load_config(None, []).learner.host == "127.0.0.1"  # loopback needs nothing


def _plane(cfg, tokenizer):
    lc = cfg.learner
    adapter = load_adapter("toy-add", {}, tokenizer)
    return LearnerServer(
        cfg,
        Inputs(
            run_id="t",
            key=RunKey.generate(),
            buffer=ReplayBuffer(lc.staleness, cfg.buffer.capacity_groups, lc.group_size),
            work=WorkQueue(
                adapter.prompts(random.Random(0)),
                group_size=lc.group_size,
                max_outstanding=8,
                lease_timeout_s=30,
                prefix="t",
            ),
            limits=Limits(24, cfg.worker.max_new_tokens, lc.group_size),
        ),
    )


@pytest.fixture
def public_plane(small_cfg, tokenizer):
    data = small_cfg.model_dump()
    data["learner"].update(host="0.0.0.0", public_host="127.0.0.1", port=0)
    data["broadcast"]["nat_traversal"] = True
    cp = _plane(EchoConfig.model_validate(data), tokenizer)
    cp.start()
    yield cp
    cp.shutdown("test over")


def test_every_endpoint_a_worker_is_handed_names_the_public_host(public_plane):
    """Bound on 0.0.0.0 with public_host = 127.0.0.1: the join line, learner.json's endpoints
    (control.endpoint, control.snapshot_endpoint), the JoinAck, the heartbeat reply, the
    snapshot notice and the reflectors all say 127.0.0.1, with the bound ports; and a worker
    pulls the snapshot from the endpoint it was handed."""
    plane = public_plane
    port = plane.endpoint.rsplit(":", 1)[1]
    snap_port = plane.snapshot_endpoint.rsplit(":", 1)[1]
    assert plane.endpoint == f"tcp://127.0.0.1:{port}" and port != "0"
    assert plane.snapshot_endpoint == f"tcp://127.0.0.1:{snap_port}"
    assert JoinLine.parse(plane.join_line()).endpoint == plane.endpoint
    ctx = zmq.Context()
    keys = KeyPair.generate()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.RCVTIMEO, 10_000)
        sock.setsockopt(zmq.LINGER, 0)
        curve_client(sock, keys, plane.public_key)
        sock.connect(plane.endpoint)

        def ask(msg, want):
            sock.send(wire.encode(msg))
            while not isinstance(reply := wire.decode(sock.recv(), 1 << 24), want):
                pass
            return reply

        ack = ask(wire.Join(worker_id="w1"), wire.JoinAck)
        assert ack.snapshot_endpoint == plane.snapshot_endpoint
        assert ack.reflectors and all(r.startswith("127.0.0.1:") for r in ack.reflectors)
        payload = bytes(range(256)) * 64
        m = build_manifest(
            run_id="t",
            version=0,
            tensors=[],
            payload=payload,
            chunk_size=4096,
            dtype="float32",
            key=plane.key,
        )
        plane.publish(Snapshot(m, payload))
        sock.send(wire.encode(wire.Heartbeat(worker_id="w1", version=-1)))
        notice = hb = None
        while notice is None or hb is None:
            reply = wire.decode(sock.recv(), 1 << 24)
            if isinstance(reply, wire.SnapshotNotice):
                notice = reply
            elif isinstance(reply, wire.HeartbeatAck):
                hb = reply
        assert notice.source == plane.snapshot_endpoint
        assert hb.manifest is not None and hb.source == plane.snapshot_endpoint
    finally:
        ctx.destroy(linger=0)

    async def fetch():
        actx = zmq.asyncio.Context()
        try:
            return await fetch_snapshot(
                actx,
                m,
                Source(notice.source, notice.source_key, notice.ticket),
                window=4,
                timeout_s=10,
                max_bytes=1 << 20,
                keys=keys,
            )
        finally:
            actx.term()

    assert bytes(asyncio.run(fetch())) == payload


def test_a_plane_given_an_unchecked_wildcard_config_refuses_to_start(small_cfg, tokenizer):
    """The config check is the first line; the plane itself never hands out 0.0.0.0 either."""
    object.__setattr__(small_cfg.learner, "host", "0.0.0.0")  # around the validation
    plane = _plane(small_cfg, tokenizer)
    with pytest.raises(RuntimeError, match="learner.public_host"):
        plane.start()


def test_a_relay_address_spelled_another_way_is_still_taken(small_cfg, tokenizer):
    plane = _plane(small_cfg, tokenizer)
    plane.start()
    ctx = zmq.Context()
    try:
        replies = []
        for n, ep in enumerate(("tcp://127.0.0.1:7000", "tcp://localhost:7000")):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.RCVTIMEO, 10_000)
            sock.setsockopt(zmq.LINGER, 0)
            curve_client(sock, KeyPair.generate(), plane.public_key)
            sock.connect(plane.endpoint)
            sock.send(wire.encode(wire.Join(worker_id=f"w{n}", relay_endpoint=ep)))
            replies.append(wire.decode(sock.recv(), 1 << 24))
        assert isinstance(replies[0], wire.JoinAck)
        assert isinstance(replies[1], wire.Error) and replies[1].reason == "endpoint_taken"
    finally:
        ctx.destroy(linger=0)
        plane.shutdown("test over")


SPELLINGS_OF_127_0_0_1 = ("127.1", "0x7f000001", "2130706433", "127.0.0.01", "127.000.000.001")


@pytest.mark.parametrize("host", SPELLINGS_OF_127_0_0_1)
def test_a_declared_relay_host_in_a_loose_numeric_form_is_refused_naming_its_one_spelling(host):
    from echo_rl.core.addresses import declared_endpoint

    with pytest.raises(ValueError, match=r"is 127\.0\.0\.1 written another way; declare it as "):
        declared_endpoint(f"tcp://{host}:7000")


def test_a_declared_relay_endpoint_has_one_spelling_or_is_refused_with_the_fix():
    from echo_rl.core.addresses import declared_endpoint

    assert declared_endpoint("tcp://127.0.0.1:7000") == "tcp://127.0.0.1:7000"
    assert declared_endpoint("TCP://localhost:07000") == "tcp://127.0.0.1:7000"
    assert declared_endpoint("tcp://[::ffff:10.0.0.2]:5560") == "tcp://10.0.0.2:5560"
    assert declared_endpoint("tcp://[0:0:0:0:0:0:0:1]:5560") == "tcp://[::1]:5560"
    for bad, why in (
        ("tcp://0.0.0.0:5560", "binds every interface"),
        ("tcp://[::]:5560", "binds every interface"),
        ("tcp://relay.example.org:5560", "not an IP address"),
        ("ipc:///tmp/relay", "scheme must be tcp"),
        ("tcp://10.0.0.2", "TCP port"),
        ("tcp://10.0.0.2:70000", "TCP port"),
    ):
        with pytest.raises(ValueError, match=why):
            declared_endpoint(bad)


def test_every_other_spelling_of_a_taken_relay_address_is_refused_at_join(small_cfg, tokenizer):
    """Issue 52: each of these reached the honest relay's 127.0.0.1:7000 through the OS and
    was accepted with a join_ack; now each join is refused, naming the one spelling, and the
    learner goes on serving (the honest worker's join stands)."""
    plane = _plane(small_cfg, tokenizer)
    plane.start()
    ctx = zmq.Context()
    try:
        spellings = ("127.0.0.1", *SPELLINGS_OF_127_0_0_1, "0.0.0.0")
        replies = []
        for n, host in enumerate(spellings):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.RCVTIMEO, 10_000)
            sock.setsockopt(zmq.LINGER, 0)
            curve_client(sock, KeyPair.generate(), plane.public_key)
            sock.connect(plane.endpoint)
            ep = f"tcp://{host}:7000"
            sock.send(wire.encode(wire.Join(worker_id=f"w{n}", relay_endpoint=ep)))
            replies.append(wire.decode(sock.recv(), 1 << 24))
        assert isinstance(replies[0], wire.JoinAck)
        for reply in replies[1:]:
            assert isinstance(reply, wire.Error) and reply.reason == "bad_endpoint", reply
        assert all("127.0.0.1" in r.detail for r in replies[1:-1])
        assert "binds every interface" in replies[-1].detail
    finally:
        ctx.destroy(linger=0)
        plane.shutdown("test over")


@settings(max_examples=400, deadline=None)
@given(st.text(max_size=300))
def test_any_declared_endpoint_is_one_spelling_or_a_short_refusal(text):
    """A join's relay endpoint is a stranger's string: whatever it holds, the answer is a
    canonical endpoint or a ValueError whose message stays short (it goes back on the wire)."""
    from echo_rl.core.addresses import declared_endpoint

    for endpoint in (text, f"tcp://{text}:5560", f"tcp://127.0.0.1:{text}"):
        try:
            out = declared_endpoint(endpoint)
        except ValueError as err:
            assert len(str(err)) < 600
        else:
            assert out.startswith("tcp://") and declared_endpoint(out) == out


def test_junk_relay_endpoints_are_refused_and_counted_and_the_learner_serves_on(
    small_cfg, tokenizer
):
    """Junk in the one field this change reads from a joining peer: a megabyte, a NUL, a
    port out of range. Each join is refused (bad_endpoint, counted, a short detail), and an
    honest join after them is answered."""
    plane = _plane(small_cfg, tokenizer)
    plane.start()
    ctx = zmq.Context()
    try:
        junk = ("tcp://" + "1" * 1_000_000 + ":1", "tcp://127.0.0.1\x00:7000", "tcp://1.2.3.4:0")
        replies = []
        for n, ep in enumerate((*junk, "tcp://127.0.0.1:7001")):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.RCVTIMEO, 10_000)
            sock.setsockopt(zmq.LINGER, 0)
            curve_client(sock, KeyPair.generate(), plane.public_key)
            sock.connect(plane.endpoint)
            sock.send(wire.encode(wire.Join(worker_id=f"j{n}", relay_endpoint=ep)))
            replies.append(wire.decode(sock.recv(), 1 << 24))
        for reply in replies[:-1]:
            assert isinstance(reply, wire.Error) and reply.reason == "bad_endpoint", reply
            assert len(reply.detail) < 600
        assert isinstance(replies[-1], wire.JoinAck)
        assert plane.stats().join_refused.get("bad_endpoint") == len(junk)
    finally:
        ctx.destroy(linger=0)
        plane.shutdown("test over")


def test_the_wildcard_message_does_not_send_a_nat_host_to_bind_its_public_address():
    """Issue 55, item 3: behind a 1:1 NAT the public address is on no interface; the old hint
    "or bind learner.host to that address itself" led to "Cannot assign requested address"."""
    from echo_rl.core.addresses import public_host_problem

    text = public_host_problem("0.0.0.0", "")
    assert "bind learner.host to that address" not in text
    assert "Keep learner.host at 0.0.0.0" in text and "1:1 NAT" in text
