"""A closed snapshot port is named by the learner from its workers' reports (issue 55, item 2;
echo_rl/control/snapshot_path.py, docs/ports.md "A closed snapshot port")."""

from __future__ import annotations

import logging

import pytest
from fakes import FakeClock
from test_security import make_plane, zctx  # noqa: F401 (fixtures)

from echo_rl.broadcast.snapshot import Snapshot, build_manifest
from echo_rl.control.snapshot_path import CORROBORATE_S, SAY_EVERY_S, WINDOW_S, SnapshotPathWatch
from echo_rl.core import wire

pytestmark = pytest.mark.timeout(60)

EP = "tcp://203.0.113.5:5556"


def published(plane):
    """A control plane holding version 0, so source requests about it are served."""
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
    return plane


def watch(served: list[int] | None = None) -> tuple[SnapshotPathWatch, FakeClock]:
    clock = FakeClock()
    box = served if served is not None else [0]
    w = SnapshotPathWatch(clock, lambda: box[0])
    w.attach(EP)
    return w, clock


def test_two_workers_reports_name_the_port_and_the_fix(caplog):
    served = [0]
    w, clock = watch(served)
    assert w.report("k0", "w0", EP, "timeout")
    served[0] += 4096  # the learner still serves someone: one report is not enough
    clock.t += CORROBORATE_S + 1
    assert w.verdict(workers=3) is None
    assert w.report("k1", "w1", EP, "disconnected")
    text = w.verdict(workers=3)
    assert text is not None
    assert "snapshot port 5556" in text and "w0, w1" in text and "Open TCP 5556" in text
    assert "public_host" in text and "stale" in text
    with caplog.at_level(logging.ERROR, logger="echo.control"):
        w.say(3)
        w.say(3)  # at most once a minute
        clock.t += SAY_EVERY_S  # the reports go on: said again a minute later
        w.report("k0", "w0", EP, "timeout")
        w.report("k1", "w1", EP, "timeout")
        w.say(3)
    assert sum("snapshot port 5556" in r.getMessage() for r in caplog.records) == 2
    assert w.report("k1", "w1", EP, "timeout") and w.reporters() == ["w0", "w1"]  # one per key


def test_one_report_is_enough_when_the_learner_served_nothing_since():
    w, clock = watch([100])
    w.report("k0", "w0", EP, "timeout")  # a chain head: the only worker fed by the learner
    assert w.verdict(workers=4) is None  # not yet: nothing to corroborate it with
    clock.t += CORROBORATE_S
    assert "w0" in (w.verdict(workers=4) or "")
    assert w.verdict(workers=1) is not None  # alone in the fleet: its report is the fleet's


def test_reports_end_with_the_window_and_other_sources_do_not_count():
    w, clock = watch()
    assert not w.report("k0", "w0", "tcp://10.0.0.7:5560", "timeout")  # a relay, not the learner
    assert not w.report("k0", "w0", EP, "corrupt")  # not what a closed port looks like
    assert not w.report("k0", "w0", EP, "avoided")
    assert w.verdict(workers=1) is None and w.reports == 0
    w.report("k0", "w0", EP, "timeout")
    assert w.verdict(workers=1) is not None
    clock.t += WINDOW_S + 1  # the port was opened: no more reports
    assert w.verdict(workers=1) is None and w.reporters() == []


def test_a_live_learner_names_its_snapshot_port_from_its_workers_source_requests(
    make_plane,  # noqa: F811
    zctx,  # noqa: F811
    caplog,
):
    """Two workers' source requests naming the learner's own snapshot endpoint, as a worker
    whose fetch timed out sends them: the learner's stats and log name the port."""
    from test_security import ask, peer

    plane = published(make_plane())
    socks = {w: peer(plane, zctx) for w in ("w0", "w1")}
    for w, s in socks.items():
        ack = ask(s, wire.Join(worker_id=w, can_relay=False))
        assert isinstance(ack, wire.JoinAck)
        # the endpoint a worker never avoids (echo_rl/worker/snapshots.py), whatever its source is
        assert ack.learner_snapshot_endpoint == plane.snapshot_endpoint
    assert plane.stats().snapshot_path == ""
    port = plane.snapshot_endpoint.rsplit(":", 1)[1]
    with caplog.at_level(logging.ERROR, logger="echo.control"):
        for w, s in socks.items():
            reply = ask(
                s,
                wire.SourceRequest(
                    worker_id=w, version=0, bad_source=plane.snapshot_endpoint, reason="timeout"
                ),
            )
            assert isinstance(reply, wire.SourceGrant)  # it still gets a source
    stats = plane.stats()
    assert f"snapshot port {port}" in stats.snapshot_path and stats.snapshot_path_reporters == 2
    assert any(f"snapshot port {port}" in r.getMessage() for r in caplog.records)


