"""Hand-back and staleness attacks for the security drill (issue 31, attacks 2 and 6), with the
``Target`` interface of ``benchmarks/drill_attacks.py``: each function runs against a real,
training learner and returns a dict of what happened; each ``check_*`` returns the problems
found in it (empty: refused or neutralised, counted, and no honest worker harmed).

  * ``forged_handback``: a scripted insider takes groups and hands them back as prefixes of
    tokens it never sampled (log-prob -9999). Expected: the learner checks them before anyone
    continues them, refuses them, strikes and quarantines the insider, and nothing of them is
    continued (``echo_rl.control.handbacks``);
  * ``cherry_pick``: a real worker (``echo_rl.worker.agent.Worker``, its own model) that generates its
    groups honestly, hands back those whose mean reward is below the median it has seen (as
    finished prefixes), and delivers the rest. Expected: counted per worker, bounded, and
    flagged from the reward percentiles of what it returned;
  * ``edge_holder``: a real worker that holds each batch until the learner has moved on
    ``learner.staleness - 1`` versions, so its deliveries sit at the staleness edge. Expected:
    its credit per trajectory is below the honest workers' (``learner.staleness``).

The two real workers run as child processes of this file::

    python benchmarks/drill_handbacks.py worker --kind cherry_pick|edge_holder join LINE [echo-worker options]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from drill_attacks import Target, drain, join_evil  # noqa: E402

from echo_rl.core import wire  # noqa: E402

HONEST = ("w0", "w1")
STALENESS = 2  # learner.staleness in the drill's config (echo_rl/core/config.py default)


# ----------------------------------------------------------------------------- the learner's books


def _state(t: Target) -> dict[str, Any]:
    with urllib.request.urlopen(t.info["metrics"] + "/api/state", timeout=10) as r:
        return json.loads(r.read())


def _workers(t: Target) -> dict[str, dict[str, Any]]:
    return {w["worker"]: w for w in _state(t).get("workers", [])}


def _live_workers(t: Target) -> dict[str, dict[str, Any]]:
    """``_workers``, or nothing when the learner did not answer this time."""
    try:
        return _workers(t)
    except (OSError, ValueError):
        return {}


def _rows(t: Target) -> list[str]:
    path = t.run_dir / "metrics.jsonl"
    return path.read_text().splitlines() if path.exists() else []


def _handbacks(t: Target, newer_than: int = 0, wait_s: float = 0.0) -> dict[str, Any]:
    """The learner's hand-back counts in its newest metrics line (the dashboard's rows keep
    only the plotted fields). With ``wait_s``: from a line written after the first
    ``newer_than`` lines, waiting for the learner's next step: a verdict reached between two
    steps is in the counts only from the next line on (a drill that read the line already
    written found the forger banned and its failed check not yet counted)."""
    deadline = time.monotonic() + wait_s
    while len(lines := _rows(t)) <= newer_than and time.monotonic() < deadline:
        time.sleep(0.2)  # metrics.jsonl is a file another process appends to: polled
    return dict(json.loads(lines[-1]).get("handbacks") or {}) if lines else {}


def _version(sock: Any, name: str) -> int:
    """The learner's newest version now, from a heartbeat reply (the join's is long stale at
    several steps a second: a prefix under it would be refused as stale, never checked)."""
    sock.send(wire.encode(wire.Heartbeat(worker_id=name, version=-1, rid=99)))
    deadline = time.monotonic() + 5
    while sock.poll(max(1, int(1000 * (deadline - time.monotonic())))):
        msg = wire.decode(sock.recv(), 1 << 24)
        if isinstance(msg, wire.HeartbeatAck) and msg.rid == 99:
            return msg.version
    raise RuntimeError("no heartbeat reply for the forger")


def _security(t: Target) -> dict[str, Any]:
    """Quarantined workers, and failed checks by worker and check (the run's security files)."""
    sec = t.run_dir / "security"
    quarantined = []
    failed: Counter[str] = Counter()
    for name, sink in (("quarantine.jsonl", quarantined), ("audits.jsonl", None)):
        path = sec / name
        for line in path.read_text().splitlines() if path.exists() else []:
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if sink is not None:
                sink.append(row.get("worker_id"))
            elif not row.get("ok"):
                failed[f"{row.get('worker_id')}:{row.get('check')}"] += 1
    return {"quarantined": quarantined, "failed_checks": dict(failed)}


def _honest_harm(sec: dict[str, Any]) -> list[str]:
    out = [f"honest worker {w} quarantined" for w in sec["quarantined"] if w in HONEST]
    return out + [
        f"honest check failed: {k} x{n}"
        for k, n in sec["failed_checks"].items()
        if k.split(":")[0] in HONEST
    ]


def _attack(r: dict[str, Any]) -> dict[str, Any]:
    """The attack's own report, bare or as ``security_drill.run_attack`` wraps it."""
    return r.get("attacker", r)


# ----------------------------------------------------------------------------- forged hand-back


def _heartbeat(sock: Any, name: str, rid: int) -> str:
    """One heartbeat of the insider's session: its reply type, or the refusal reason."""
    sock.send(wire.encode(wire.Heartbeat(worker_id=name, version=-1, rid=rid)))
    deadline = time.monotonic() + 5
    while sock.poll(max(1, int(1000 * (deadline - time.monotonic())))):
        msg = wire.decode(sock.recv(), 1 << 24)
        if isinstance(msg, wire.Error):
            return msg.reason
        if getattr(msg, "rid", None) == rid:
            return msg.type
    return "no_reply"


def forged_handback(
    t: Target, groups: int = 4, tokens: int = 3, wait_s: float = 90.0
) -> dict[str, Any]:
    name = "forger"
    before = _handbacks(t)
    sock, _, ack = join_evil(t, name)
    sock.send(wire.encode(wire.WorkRequest(worker_id=name, max_groups=groups, rid=1)))
    grant: list[wire.Group] = []
    deadline = time.monotonic() + 30
    while not grant and time.monotonic() < deadline:  # standby or no room: ask again
        if sock.poll(1000):
            msg = wire.decode(sock.recv(), 1 << 24)
            if isinstance(msg, wire.WorkGrant):
                grant = msg.groups
                if not grant:
                    time.sleep(0.5)
                    sock.send(
                        wire.encode(wire.WorkRequest(worker_id=name, max_groups=groups, rid=1))
                    )
    version = max(_version(sock, name), 0)
    pick = random.Random(0)
    prefixes = {
        g.group_id: [
            wire.Prefix(
                sample_idx=i,
                ids=[pick.randrange(3, 20) for _ in range(tokens)],
                logprobs=[-9999.0] * tokens,
                versions=[[version, tokens]],
            )
            for i in range(g.n)
        ]
        for g in grant
    }
    sock.send(
        wire.encode(
            wire.Handback(
                worker_id=name, reason="preempted", rid=2, groups=list(prefixes), prefixes=prefixes
            )
        )
    )
    reply: dict[str, Any] = {}
    end = time.monotonic() + 10
    while not reply and sock.poll(max(1, int(1000 * (end - time.monotonic())))):
        msg = wire.decode(sock.recv(), 1 << 24)
        if isinstance(msg, (wire.HandbackAck, wire.Error)):
            reply = msg.model_dump(exclude={"v", "rid"})
    t0, fate = time.monotonic(), "no_reply"
    while time.monotonic() - t0 < wait_s:  # the check runs between two trainer steps
        fate = _heartbeat(sock, name, rid=10 + int(time.monotonic() - t0))
        if fate in ("banned", "not_joined"):
            break
        time.sleep(0.5)
        drain(sock, 10**6, 0)
    after = _handbacks(t, newer_than=len(_rows(t)), wait_s=15.0)
    return {
        "groups": len(grant),
        "prefixes_sent": sum(len(v) for v in prefixes.values()),
        "ack": reply,
        "fate": fate,
        "seconds_to_fate": round(time.monotonic() - t0, 1),
        "handbacks": {
            k: after.get(k, 0) - before.get(k, 0)
            for k in set(after) | set(before)
            if isinstance(after.get(k, 0), int)
        },
        **_security(t),
    }


def check_forged_handback(r: dict[str, Any]) -> list[str]:
    a = _attack(r)
    out = [] if a.get("groups") else ["the insider got no groups to hand back"]
    hb = a.get("handbacks", {})
    if a.get("fate") != "banned" or "forger" not in a.get("quarantined", []):
        out.append(f"the forger was not quarantined (its heartbeat: {a.get('fate')})")
    if hb.get("checks_failed", 0) < 1 or hb.get("refused_forged", 0) < 1:
        out.append(f"no failed prefix check counted: {hb}")
    if hb.get("continued_samples", 0):
        out.append(f"{hb['continued_samples']} samples were continued from prefixes meanwhile")
    return out + _honest_harm(a)


# ----------------------------------------------------------------------------- real modified workers


def _worker_child(t: Target, kind: str, seconds: float) -> dict[str, Any]:
    name = kind.replace("_", "")
    argv = [
        sys.executable,
        str(Path(__file__).resolve()),
        "worker",
        "--kind",
        kind,
        "join",
        f"{t.info['join']}?token={t.token}",
        "--id",
        name,
        "--identity",
        str(t.run_dir.parent / f"{name}.key"),
    ]
    log = t.run_dir.parent / f"{name}.log"
    with log.open("w") as f:
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT)
    # The learner's /api/state lists joined workers only: the child's row is gone once it has
    # left, so its books are read while it runs (the last row seen is what it ended with)
    books: dict[str, dict[str, Any]] = {}
    end = time.monotonic() + seconds
    while proc.poll() is None and time.monotonic() < end:
        time.sleep(min(3.0, max(0.1, end - time.monotonic())))
        books.update(_live_workers(t))
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
    books.update(_live_workers(t))
    return {
        "worker": name,
        "seconds": seconds,
        "exit": proc.returncode,
        "books": books.get(name, {}),
        "honest_books": {w: books.get(w, {}) for w in HONEST},
        **_security(t),
    }


