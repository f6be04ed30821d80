"""NAT traversal (docs/nat.md): the reflector's verdicts, punched links, the tunnel that carries
zmq sessions over one, and how the planner and coordinator place workers that are behind NAT.

Loopback has no NAT: a "punch" here is two sockets on one host connecting to each other's
ports, which exercises the same code (simultaneous open, greetings, tunnel) that the netns
tier (``test_nat_lab_*``) runs through real MASQUERADE routers."""

import asyncio
import logging
import os
import socket
import struct

import msgpack
import numpy as np
import pytest
import zmq
import zmq.asyncio
from test_control import ask, connect, ctx, plane  # noqa: F401 (fixtures)

from echo_rl.broadcast.coordinator import Coordinator
from echo_rl.broadcast.nat import links as nat_links
from echo_rl.broadcast.nat.links import Tunnels, plain, split_via, via
from echo_rl.broadcast.nat.punch import MAGIC
from echo_rl.broadcast.nat.reflect import (
    NatError,
    Observation,
    Reflector,
    pick_punch_port,
    probe,
    probe_all,
    probe_failure,
)
from echo_rl.broadcast.nat.tunnel import HEADER, MAX_FRAME, Tunnel
from echo_rl.broadcast.planner import plan_chains
from echo_rl.broadcast.relay import Relay, RelayConfig
from echo_rl.broadcast.snapshot import RunKey, build_manifest
from echo_rl.broadcast.store import SnapshotBuffer
from echo_rl.broadcast.topology import Peer, make_topology
from echo_rl.core import wire

pytestmark = pytest.mark.timeout(60)
HOST = "127.0.0.1"


def run(coro, timeout=30):
    async def bounded():
        return await asyncio.wait_for(coro, timeout)

    return asyncio.run(bounded())


# ----------------------------------------------------------------------------- reflector


async def _reflector(**kw) -> Reflector:
    r = Reflector(HOST, **kw)
    await r.start()
    return r


def test_reflector_classifies_a_listening_worker_reachable_and_a_closed_one_punchable():
    async def body():
        ref = await _reflector()
        relay = await asyncio.start_server(lambda r, w: w.close(), HOST, 0)
        relay_port = relay.sockets[0].getsockname()[1]
        port = pick_punch_port(HOST)
        open_nonces = await probe_all(ref.endpoints, HOST, port, relay_port)
        closed_port = pick_punch_port(HOST)  # nobody listens there: the dial-back fails
        port2 = pick_punch_port(HOST)
        closed_nonces = await probe_all(ref.endpoints, HOST, port2, closed_port)
        relay.close()
        ref.close()
        return (
            ref.classify(open_nonces, f"tcp://{HOST}:{relay_port}"),
            ref.classify(closed_nonces, f"tcp://{HOST}:{closed_port}"),
            ref.classify(open_nonces, "tcp://10.0.0.9:1234"),
            port,
            port2,
        )

    reachable, closed, elsewhere, port, port2 = run(body())
    assert reachable == ("reachable", f"{HOST}:{port}")
    # both probes left from one port and kept it (no NAT): a punched link can reach it
    assert closed == ("punchable", f"{HOST}:{port2}")
    # dialled back fine, but the endpoint it joined with is not the address we saw
    assert elsewhere[0] == "punchable"


def test_reflector_announces_the_public_host_it_is_given():
    async def body():
        ref = await _reflector(advertise="203.0.113.1")
        ref.close()
        return ref

    ref = run(body())
    assert ref.endpoints == [f"203.0.113.1:{p}" for p in ref.ports] and len(ref.ports) == 2


def test_reflector_says_none_when_the_mapping_differs_per_destination():
    ref = Reflector(HOST)
    ref.seen[b"a" * 16] = Observation("198.51.100.7", 40001, 0, False, 0, 0.0)
    ref.seen[b"b" * 16] = Observation("198.51.100.7", 40777, 1, False, 0, 0.0)
    assert ref.classify([b"a" * 16, b"b" * 16], "") == ("none", "198.51.100.7:40001")


