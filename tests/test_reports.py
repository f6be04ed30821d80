"""Relay reports are evidence about a link, not verdicts (broadcast/reports.py, issue 31):
attacks 1, 3 and 4 at the coordinator, the control plane and the learner's probe."""

from __future__ import annotations

import asyncio
import time

import msgpack
import pytest
import zmq
import zmq.asyncio
from test_security import make_plane, zctx  # noqa: F401 (fixtures)

from broadcast.coordinator import Coordinator
from broadcast.reports import ReportBook
from broadcast.snapshot import RunKey, build_manifest
from broadcast.topology import make_topology
from echo import wire
from echo.security import KeyPair
from learner.verify import Report, Verifier

pytestmark = pytest.mark.timeout(60)


def chain(n: int = 4, **book) -> tuple[Coordinator, dict[str, str]]:
    """One chain root -> w0 -> w1 -> ... (U = b: a single stream)."""
    c = Coordinator(
        make_topology("chains", uplink_mbit=100, link_mbit=100),
        "tcp://root",
        reports=ReportBook(**book),
    )
    for i in range(n):
        c.join(f"w{i}", f"tcp://w{i}", 100, 100, now=-1.0)
    return c, c.publish(1, now=0.0)


def child_of(plan: dict[str, str], endpoint: str) -> str:
    return next(w for w, s in plan.items() if s == endpoint)


def relay_with_child(plan: dict[str, str]) -> tuple[str, str]:
    """(a relay's endpoint, its child) in the plan."""
    ep = next(s for s in plan.values() if s != "tcp://root")
    return ep, child_of(plan, ep)


def test_a_stranger_cannot_remove_a_relay_by_reporting_it():  # attack 3
    c, plan = chain()
    ep, child = relay_with_child(plan)
    stranger = next(w for w in plan if w != child and f"tcp://{w}" != ep)
    for reason in ("timeout", "disconnected", "corrupt"):
        c.reattach(stranger, ep, reason)
    relay = c.owner(ep)
    assert (
        relay.alive and not relay.corrupt and plan == {**c.sources, stranger: c.sources[stranger]}
    )
    assert c.sources[child] == ep  # its real child still pulls there
    assert c.reports.counts == {
        "timeout:unassigned": 1,
        "disconnected:unassigned": 1,
        "corrupt:unassigned": 1,
    }


def test_one_childs_report_moves_that_child_off_the_relay_for_good():  # attack 1: not put back
    c, plan = chain()
    ep, child = relay_with_child(plan)
    others = {w: s for w, s in plan.items() if w != child}
    assert c.reattach(child, ep, "corrupt") != ep  # placed as a plan without the relay would
    assert {w: s for w, s in c.sources.items() if w != child} == others  # nobody else moved
    for v in range(2, 6):  # later publications never put it back under the relay
        assert c.publish(v)[child] != ep
    relay = c.owner(ep)
    assert relay.alive and not relay.corrupt  # one child's word convicts nobody
    assert c.reports.counts == {"corrupt:counted": 1}


def test_distinct_children_convict_and_the_mark_expires_into_a_reprobe():
    c, plan = chain(6, convict_after=2, mark_s=10.0)
    ep, first = relay_with_child(plan)
    c.reattach(first, ep, "timeout", now=100.0)
    c.reattach(first, ep, "timeout", now=100.5)  # the same child twice is one witness
    assert c.owner(ep).alive
    c.sources["w5"] = ep  # the next plan gives the relay another child, which also reports
    c.reattach("w5", ep, "disconnected", now=101.0)
    relay = c.owner(ep)
    assert not relay.alive and ep not in c.publish(2).values()
    assert c.reports.due(105.0) == [] and c.reports.due(111.0) == [ep]
    c.confirm(ep, "unreachable", now=111.0)  # the re-probe failed: marked again, twice as long
    assert c.reports.marks[ep].until == pytest.approx(131.0) and not relay.alive
    c.confirm(ep, "intact", now=131.0)  # a passed re-probe lets it back
    assert relay.alive and ep not in c.reports.marks


def test_a_report_about_a_superseded_version_still_counts():  # attack 4, at the coordinator
    c, plan = chain()
    ep, child = relay_with_child(plan)
    c.publish(2)
    c.sources[child] = "tcp://elsewhere"  # moved on in the current plan ...
    assert c.assigned(child, ep)  # ... but the relay was its source when version 1 went out
    c.reattach(child, ep, "timeout")
    assert c.reports.counts == {"timeout:counted": 1}


def test_the_learners_probe_convicts_at_once():
    c, plan = chain()
    ep, child = relay_with_child(plan)
    c.reattach(child, ep, "corrupt")
    c.confirm(ep, "corrupt")
    assert c.owner(ep).corrupt and ep not in c.publish(2).values()


# ----------------------------------------------------------------------------- the probe