def cherry_pick(t: Target, seconds: float = 300.0) -> dict[str, Any]:
    return _worker_child(t, "cherry_pick", seconds)


def check_cherry_pick(r: dict[str, Any]) -> list[str]:
    a = _attack(r)
    book = a.get("books", {})
    out = []
    if not book.get("handed_back"):
        out.append("the picker handed nothing back")
    elif book.get("cherry_pick") != "low":
        out.append(
            f"not flagged after {book.get('returns_n')} returned groups completed "
            f"(mean percentile {book.get('returns_pct')})"
        )
    if (book.get("handed_back") or 0) > 0.5 * (book.get("granted") or 0) + 16 + (
        book.get("limited") or 0
    ):
        out.append(f"hand-backs past the share bound were not limited: {book}")
    out += [
        f"honest worker {w} flagged as a cherry-picker"
        for w, b in a.get("honest_books", {}).items()
        if b.get("cherry_pick")
    ]
    return out + _honest_harm(a)


def edge_holder(t: Target, seconds: float = 120.0) -> dict[str, Any]:
    return _worker_child(t, "edge_holder", seconds)


def check_edge_holder(r: dict[str, Any]) -> list[str]:
    a = _attack(r)
    mine = a.get("books", {}).get("credit_per_trajectory")
    honest = [b.get("credit_per_trajectory") for b in a.get("honest_books", {}).values()]
    honest = [c for c in honest if c is not None]
    out = []
    if mine is None:
        out.append("the holder delivered nothing")
    elif not honest or mine >= min(honest):
        out.append(
            f"the holder's credit per trajectory {mine} is not below the honest workers' {honest}"
        )
    if (a.get("books", {}).get("at_edge") or 0) < 0.5:
        out.append(f"the holder did not reach the edge: {a.get('books')}")
    return out + _honest_harm(a)


