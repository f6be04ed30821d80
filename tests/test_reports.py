"""Relay reports are evidence about a link, not verdicts (echo_rl/broadcast/reports.py, issue 31):
attacks 1, 3 and 4 at the coordinator, the control plane and the learner's probe."""

from __future__ import annotations

import asyncio
import time

import msgpack
import pytest
import zmq
import zmq.asyncio
from test_security import make_plane, zctx  # noqa: F401 (fixtures)

from echo_rl.broadcast.coordinator import Coordinator
from echo_rl.broadcast.reports import ReportBook
from echo_rl.broadcast.snapshot import RunKey, build_manifest
from echo_rl.broadcast.topology import make_topology
from echo_rl.control.verify import Report, Verifier
from echo_rl.core import wire
from echo_rl.core.security import KeyPair

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


def test_distinct_witnesses_convict_of_corruption_and_the_mark_expires_into_a_reprobe():
    c, plan = chain(6, convict_after=2, mark_s=10.0)
    ep, first = relay_with_child(plan)
    c.reattach(first, ep, "corrupt", now=100.0)
    c.reattach(first, ep, "corrupt", now=100.5)  # the same child twice is one witness
    assert not c.owner(ep).corrupt
    c.sources["w5"] = ep  # the next plan gives the relay another child, which also reports
    c.reattach("w5", ep, "suspect", now=101.0)
    relay = c.owner(ep)
    assert relay.corrupt and ep not in {s for w, s in c.publish(2).items() if w != "w5"}
    assert c.reports.due(105.0) == [] and c.reports.due(111.0) == [ep]
    c.confirm(ep, "corrupt", now=111.0)  # the re-probe failed: marked again, twice as long
    assert c.reports.marks[ep].until == pytest.approx(131.0) and relay.corrupt
    c.confirm(ep, "intact", now=131.0)  # a passed re-probe lets it back
    assert not relay.corrupt and ep not in c.reports.marks


def test_timeouts_convict_nobody_without_the_learners_failed_probe():  # issue 52, attack 1
    """A reporter's own bad link, or a lie, says "timeout" as well as a dead relay does."""
    c, plan = chain(6, convict_after=2)
    ep, first = relay_with_child(plan)
    for i, child in enumerate((first, "w4", "w5")):
        c.sources[child] = ep
        c.reattach(child, ep, "timeout" if i % 2 else "disconnected")
    assert c.owner(ep).alive and ep not in c.reports.marks
    assert c.reports.counts == {"disconnected:counted": 2, "timeout:counted": 1}
    c.confirm(ep, "unreachable")  # the learner's own fetch got nothing
    assert not c.owner(ep).alive and ep not in c.publish(2).values()


def test_one_tokens_keys_are_one_witness_and_open_keys_none():  # issue 52, attack 1
    c, plan = chain(6, convict_after=2)
    ep, first = relay_with_child(plan)
    c.sources["w5"] = ep
    c.reattach(first, ep, "corrupt", group="token:a")
    c.reattach("w5", ep, "corrupt", group="token:a")  # a second key of the same token
    assert not c.owner(ep).corrupt
    c.sources["w4"] = ep
    c.reattach("w4", ep, "corrupt", group="")  # open mode: keys are free, no witness
    assert not c.owner(ep).corrupt
    c.sources["w3"] = ep
    c.reattach("w3", ep, "corrupt", group="token:b")  # another token: a second witness
    assert c.owner(ep).corrupt