def test_the_probe_asks_as_a_resuming_child_with_a_childs_ticket():  # attack 1: no tell
    """What a relay sees of the learner's probe: a fresh key, a ticket with the children's
    lifetime, a window of requests from the reported chunk on, request ids not starting at 1."""
    run = RunKey.generate()
    payload = bytes(range(256)) * 64
    m = build_manifest(
        run_id="t", version=3, tensors=[], payload=payload, chunk_size=1024, dtype="uint8", key=run
    )
    relay_keys = KeyPair.generate()
    ttl = 3600.0
    from broadcast.tickets import mint

    async def body() -> tuple[list[wire.ChunkRequest], str]:
        ctx = zmq.asyncio.Context()
        server = ctx.socket(zmq.ROUTER)  # a relay's socket, as far as the probe can tell
        server.curve_secretkey, server.curve_publickey = relay_keys.secret, relay_keys.public
        server.curve_server = True
        port = server.bind_to_random_port("tcp://127.0.0.1")
        ep = f"tcp://127.0.0.1:{port}"
        verifier = Verifier(
            ctx, lambda child, parent: mint(run, child, parent, "t", ttl), 1 << 20, window=4
        )
        seen: list[wire.ChunkRequest] = []

        async def serve() -> None:
            while True:
                ident, frame = await server.recv_multipart()
                req = wire.decode(frame, 1 << 20)
                seen.append(req)
                start = req.index * 1024
                await server.send_multipart(
                    [
                        ident,
                        wire.encode(wire.Chunk(version=3, index=req.index, rid=req.rid)),
                        payload[start : start + 1024],
                    ]
                )

        task = asyncio.ensure_future(serve())
        try:
            outcome = await verifier.check(Report(ep, relay_keys.text, "accuser", m.layout, 5))
        finally:
            task.cancel()
            server.close(linger=0)
            ctx.destroy(linger=0)
        return seen, outcome

    seen, outcome = asyncio.run(body())
    assert outcome == "intact"
    assert [r.index for r in seen] == [5, 6, 7, 8]
    assert all(r.rid != 1 for r in seen) and len({r.rid for r in seen}) == 4
    _child, _parent, _run, expires = msgpack.unpackb(seen[0].ticket[64:])
    assert expires - time.time() == pytest.approx(ttl, abs=60)  # a child's ticket lifetime


# ----------------------------------------------------------------------------- the control plane


def test_reports_reach_the_plane_from_children_only_and_about_old_versions_too(make_plane, zctx):  # noqa: F811
    """Attack 3: a joined stranger's timeout report leaves the relay in the plan. Attack 4: a
    child's report about a version the learner no longer holds is answered unknown_version
    and still counted against the relay."""
    from test_security import ask, peer

    from broadcast.snapshot import Snapshot

    async def assign(plane, worker_id, endpoint):  # the plan sends the child to the relay
        plane.coordinator.sources[worker_id] = endpoint
        plane.routes.source(worker_id)  # its ticket is minted: it may report on that relay

    plane = make_plane()
    payload = bytes(range(256)) * 16
    m = build_manifest(
        run_id="t",
        version=0,
        tensors=[],
        payload=payload,
        chunk_size=1024,
        dtype="uint8",
        key=plane.key,
    )
    plane.publish(Snapshot(m, payload))
    relay = peer(plane, zctx)
    ask(relay, wire.Join(worker_id="relay", relay_endpoint="tcp://127.0.0.1:9"))
    relay.send(wire.encode(wire.Installed(worker_id="relay", version=0)))  # a member now
    ask(relay, wire.Heartbeat(worker_id="relay", version=0))
    child, stranger = peer(plane, zctx), peer(plane, zctx)
    ask(child, wire.Join(worker_id="child", can_relay=False))
    ask(stranger, wire.Join(worker_id="stranger", can_relay=False))
    plane._call(assign, plane, "child", "tcp://127.0.0.1:9")
    reply = ask(
        stranger,
        wire.SourceRequest(
            worker_id="stranger", version=0, bad_source="tcp://127.0.0.1:9", reason="timeout"
        ),
    )
    assert isinstance(reply, wire.SourceGrant)
    assert plane.stats().relay_reports == {"timeout:unassigned": 1}
    assert plane.coordinator.owner("tcp://127.0.0.1:9").alive
    reply = ask(
        child,
        wire.SourceRequest(
            worker_id="child", version=7, bad_source="tcp://127.0.0.1:9", reason="timeout"
        ),
    )
    assert isinstance(reply, wire.Error) and reply.reason == "unknown_version"
    assert plane.stats().relay_reports["timeout:counted"] == 1


def test_a_reporter_is_not_sent_to_the_relay_it_reported_for_a_keyframe_either():
    c, plan = chain()
    ep, child = relay_with_child(plan)
    c.installed(c.owner(ep).worker_id, 1)
    assert c.keyframe_source(child, 1) == ep  # the relay holds version 1's full payload
    c.reattach(child, ep, "timeout")
    assert c.keyframe_source(child, 1) != ep


def test_a_joiner_pulls_from_a_peer_that_installed_the_version_not_the_learner():
    c, _ = chain(3)
    assert c.joiner_source("new", 1) == "tcp://root"  # nobody holds it yet
    for w in ("w0", "w1"):
        c.installed(w, 1)
    got = {c.joiner_source("new", 1) for _ in range(4)}
    assert got == {"tcp://w0", "tcp://w1"}  # round robin over the holders
    c.reattach("new", "tcp://w0", "timeout")  # a joiner that reported w0 is not sent back there
    assert {c.joiner_source("new", 1) for _ in range(4)} == {"tcp://w1"}


def test_a_probe_is_not_queued_for_an_empty_payload(make_plane):  # noqa: F811
    """A version with no chunks (an empty delta) gives the probe nothing to ask for: no probe,
    no crash (it was a ValueError from randrange in the message handler)."""
    from broadcast.snapshot import Snapshot

    plane = make_plane()
    m = build_manifest(
        run_id="t",
        version=0,
        tensors=[],
        payload=b"",
        chunk_size=1024,
        dtype="uint8",
        key=plane.key,
    )
    plane.publish(Snapshot(m, b""))
    plane.table.relay_keys["tcp://127.0.0.1:9"] = "K"

    async def probe(plane):
        return plane.routes.probes.probe("tcp://127.0.0.1:9", "accuser", 0)

    assert plane._call(probe, plane) is False