def test_reflector_judges_only_its_own_records():
    ref = Reflector(HOST)
    ref.seen[b"a" * 16] = Observation("198.51.100.7", 40001, 0, True, 9, 0.0)
    with pytest.raises(NatError, match="probe_not_seen"):
        ref.classify([b"a" * 16, b"z" * 16], "tcp://198.51.100.7:9")  # one nonce never probed
    with pytest.raises(NatError, match="probe_not_seen"):
        ref.classify([b"a" * 16, b"a" * 16], "tcp://198.51.100.7:9")  # both on one listener


def test_a_probe_nobody_answers_says_what_happened_never_an_empty_reason():
    """Issue 55, item 7a: a timeout from asyncio.wait_for is a bare TimeoutError, and the
    worker logged "did not answer a probe: " with nothing after it."""

    async def body():
        with socket.socket() as silent, socket.socket() as closed:
            silent.bind((HOST, 0))
            silent.listen()  # accepts, never replies
            closed.bind((HOST, 0))  # bound, not listening: refused
            said = []
            for s, timeout in ((silent, 0.2), (closed, 5.0)):
                addr = f"{HOST}:{s.getsockname()[1]}"
                with pytest.raises(NatError) as err:
                    await probe(addr, HOST, pick_punch_port(HOST), 0, timeout_s=timeout)
                said.append(str(err.value))
            return said

    quiet, refused = run(body())
    assert quiet.endswith(
        "did not answer a probe: connected, but no reply within 0.2 s (timed out)"
    )
    assert "did not answer a probe: connection refused (nothing listens" in refused
    # a connection never made (a firewall dropping it), and an error with no text at all
    assert probe_failure(TimeoutError(), 5.0, False).startswith("timed out after 5 s connecting")
    assert probe_failure(OSError(), 5.0, False) == "OSError"


def test_reflector_counts_malformed_probes_and_keeps_serving():
    async def body():
        ref = await _reflector()
        rhost, rport = ref.endpoints[0].rsplit(":", 1)
        for junk in (
            b"\xc1" * 10,
            b"x" * 300,
            msgpack.packb({"v": 7, "nonce": b"n" * 16}),
            msgpack.packb({"v": 1, "nonce": b"short"}),
            msgpack.packb({"v": 1, "nonce": b"n" * 16, "dial": 70000}),
        ):
            r, w = await asyncio.open_connection(rhost, int(rport))
            w.write(junk)
            await w.drain()
            assert await r.read() == b""  # closed without a reply
            w.close()
        nonce, reply = await probe(ref.endpoints[0], HOST, pick_punch_port(HOST), 0)
        ref.close()
        return ref, nonce, reply

    ref, nonce, reply = run(body())
    assert ref.refused["malformed"] == 5
    assert reply["ip"] == HOST and nonce in ref.seen


def test_reflector_rate_limits_one_address_not_the_others():
    async def body():
        ref = await _reflector(per_address_per_s=1.0)
        rport = ref.ports[0]
        refused = 0
        for _ in range(12):  # burst of 4 allowed, then refused without a reply
            r, w = await asyncio.open_connection(HOST, rport, local_addr=("127.0.0.2", 0))
            try:
                w.write(msgpack.packb({"v": 1, "nonce": os.urandom(16), "dial": 0}))
                refused += await r.read() == b""
            except ConnectionResetError:  # closed before our probe arrived
                refused += 1
            w.close()
        _, reply = await probe(f"{HOST}:{rport}", "127.0.0.3", pick_punch_port("127.0.0.3"), 0)
        ref.close()
        return ref, refused, reply

    ref, refused, reply = run(body())
    assert refused >= 7 and ref.refused["rate"] == refused
    assert reply["ip"] == "127.0.0.3"  # another address is still served


# ----------------------------------------------------------------------------- punching