# ----------------------------------------------------------------------------- the workers' code


def _generation(kind: str) -> Any:
    """The drill worker's generation part (echo_rl.worker.generation.Generation, modified)."""
    from echo_rl.worker.generation import Generation

    class Picker(Generation):
        """Generates honestly; hands back its groups below the median reward it has seen.

        Its groups stay listed as held (``generating``) from the start of their generation
        until they are delivered or handed back: a work request meanwhile (a prefetch) that
        left them out would have the learner take them for lost grants and lease them to this
        worker again (each generated twice, the second hand-back and delivery refused
        ``not_your_group``). The rollout timing is that of the whole grant's generation."""

        seen: list[float] = []

        async def _generate_held(self, groups: list[wire.Group]) -> tuple[Any, float]:
            samples, gen_s = await self.generate(groups)
            self.generating = [g.group_id for g in groups]  # until delivered or handed back
            return samples, gen_s

        def _deliver(
            self, groups: list[wire.Group], samples: Any, version: int, gen_s: float, n: int
        ) -> None:
            """Queue what is kept, timed as the ``n`` groups' generation (those handed back
            included)."""
            self.time_rollout(gen_s, n)
            self.queue(groups, samples, version, gen_s)

        async def rollout(self, groups: list[wire.Group]) -> bool:
            version = self.held.version
            try:
                samples, gen_s = await self._generate_held(groups)
                means = [sum(r for _, r in g) / len(g) for g in samples]
                self.seen = (self.seen + means)[-256:]
                median = sorted(self.seen)[len(self.seen) // 2]
                low = [
                    i
                    for i, m in enumerate(means)
                    if m < median or (m == median and random.random() < 0.5)
                ]
                if low:
                    await self.hand_back(
                        [groups[i] for i in low], [samples[i] for i in low], version
                    )
                keep = [i for i in range(len(groups)) if i not in low]
                if not keep:
                    return False
                self._deliver(
                    [groups[i] for i in keep],
                    [samples[i] for i in keep],
                    version,
                    gen_s,
                    len(groups),
                )
                return True
            finally:
                self.generating = []

    class Holder(Picker):
        """Generates honestly, then holds the batch until the learner has published the
        version ``learner.staleness`` on from the one it was generated under (notices and
        heartbeat replies say so at once), so it arrives at the edge. Meanwhile it installs
        what the feed has ready: snapshots are installed between rollouts, by the loop this
        wait holds up (a wait on the installed version alone saw none and ran its 60 s out;
        one for staleness - 1 installed versions delivered two thirds at S - 1)."""

        newest = -1  # the newest version the learner offered (set by the worker's hook)

        async def rollout(self, groups: list[wire.Group]) -> bool:
            version = self.held.version
            try:
                samples, gen_s = await self._generate_held(groups)
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:
                    await self.installer.ensure_installed()
                    if self.newest >= version + STALENESS:
                        break
                    await asyncio.sleep(0.01)
                self._deliver(groups, samples, version, gen_s, len(groups))
                return True
            finally:
                self.generating = []

    return {"cherry_pick": Picker, "edge_holder": Holder}[kind]


def _make(kind: str) -> Any:
    """A real worker (echo_rl.worker.agent.Worker) generating with the drill's part."""
    from echo_rl.worker.agent import Worker

    gen = _generation(kind)

    class DrillWorker(Worker):
        make_generation = gen

        def _assemble(self, client: Any, node: Any) -> None:
            super()._assemble(client, node)
            offer = self.session.hooks.offer

            def seen(version: int, manifest: dict[str, Any], source: Any) -> None:
                self.generation.newest = max(getattr(self.generation, "newest", -1), version)
                offer(version, manifest, source)

            self.session.hooks.offer = seen

    return DrillWorker


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="drill_handbacks.py")
    sub = p.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("worker", help="run a modified worker: worker --kind KIND join LINE ...")
    w.add_argument("--kind", required=True, choices=("cherry_pick", "edge_holder"))
    args, rest = p.parse_known_args(argv)
    from echo_rl.cli import worker as cli

    cls = _make(args.kind)
    return cli.main(rest, make_worker=lambda *a, **kw: cls(*a, **kw))


if __name__ == "__main__":
    sys.exit(main())