def test_a_worker_reporting_again_and_again_keeps_its_streak():
    """The README's netns run: one chain head, fed by the learner, re-reported the dropped
    port every 1.5 s (its stall bound), and each report restarted the corroboration clock,
    so the learner never spoke. A streak keeps its first report's time and bytes served."""
    w, clock = watch([7])
    for _ in range(3):
        w.report("head", "w0", EP, "timeout")
        clock.t += 1.5
    assert w.verdict(workers=3) is not None  # 4.5 s since the streak began, nothing served
    clock.t += WINDOW_S + 1  # the head stopped reporting: the streak ends
    w.report("head", "w0", EP, "timeout")  # a new streak starts now
    assert w.verdict(workers=3) is None


def test_the_capacity_advice_names_the_port_while_workers_report_it(caplog):
    """With the snapshot port closed, T_bcast outlasts the step and the learner advised
    raising kappa; while the workers report the port, the warning is theirs instead."""
    from types import SimpleNamespace

    from echo_rl.core.config import EchoConfig
    from echo_rl.learner.provision import CapacityFeedback

    server = SimpleNamespace(
        set_requirement=lambda need: None, members=SimpleNamespace(decisions=[])
    )
    fb = CapacityFeedback(EchoConfig(), server, trails=None, metrics=None, step=lambda: 1)  # type: ignore[arg-type]
    with caplog.at_level(logging.WARNING, logger="echo.learner"):
        fb.tell(0.05, 10.0, [])  # T_bcast 10 s > kappa x T_train: infeasible
        fb.tell(0.05, 10.0, [], "2 worker(s) report ... snapshot port 5556")
        for _ in range(20):  # the same advice step after step: said once a minute, not each
            fb.tell(0.05, 10.0, [], "2 worker(s) report ... snapshot port 5556")
            fb.tell(0.05, 10.0, [])
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2
    assert "raise kappa" in said[0] and said[1].endswith("snapshot port 5556")


def test_source_requests_with_made_up_reasons_or_in_a_flood_cost_nothing(
    make_plane,  # noqa: F811
    zctx,  # noqa: F811
):
    """A stranger's reason string never reaches a counter's key (the closed SourceReason set:
    refused as malformed, the learner serves on); 300 'avoided' requests from one worker are
    no evidence: no probe, one counter, the plane still answers."""
    from test_security import ask, peer

    plane = published(make_plane())
    sock = peer(plane, zctx)
    assert isinstance(ask(sock, wire.Join(worker_id="w0", can_relay=False)), wire.JoinAck)
    good = wire.encode(
        wire.SourceRequest(
            worker_id="w0", version=0, bad_source="tcp://10.0.0.9:1", reason="timeout"
        )
    )
    for junk in (good.replace(b"timeout", b"x" * 7), good.replace(b"timeout", b"\xff" * 7)):
        assert isinstance(ask(sock, junk), wire.Error)  # refused, not counted under its name
    for _ in range(300):
        ask(
            sock,
            wire.SourceRequest(
                worker_id="w0", version=0, bad_source="tcp://10.0.0.9:1", reason="avoided"
            ),
        )
    stats = plane.stats()
    assert set(stats.relay_reports) <= {"avoided:other"} and stats.snapshot_path == ""
    assert sum(stats.rejected.values()) == 2  # both junk requests counted as refusals
    assert isinstance(ask(sock, wire.Heartbeat(worker_id="w0", version=-1)), wire.HeartbeatAck)