def test_punch_greeting_with_another_links_id_is_refused():
    async def body():
        child, parent = (Tunnels(HOST, pick_punch_port(HOST)) for _ in range(2))
        tasks = [asyncio.create_task(t.serve_forever()) for t in (child, parent)]
        await asyncio.gather(child.listening.wait(), parent.listening.wait())
        parent.open(
            wire.Punch(
                punch_id=b"a" * 16,
                role="parent",
                address=f"{HOST}:{child.port}",
                endpoint="tcp://127.0.0.1:9",
                timeout_s=1.5,
            )
        )
        child.open(
            wire.Punch(
                punch_id=b"b" * 16,
                role="child",
                address=f"{HOST}:{parent.port}",
                endpoint="tcp://127.0.0.1:9",
                timeout_s=1.5,
            )
        )
        got = await asyncio.gather(
            _error(child.resolve(via(b"b" * 16, "tcp://127.0.0.1:9"), 5)),
            _error(parent.resolve(via(b"a" * 16, "tcp://127.0.0.1:9"), 5)),
        )
        for t in tasks:
            t.cancel()
        return got, child, parent

    (c_err, p_err), child, parent = run(body())
    assert c_err.reason == p_err.reason == "unpunchable"
    assert child.opened == parent.opened == 0 and child.failed == parent.failed == 1
    assert child.strays + parent.strays > 0  # each side's listener refused the other's id


async def _punched_pair(parent_endpoint: str, child_endpoint: str = "", *, stray: bytes = b""):
    """Two workers' Tunnels on loopback, told to punch one link (child -> parent's relay);
    ``stray``: a connection greeting with this id hits the parent's punch port first."""
    child = Tunnels(HOST, pick_punch_port(HOST), endpoint=child_endpoint)
    parent = Tunnels(HOST, pick_punch_port(HOST), endpoint=parent_endpoint)
    pid = os.urandom(16)
    tasks = [asyncio.create_task(t.serve_forever()) for t in (child, parent)]
    await asyncio.gather(child.listening.wait(), parent.listening.wait())
    if stray:
        _, w = await asyncio.open_connection(HOST, parent.port)
        w.write(MAGIC + stray)
        await w.drain()
    parent.open(
        wire.Punch(
            punch_id=pid,
            role="parent",
            address=f"{HOST}:{child.port}",
            endpoint=parent_endpoint,
            timeout_s=5,
        )
    )
    child.open(
        wire.Punch(
            punch_id=pid,
            role="child",
            address=f"{HOST}:{parent.port}",
            endpoint=parent_endpoint,
            timeout_s=5,
        )
    )
    return child, parent, pid, tasks


def _snapshot(key, version):
    payload = np.random.default_rng(version).bytes(300 * 1024 + 17 * version)
    return build_manifest(
        run_id="t",
        version=version,
        tensors=[],
        payload=payload,
        chunk_size=64 * 1024,
        dtype="uint8",
        key=key,
    ), payload


def test_punched_link_carries_signed_snapshot_fetches_both_ways():
    """The child pulls v1 through the punched link; after a re-plan swaps the two, the old
    parent pulls v2 from the old child through the same connection (a second one between the
    same punch ports could not be opened)."""
    key = RunKey.generate()
    (m1, p1), (m2, p2) = _snapshot(key, 1), _snapshot(key, 2)

    async def body():
        zctx = zmq.asyncio.Context()
        try:
            cfg = dict(window=3, timeout_s=5, chunk_bytes=64 * 1024)
            a, b = Relay(zctx, RelayConfig(**cfg)), Relay(zctx, RelayConfig(**cfg))
            a.store.add(SnapshotBuffer(m1, p1))
            serving = [asyncio.create_task(r.serve_forever()) for r in (a, b)]
            bt, at, pid, tasks = await _punched_pair(a.endpoint, b.endpoint, stray=os.urandom(16))
            a.resolve, b.resolve = at.resolve, bt.resolve
            got1, s1 = await b.receive(m1, via(pid, a.endpoint), None)
            b.store.add(SnapshotBuffer(m2, p2))
            got2, s2 = await a.receive(m2, via(pid, b.endpoint), None)
            ends = [(await t.links[pid]).sock for t in (bt, at)]
            ends = [(e.getsockname()[1], e.getpeername()[1]) for e in ends]
            # a new punch id for the same pair (the learner forgot the link) reuses it too
            again = os.urandom(16)
            bt.open(
                wire.Punch(
                    punch_id=again,
                    role="child",
                    address=f"{HOST}:{at.port}",
                    endpoint=a.endpoint,
                    timeout_s=5,
                )
            )
            same = await bt.resolve(via(again, a.endpoint)) == await bt.resolve(
                via(pid, a.endpoint)
            )
            for t in tasks + serving:
                t.cancel()
            return bytes(got1.payload), bytes(got2.payload), (s1, s2), bt, at, ends, same
        finally:
            zctx.destroy(linger=0)

    got1, got2, stats, bt, at, ends, same = run(body())
    assert got1 == p1 and got2 == p2 and all(s.failures == [] for s in stats)
    assert bt.opened == at.opened == 1 and same
    # one connection between the two punch ports (the addresses the reflector reports)
    assert ends == [(bt.port, at.port), (at.port, bt.port)]
    assert at.strays == 1  # the connection with a foreign punch id was closed, the link opened