def test_a_child_moved_by_its_own_report_is_no_witness_where_it_lands():  # issue 52, attack 1
    """Two keys walked the relays: each report's new source made the reporter that relay's
    assigned child, so its next report counted. Now the landing place counts for nothing
    until a plan puts the child somewhere for the plan's own reasons."""
    c, plan = chain(6)
    # the deepest child: a plan without its relay puts it under another relay, not the root
    child = max(plan, key=lambda w: int(w[1:]))
    ep = plan[child]
    landed = c.reattach(child, ep, "corrupt")
    assert c.owner(landed) is not None, landed  # moved onto another relay
    assert c.assigned(child, landed) and not c.witnessed(child, landed)
    c.reattach(child, landed, "corrupt")
    assert c.reports.counts == {"corrupt:counted": 1, "corrupt:unassigned": 1}
    newest = c.publish(2)  # the plan's own placement: a witness there again
    assert c.witnessed(child, newest[child]) or newest[child] == "tcp://root"


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
    from echo_rl.broadcast.tickets import mint

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

    from echo_rl.broadcast.snapshot import Snapshot

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
    from echo_rl.broadcast.snapshot import Snapshot

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


# ----------------------------------------------------------------------------- the witnesses


class FakeVerifier:
    def __init__(self) -> None:
        self.probes: list[tuple[str, str]] = []

    def submit(self, endpoint, accused, accuser, layout, chunk, alternates=()) -> bool:
        self.probes.append((endpoint, accuser))
        return True


def probes_for(tmp_path, **security):
    """RelayProbes over a chain, with a token gate: (probes, coordinator, plan, token keys)."""
    from collections import Counter
    from types import SimpleNamespace

    from echo_rl.control.gate import Gate
    from echo_rl.control.probes import RelayProbes
    from echo_rl.core.config import EchoConfig

    cfg = EchoConfig.model_validate({"security": {"join": "token", **security}})
    gate = Gate(cfg.security, tmp_path)
    leaked = gate.tokens.create(uses=3, ttl_s=600)
    other = gate.tokens.create(uses=1, ttl_s=600)
    keys = {w: f"{w:>40}".replace(" ", "k") for w in ("w1", "w2", "w3", "w4", "w5")}
    for w in ("w1", "w2", "w3"):
        assert gate.tokens.redeem(leaked, keys[w]) == ""
    assert gate.tokens.redeem(other, keys["w4"]) == ""
    c, plan = chain(6)
    now = [1000.0]
    layout = SimpleNamespace(total=4, num_chunks=4, version=9)
    newest = SimpleNamespace(total=4, layout=layout, version=9)
    store = SimpleNamespace(
        get=lambda v: newest if v == 9 else None,
        latest=lambda: newest,
        buffers=lambda: [newest],
    )
    table = SimpleNamespace(relay_keys={f"tcp://w{i}": f"relay{i}" for i in range(6)})
    rp = RelayProbes(
        cfg, gate=gate, table=table, store=store, rejected=Counter(), clock=lambda: now[0]
    )
    verifier = FakeVerifier()
    rp.attach(c, verifier)
    gate.keys = object()  # probes need the learner's key pair to exist: any will do here
    return rp, c, verifier, keys, now


def report(rp, keys, worker, endpoint, reason="timeout"):
    rp.relay_report(
        keys[worker],
        wire.SourceRequest(worker_id=worker, version=1, bad_source=endpoint, reason=reason),
    )


def test_a_token_whose_reports_probes_contradict_loses_the_word_for_all_its_keys(tmp_path):
    rp, c, verifier, keys, now = probes_for(tmp_path, false_reports=2)
    for w in ("w1", "w2"):
        c.sources[w] = "tcp://w0"
        report(rp, keys, w, "tcp://w0")
    assert len(verifier.probes) == 2  # each probed at once, on its own report
    for _ep, accuser in verifier.probes:  # the relay answered both probes intact
        rp.verdict("tcp://w0", "relay0", accuser, "intact")
    c.sources["w3"] = "tcp://w0"  # a third key of the same token: its word is gone too
    report(rp, keys, "w3", "tcp://w0")
    assert len(verifier.probes) == 2 and rp.rejected["report_not_counted"] == 1
    c.sources["w4"] = "tcp://w0"  # another token's key still counts, and is probed
    report(rp, keys, "w4", "tcp://w0")
    assert len(verifier.probes) == 3
    assert c.owner("tcp://w0").alive  # timeouts alone never took it out


