"""Hostile relays and reporters for ``benchmarks/security_drill.py`` (issue 31, attacks 1, 3, 4;
docs/security.md, "Relay reports").

Two real workers whose relay misbehaves (the rest of the worker is honest: it joins, installs,
generates), started as ``drill_relays.py --kind KIND join LINE [echo-worker join options]``:

  * ``black_hole``: accepts its children's chunk requests and never answers one;
  * ``selective_relay``: serves a child that fetches from the start intact chunks until
    chunk 1, then corrupt ones; serves anyone whose first request is mid-snapshot (a child that
    re-attached, or the learner's probe) intact. The old probe told itself apart by its
    ticket's lifetime; this relay does not even need that.

and one scripted peer for the attack registry (``ATTACKS``, same ``Target`` as
``drill_attacks.py``):

  * ``stranger_reports``: an insider that is no child of the honest relay reports it as timed
    out, disconnected and corrupt, again and again.

The ``check_*`` functions say what "refused or neutralised" means for each, from the learner's
metrics rows (``relay_reports``, ``relays_marked``) and the honest workers' figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from echo_rl.core.steprow import COL  # noqa: E402

KINDS = ("black_hole", "selective_relay")


def _install_hostile_relay(kind: str) -> None:
    """Every ChunkServer this process builds (the worker's relay) turns hostile, at the points
    where a reply is queued, taken to be sent and its bytes chosen (``_enqueue``,
    ``_next_reply``, ``outgoing``): the server's own request checks, tickets and limits stay as
    they are. ``black_hole`` never takes a reply; ``selective_relay`` corrupts every reply to a
    requester whose first request of that version was chunk 0, from chunk 1 on.

    (It used to swap the server's outbox for a hostile queue. When the server began keeping
    one queue per peer, that swap made it crash on its first request: the relay read as
    unreachable and the drill's selective relay never corrupted anything.)"""
    from echo_rl.broadcast.source import ChunkServer

    enqueue, next_reply, outgoing = (
        ChunkServer._enqueue,
        ChunkServer._next_reply,
        ChunkServer.outgoing,
    )
    corrupt_next: set[int] = set()  # servers whose reply being sent now goes out corrupt
    first: dict[tuple[int, str, int], int] = {}  # (server, requester, version) -> first index

    def hostile_enqueue(
        self: Any, ident: bytes, rid: int, version: int, index: int, who: str, form: str = "payload"
    ) -> None:
        first.setdefault((id(self), who, version), index)
        enqueue(self, ident, rid, version, index, who, form)

    async def hostile_next_reply(self: Any) -> Any:
        if kind == "black_hole":
            await asyncio.Event().wait()  # never
        item = await next_reply(self)
        _ident, _rid, version, index, who, _t, _form = item
        if first.get((id(self), who, version)) == 0 and index >= 1:
            corrupt_next.add(id(self))
        else:
            corrupt_next.discard(id(self))
        return item

    def hostile_outgoing(self: Any, buf: Any, index: int) -> Any:
        data = outgoing(self, buf, index)
        if id(self) not in corrupt_next:
            return data
        flipped = bytearray(data)
        flipped[len(flipped) // 2] ^= 0xFF
        return bytes(flipped)

    ChunkServer._enqueue = hostile_enqueue  # type: ignore[method-assign]
    ChunkServer._next_reply = hostile_next_reply  # type: ignore[method-assign]
    ChunkServer.outgoing = hostile_outgoing  # type: ignore[method-assign]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="drill_relays.py", usage="%(prog)s --kind KIND join LINE ...")
    ap.add_argument("--kind", required=True, choices=KINDS)
    args, rest = ap.parse_known_args(argv)
    _install_hostile_relay(args.kind)
    from echo_rl.cli import worker as cli

    return cli.main(rest)


# ----------------------------------------------------------------------------- scripted reporter


def stranger_reports(t: Any, rounds: int = 20) -> dict[str, Any]:
    """An insider (a token, a session, no child of anyone's) names the honest relay in
    timeout, disconnected and corrupt reports."""
    from drill_attacks import ask, join_evil

    from echo_rl.core import wire
    from echo_rl.core.addresses import same_endpoint

    sock, _, ack = join_evil(t, "reporter")
    version = ack.version  # the learner's newest, as its join reply says
    replies: dict[str, int] = {}
    for i in range(rounds):  # noqa: B007
        for reason in ("timeout", "disconnected", "corrupt"):
            got = ask(
                sock,
                wire.SourceRequest(
                    worker_id="reporter",
                    version=version,
                    bad_source=t.relay,
                    reason=reason,
                    chunk=0,
                ),
                5.0,
            )
            replies[got] = replies.get(got, 0) + 1
    sock.close()
    # Since the join ack may hand a peer as the first source (JoinAck.snapshot_endpoint), the
    # stranger can be handed the very relay it names: then it is that relay's assigned child
    # and its reports count, as one witness's (check_stranger).
    handed = same_endpoint(ack.snapshot_endpoint, t.relay)
    return {"reports_sent": 3 * rounds, "replies": replies, "handed_the_relay_at_join": handed}


ATTACKS = {"stranger_reports": stranger_reports}


# ----------------------------------------------------------------------------- checks


def last_row(run_dir: Path) -> dict[str, Any]:
    """The learner's newest metrics line (``relay_reports``, ``relays_marked`` ...)."""
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return json.loads(lines[-1]) if lines else {}


def _honest(r: dict[str, Any]) -> list[str]:
    adm = r.get("honest_admitted", {})
    out = [f"honest {w} admitted nothing" for w in ("w0", "w1") if not adm.get(w)]
    if r.get("honest_struck"):
        out.append(f"honest workers struck: {r['honest_struck']}")
    return out


def check_stranger(r: dict[str, Any]) -> list[str]:
    reports = r.get("relay_reports_delta", {})
    out = _honest(r)
    unassigned = sum(n for k, n in reports.items() if k.endswith(":unassigned"))
    if r["attacker"].get("handed_the_relay_at_join"):
        # its own source: one witness (its token), whose word never convicts without the
        # learner's failed probe, and whose probes are bounded per minute
        probes = sum(n for k, n in reports.items() if k.startswith("probe:"))
        if probes > PROBES_PER_MIN:
            out.append(f"one witness started {probes} probes (bound {PROBES_PER_MIN} a minute)")
    elif unassigned < r["attacker"].get("reports_sent", 1):
        out.append(
            f"only {unassigned} of {r['attacker'].get('reports_sent')} reports counted unassigned"
        )
    if r.get(COL.relays_marked, 0):
        out.append(f"{r[COL.relays_marked]} relay(s) marked: a stranger removed a relay")
    return out


_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")
PROBES_PER_MIN = 4  # security.report_probes_per_min, the default the drill runs with
LOSS_BOUND_S = 2.0  # issue 52: a black hole's child loses at most this much


def child_loss(log: str, since: float, hole: str) -> dict[str, Any] | None:
    """What the black hole at endpoint ``hole`` cost its child, from the child's log (lines
    after wall time ``since``): the gap between its last install before its first failover
    from the hole and its first install after its last failover from it or skip of it (the
    seconds its rollouts ran on an old version), its usual install interval in the phase, and
    the failovers and skips (notices naming the relay it left, echo_rl/worker/snapshots.py). Failovers
    from other sources (the learner's own endpoint stalls now and then at ten or more versions
    a second, in the honest run too) are counted apart. None: it never failed over the hole."""
    installs, fails, skips, others = [], [], [], []
    for line in log.splitlines():
        m = _STAMP.match(line)
        if m is None:
            continue
        t = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
        if t < since:
            continue
        if "installed snapshot v" in line:
            installs.append(t)
        elif "snapshot source" in line and "failed (" in line:
            (fails if f"source {hole} failed" in line else others).append(t)
        elif "failed here before; asking for another" in line and hole in line:
            skips.append(t)
    if not fails:
        return None
    before = [t for t in installs if t < fails[0]]
    after = [t for t in installs if t > max(fails + skips)]
    gaps = sorted(b - a for a, b in zip(installs, installs[1:]))
    return {
        "failovers": len(fails),
        "other_failovers": len(others),
        "skipped_notices": len(skips),
        "lost_s": round(after[0] - before[-1], 3) if before and after else None,
        "usual_install_interval_s": round(gaps[len(gaps) // 2], 3) if gaps else None,
    }


def check_black_hole(r: dict[str, Any]) -> list[str]:
    reports = r.get("relay_reports_delta", {})
    out = _honest(r)
    for w, loss in (r.get("child_loss") or {}).items():
        if loss["lost_s"] is None or loss["lost_s"] > LOSS_BOUND_S:
            out.append(f"child {w} lost {loss['lost_s']} s to the black hole (> {LOSS_BOUND_S})")
    if not any(k.startswith(("timeout:", "disconnected:")) for k in reports):
        out.append("no child reported the black hole (it was given no child: not exercised)")
    elif not reports.get("probe:unreachable") and not any(
        k.endswith(":convicted") for k in reports
    ):
        out.append(f"the black hole was not convicted: {reports}")
    return out


def check_selective(r: dict[str, Any]) -> list[str]:
    reports = r.get("relay_reports_delta", {})
    out = _honest(r)
    if not reports.get("corrupt:counted") and not reports.get("corrupt:convicted"):
        out.append("no child reported a corrupt chunk (it was given no child: not exercised)")
    if r.get("reporters_banned"):
        out.append(f"honest reporters banned: {r['reporters_banned']}")
    return out


CHECKS = {
    "stranger_reports": check_stranger,
    "black_hole": check_black_hole,
    "selective_relay": check_selective,
}


def wait_for(pred: Any, timeout: float, poll: float = 0.5) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(poll)
    return False


if __name__ == "__main__":
    sys.exit(main())