def test_resolve_reports_an_unknown_link_as_lost_and_a_failed_punch_as_unpunchable():
    async def body():
        t = Tunnels(HOST, pick_punch_port(HOST))
        task = asyncio.create_task(t.serve_forever())
        lost = await _error(t.resolve(via(b"q" * 16, "tcp://127.0.0.1:9"), 1))
        nobody = pick_punch_port(HOST)  # no peer punches back: the punch times out
        t.open(
            wire.Punch(
                punch_id=b"p" * 16,
                role="child",
                address=f"{HOST}:{nobody}",
                endpoint="tcp://127.0.0.1:9",
                timeout_s=1,
            )
        )
        failed = await _error(t.resolve(via(b"p" * 16, "tcp://127.0.0.1:9"), 5))
        task.cancel()
        return lost, failed, t

    lost, failed, t = run(body())
    assert lost.reason == "tunnel_lost" and failed.reason == "unpunchable" and t.failed == 1


async def _error(coro):
    try:
        await coro
    except nat_links.LinkFailed as exc:
        return exc
    raise AssertionError("no LinkFailed")


@pytest.mark.parametrize(
    "frame",
    [
        HEADER.pack(9, 1, 0),  # unknown kind
        HEADER.pack(2, 1, MAX_FRAME + 1),  # oversize
        HEADER.pack(1, 1, 0),  # an "open" numbered as this end numbers its own sessions
    ],
)
def test_hostile_frame_ends_the_tunnel(frame):
    async def body():
        a, b = socket.socketpair()
        a.setblocking(False)
        b.setblocking(False)
        child = Tunnel(a)
        task = asyncio.create_task(child.run())
        await child.ready.wait()
        await asyncio.get_running_loop().sock_sendall(b, frame)
        await task  # returns: the tunnel ended itself
        return await asyncio.get_running_loop().sock_recv(b, 16)

    assert run(body(), 10) == b""  # and closed its end


def test_tunnel_refuses_sessions_past_its_bound():
    async def body():
        a, b = socket.socketpair()
        a.setblocking(False)
        b.setblocking(False)
        target = await asyncio.start_server(lambda r, w: None, HOST, 0)
        parent = Tunnel(
            a,
            target=f"tcp://{HOST}:{target.sockets[0].getsockname()[1]}",
            odd=False,
            max_sessions=2,
        )
        task = asyncio.create_task(parent.run())
        loop = asyncio.get_running_loop()
        for sid in (1, 3, 5):  # the peer numbers its sessions odd
            await loop.sock_sendall(b, HEADER.pack(1, sid, 0))
        got = b""
        while len(got) < HEADER.size and (part := await loop.sock_recv(b, HEADER.size - len(got))):
            got += part
        task.cancel()
        target.close()
        return struct.unpack("!BII", got), len(parent.sessions)

    (kind, sid, n), open_sessions = run(body(), 10)
    assert (kind, sid, n) == (3, 5, 0)  # the third session was closed at once
    assert open_sessions == 2


# ----------------------------------------------------------------------------- placement


def _peers(nats):
    return [
        Peer(f"w{i}", 100.0, 100.0, reachable=n != "none", endpoint=f"tcp://h{i}:1", nat=n)
        for i, n in enumerate(nats)
    ]


def _parents(chains):
    return {c[i]: (c[i - 1] if i else "learner") for c in chains for i in range(len(c))}