def test_probes_one_witness_may_start_are_bounded_per_minute(tmp_path):
    rp, c, verifier, keys, now = probes_for(tmp_path, report_probes_per_min=2)
    for i in range(5):
        c.sources["w1"] = f"tcp://w{i % 2}"
        c.publish(i + 2)  # a new plan each time: the child is a witness where it is
        c.sources["w1"] = f"tcp://w{i % 2}"
        report(rp, keys, "w1", f"tcp://w{i % 2}")
    assert len(verifier.probes) == 2 and rp.rejected["report_probe_limited"] == 3
    now[0] += 61.0
    c.sources["w1"] = "tcp://w0"
    report(rp, keys, "w1", "tcp://w0")
    assert len(verifier.probes) == 3


def test_a_child_skipping_a_relay_it_reported_adds_no_evidence_and_starts_no_probe(tmp_path):
    """Issue 52, item 4: notices sent before the learner heard a child's report still name the
    relay; the child asks for another source with the reason ``avoided`` (echo_rl/worker/snapshots.py).
    That is no second report: nothing counted against the relay, no probe, and the child is
    sent elsewhere, never back to the relay it left."""
    rp, c, verifier, keys, now = probes_for(tmp_path)
    c.sources["w1"] = "tcp://w0"
    report(rp, keys, "w1", "tcp://w0")  # the first failure: evidence, probed at once
    assert len(verifier.probes) == 1
    for _ in range(5):
        report(rp, keys, "w1", "tcp://w0", reason="avoided")
        assert c.sources.get("w1", c.source) != "tcp://w0"
    assert len(verifier.probes) == 1
    assert c.reports.counts["avoided:other"] == 5
    assert c.reports.counts["timeout:counted"] == 1
    assert rp.rejected["report_probe_limited"] == 0


def test_a_timeout_probe_asks_for_the_versions_the_relay_installed_and_the_newest(tmp_path):
    """At ten versions a second the learner's newest is often one a relay has not received yet,
    and a relay that just joined is catching up on older ones; its "not yet" is no verdict:
    the quiet drill's black hole escaped on such answers (probe:answered). A timeout is probed
    on the relay's two newest installs (their layouts kept after the payloads went), then the
    learner's newest; a corrupt report on its own version alone."""
    from types import SimpleNamespace

    rp, c, _, keys, _ = probes_for(tmp_path)

    def buf(v):
        return SimpleNamespace(total=4, version=v, layout=SimpleNamespace(version=v, num_chunks=4))

    held = {v: buf(v) for v in (5, 6, 7)}
    rp.store = SimpleNamespace(
        get=held.get, latest=lambda: held[7], buffers=lambda: [*held.values()]
    )
    for v in range(1, 8):
        rp.published(buf(v).layout)
    asked: list[list[int]] = []

    class Verifier:
        def submit(self, endpoint, accused, accuser, layout, chunk, alternates=()) -> bool:
            asked.append([layout.version, *[a.version for a in alternates]])
            return True

    rp.verifier = Verifier()
    c.owner("tcp://w0").installed = {2: 0.2, 3: 0.1}  # catching up: versions the learner dropped
    assert rp.probe("tcp://w0", keys["w1"], -1)
    c.owner("tcp://w1").installed = {}
    assert rp.probe("tcp://w1", keys["w1"], -1)
    assert rp.probe("tcp://w0", keys["w1"], 5)  # a corrupt report names its version
    assert asked == [[3, 2, 7, 6], [7, 6, 5], [5]]
    for v in range(8, 8 + 70):  # a bounded memory of layouts
        rp.published(buf(v).layout)
    assert len(rp.layouts) == 64 and min(rp.layouts) == 14