def test_planner_uses_punchable_workers_as_relays_and_feeds_symmetric_ones_directly():
    nats = ["reachable"] * 4 + ["punchable"] * 11 + ["none"]
    peers = _peers(nats)
    chains = plan_chains(peers, uplink_mbit=400, link_mbit=100).chains
    kinds = {p.worker_id: p.nat for p in peers}
    parents = _parents(chains)
    assert sum(len(c) for c in chains) == 16
    assert len(chains) <= 5  # the chains do not collapse toward the star
    assert any(kinds[c[i]] == "punchable" for c in chains for i in range(len(c) - 1))
    for c in chains:
        assert all(kinds[w] != "none" for w in c[:-1])  # a symmetric NAT never relays
    tail = "w15"
    assert parents[tail] == "learner" or kinds[parents[tail]] == "reachable"


def test_coordinator_punches_to_punchable_parents_once_and_demotes_on_failure():
    c = Coordinator(make_topology("chains"), "tcp://learner:1")
    c.join("p", "tcp://10.0.0.2:5", nat="punchable")
    c.join("k", "tcp://10.0.0.3:5", nat="punchable")
    c.join("r", "tcp://10.0.0.4:5")
    c.classify("p", "punchable", "203.0.113.2:4000")
    c.classify("k", "punchable", "203.0.113.3:4000")
    assert c.route("k", "tcp://10.0.0.4:5") == ("tcp://10.0.0.4:5", [])  # reachable: as is
    source, punches = c.route("k", "tcp://10.0.0.2:5")
    pid, endpoint = split_via(source)
    assert endpoint == "tcp://10.0.0.2:5" and plain(source) == endpoint
    assert {(who, m.role, m.address) for who, m in punches} == {
        ("p", "parent", "203.0.113.3:4000"),
        ("k", "child", "203.0.113.2:4000"),
    }
    assert all(m.punch_id == pid for _, m in punches)
    assert c.route("k", "tcp://10.0.0.2:5") == (source, [])  # the live link is reused
    # the punch failed: the child becomes a tail, the parent keeps relaying (one strike)
    new = c.reattach("k", source, "unpunchable")
    assert c.peers["k"].nat == "none" and c.peers["p"].nat == "punchable"
    assert plain(new) != "tcp://10.0.0.2:5" and c.peers["p"].alive
    c.join("j", "tcp://10.0.0.5:5", nat="punchable")
    c.classify("j", "punchable", "203.0.113.5:4000")
    src2, _ = c.route("j", "tcp://10.0.0.2:5")
    c.reattach("j", src2, "unpunchable")
    assert c.peers["p"].nat == "none"  # a second child failed: it relays no more


def test_a_lost_tunnel_is_punched_again_not_held_against_anyone():
    c = Coordinator(make_topology("chains"), "tcp://learner:1")
    for w, n in (("p", "10.0.0.2"), ("k", "10.0.0.3")):
        c.join(w, f"tcp://{n}:5", nat="punchable")
        c.classify(w, "punchable", f"{n}:4000")
    first, _ = c.route("k", "tcp://10.0.0.2:5")
    c.reattach("k", first, "tunnel_lost")
    again, punches = c.route("k", "tcp://10.0.0.2:5")
    assert again != first and len(punches) == 2
    assert c.peers["k"].nat == c.peers["p"].nat == "punchable"


def test_keyframes_come_only_from_directly_reachable_workers():
    c = Coordinator(make_topology("chains"), "tcp://learner:1")
    c.join("p", "tcp://10.0.0.2:5", nat="punchable")
    c.join("k", "tcp://10.0.0.3:5")
    c.publish(1)
    c.installed("p", 1)
    assert c.keyframe_source("k", 1) == "tcp://learner:1"


def test_punch_message_round_trips_and_rejects_a_bad_role():
    m = wire.Punch(
        punch_id=b"i" * 16,
        role="child",
        address="203.0.113.2:4000",
        endpoint="tcp://10.0.0.2:5",
        timeout_s=10,
    )
    assert wire.decode(wire.encode(m), 4096) == m
    bad = m.model_dump() | {"role": "king"}
    with pytest.raises(wire.WireError, match="role"):
        wire.decode(msgpack.packb(bad, use_bin_type=True), 4096)
    assert via(b"\x01" * 16, "tcp://x:1").startswith("punch/01") and split_via("tcp://x:1") == (
        b"",
        "tcp://x:1",
    )


# ----------------------------------------------------------------------------- the learner