@pytest.mark.parametrize(
    "holds, serves, outcome",
    [
        ({4}, True, "intact"),  # an honest relay holding one of the versions asked
        ({4}, False, "unreachable"),  # a black hole: refuses what it lacks, sits on what it has
        (set(), True, "answered"),  # holds none of them: every request refused, no verdict
    ],
)
def test_a_timeout_probe_asks_several_versions_and_a_held_one_never_served_convicts(
    monkeypatch, holds, serves, outcome
):
    """The quiet drill's black hole escaped twice on "answered": at twenty versions a second
    the version the probe named was no longer (or not yet) held, and the hole refused it at
    once. A timeout's probe now also asks for the learner's other held versions, one chunk
    each; a version the relay takes and never serves is the black hole's signature."""
    from echo_rl.control import verify

    monkeypatch.setattr(verify, "TIMEOUT_S", 1.0)
    run = RunKey.generate()
    payloads = {v: bytes([v]) * 4096 for v in (3, 4, 5)}
    layouts = {
        v: build_manifest(
            run_id="t", version=v, tensors=[], payload=p, chunk_size=1024, dtype="uint8", key=run
        ).layout
        for v, p in payloads.items()
    }
    relay_keys = KeyPair.generate()

    async def body() -> str:
        ctx = zmq.asyncio.Context()
        server = ctx.socket(zmq.ROUTER)
        server.curve_secretkey, server.curve_publickey = relay_keys.secret, relay_keys.public
        server.curve_server = True
        port = server.bind_to_random_port("tcp://127.0.0.1")

        async def serve() -> None:
            while True:
                ident, frame = await server.recv_multipart()
                req = wire.decode(frame, 1 << 20)
                if req.version not in holds:
                    err = wire.Error(reason="unknown_version", detail="not held", rid=req.rid)
                    await server.send_multipart([ident, wire.encode(err)])
                elif serves:
                    head = wire.Chunk(version=req.version, index=req.index, rid=req.rid)
                    start = req.index * 1024
                    body = payloads[req.version][start : start + 1024]
                    await server.send_multipart([ident, wire.encode(head), body])

        verifier = Verifier(ctx, lambda child, parent: b"t" * 80, 1 << 20, window=2)
        task = asyncio.ensure_future(serve())
        try:
            report = Report(
                f"tcp://127.0.0.1:{port}",
                relay_keys.text,
                "",
                layouts[5],
                1,
                (layouts[4], layouts[3]),
            )
            return await verifier.check(report)
        finally:
            task.cancel()
            server.close(linger=0)
            ctx.destroy(linger=0)

    assert asyncio.run(body()) == outcome


def test_a_timeout_probe_every_version_refused_is_asked_again_and_then_convicts(tmp_path):
    """A black hole still catching up after its join held none of the versions the probe
    named and refused them all ("answered"); the report then stood unconfirmed and the hole
    served on. Such a probe is tried again a second later, at most three times, and the
    reporter's credit waits for the last answer."""
    rp, c, verifier, keys, now = probes_for(tmp_path)
    c.sources["w1"] = "tcp://w0"
    report(rp, keys, "w1", "tcp://w0")
    assert len(verifier.probes) == 1
    rp.verdict("tcp://w0", "relay0", keys["w1"], "answered")
    rp.reprobe()
    assert len(verifier.probes) == 1  # not yet: a second later
    now[0] += 1.0
    rp.reprobe()
    assert len(verifier.probes) == 2 and verifier.probes[1] == ("tcp://w0", keys["w1"])
    rp.verdict("tcp://w0", "relay0", keys["w1"], "unreachable")
    assert c.reports.marks.get("tcp://w0") is not None  # convicted: out of the plan
    counts = c.reports.counts
    assert counts["probe:answered_again"] == 1 and counts["probe:unreachable"] == 1
    assert rp.unconfirmed[rp.gate.witness(keys["w1"]) or keys["w1"]] == 0  # not discredited
    for _ in range(5):  # a relay that refuses every version, always: three retries, then done
        c.sources["w2"] = "tcp://w1"
        report(rp, keys, "w2", "tcp://w1")
    asked = len(verifier.probes)
    for _ in range(6):
        rp.verdict("tcp://w1", "relay1", keys["w2"], "answered")
        now[0] += 1.0
        rp.reprobe()
    assert len(verifier.probes) - asked == 3 and "tcp://w1" not in rp.again