def test_learner_classifies_a_worker_from_its_reflector_and_shows_it(plane, ctx):  # noqa: F811
    """Join, probe the reflectors the JoinAck names from the punch port, report the nonces:
    the learner answers from its own records and the stats (dashboard) carry the verdict."""
    relay = socket.socket()
    relay.bind((HOST, 0))
    relay.listen(4)  # the worker's relay socket, for the dial-back
    endpoint = f"tcp://{HOST}:{relay.getsockname()[1]}"
    sock = connect(plane, ctx)
    ack = ask(sock, wire.Join(worker_id="w1", relay_endpoint=endpoint))
    assert len(ack.reflectors) == 2
    assert plane.stats().workers["w1"]["nat"] == "unknown"  # a tail until it reports
    port = pick_punch_port(HOST)
    nonces = asyncio.run(probe_all(ack.reflectors, HOST, port, relay.getsockname()[1]))
    # a report naming nonces the reflector never saw is refused, and the session goes on
    err = ask(sock, wire.NatReport(worker_id="w1", nonces=[os.urandom(16), os.urandom(16)]))
    assert isinstance(err, wire.Error) and err.reason == "probe_not_seen"
    status = ask(sock, wire.NatReport(worker_id="w1", nonces=nonces))
    relay.close()
    assert status == wire.NatStatus(nat="reachable", address=f"{HOST}:{port}")
    w = plane.stats().workers["w1"]
    assert w["nat"] == "reachable" and w["transport"] == "tcp"
    assert plane.coordinator.peers["w1"].nat == "reachable"


def test_fetch_through_a_punched_link_that_dies_resumes_elsewhere_without_refetching():
    """Churn on the punched path behaves as on TCP: the parent's link closes mid-fetch, the
    child's fetch fails over to another source and fetches only the chunks it lacks."""
    key = RunKey.generate()
    manifest, payload = _snapshot(key, 1)

    async def body():
        zctx = zmq.asyncio.Context()
        try:
            cfg = dict(window=2, timeout_s=5, chunk_bytes=64 * 1024)
            slow = Relay(zctx, RelayConfig(**cfg, up_mbit=4, shape=True))  # ~0.13 s per chunk
            spare = Relay(zctx, RelayConfig(**cfg))
            child = Relay(zctx, RelayConfig(**cfg, serve=False))
            for r in (slow, spare):
                r.store.add(SnapshotBuffer(manifest, payload))
            serving = [asyncio.create_task(r.serve_forever()) for r in (slow, spare)]
            ct, pt, pid, tasks = await _punched_pair(slow.endpoint)
            child.resolve = ct.resolve
            reasons = []

            async def reattach(bad, fail):
                reasons.append((bad.endpoint, fail.reason))
                return spare.endpoint

            fetch = asyncio.create_task(child.receive(manifest, via(pid, slow.endpoint), reattach))
            while child.store.get(1) is None or child.store.get(1).count < 2:
                await asyncio.sleep(0.01)  # two chunks came through the link
            (await pt.links[pid]).close()  # the parent's end of the link goes away
            buf, stats = await fetch
            for t in tasks + serving:
                t.cancel()
            return bytes(buf.payload), stats, reasons
        finally:
            zctx.destroy(linger=0)

    got, stats, reasons = run(body())
    assert got == payload
    assert (
        reasons
        and reasons[0][0].startswith("punch/")
        and reasons[0][1] in ("disconnected", "timeout")
    )
    assert stats.chunks == manifest.layout.num_chunks  # none fetched twice


def test_a_learner_stopping_mid_probe_logs_no_traceback(caplog):
    """A probe still being read when the learner's loop ends: its handler is cancelled. On
    Python 3.11 a cancelled stream handler was logged as "Exception in callback" with two
    tracebacks in every operator's learner.log at Ctrl-C; it now ends quietly."""

    async def main():
        ref = Reflector(HOST)
        await ref.start()
        _, writer = await asyncio.open_connection(HOST, ref.ports[0])  # sends nothing
        while len(asyncio.all_tasks()) < 2:  # the handler is waiting for the probe
            await asyncio.sleep(0)
        ref.close()
        writer.close()

    with caplog.at_level(logging.ERROR, logger="asyncio"):
        asyncio.run(main())  # cancels the waiting handler
    assert not [r for r in caplog.records if r.name == "asyncio"], caplog.text
