"""Load test of the learner's control plane: many light (synthetic) workers, a real learner.

A synthetic worker is the wire protocol without a model: its own CURVE key, join, a heartbeat
every ``worker.heartbeat_s`` (its round trip timed), work requests, and for every group a
batch of records it makes up at a set rate (``--group-s`` seconds a group): completion tokens
drawn from the vocabulary, rewards scored with the task's own adapter (the learner recomputes
them), version tags from the snapshot notices. ``--per-process`` of them share one process and
event loop, so 128 fit on two cores beside a learner that trains the tiny model. Audits are
off (made-up log-probs would fail them by design) and so is the provisioner (all active).

Reported per run: heartbeat round trip p50 / p99 / max over every heartbeat of every worker,
admitted records/s, the learner's bubble ratio, workers evicted (learner log), records
acknowledged vs records the stopped learner holds (its steps' consumed groups plus its
write-ahead log: nothing acknowledged lost), and the
same with a slow disk (``--fsync-delay-ms``: each write-ahead-log fsync sleeps that long).

    .venv/bin/python benchmarks/load_control.py [--workers 128] [--seconds 60]
        [--fsync-delay-ms 0 50]            # writes benchmarks/results/load_control.json
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

OVERRIDES = ["security.audit=false", "provisioning.enabled=false", "learner.max_steps=100000",
             "security.handshakes_per_s_per_ip=400", "security.joins_per_s=200",
             "learner.wait_timeout_s=600", "metrics.enabled=true"]


# ----------------------------------------------------------------------------- swarm process


class Synthetic:
    """One made-up worker on a shared event loop."""

    def __init__(self, ctx: Any, line: Any, wid: str, adapter: Any, vocab: int, group_s: float,
                 keys: Any = None, price: float = 0.1, gate: Any = None):
        """``keys``: the worker's identity (a restarted worker passes the same pair); a new
        pair when None. ``price``: what it declares, $/h. ``gate``: an async callable; the worker
        joins and heart-beats at once but asks for work only once it returns (a fleet that
        starts together)."""
        from echo.client import Client
        from echo.security import KeyPair

        self.wid, self.adapter, self.vocab, self.group_s = wid, adapter, vocab, group_s
        self.price, self.gate = price, gate
        self.client = Client(ctx, line.endpoint, 16 << 20, keys=keys or KeyPair.generate(),
                             server_key=line.server_key)
        self.version, self.rtts, self.acked, self.batches = 0, [], 0, 0
        self.rng = random.Random(wid)

    async def run(self, until: float) -> None:
        from echo import wire

        async with asyncio.TaskGroup() as tg:
            recv = tg.create_task(self.client.receive_forever())
            ack = await self.client.request(wire.Join(worker_id=self.wid, price=self.price), 60)
            if not isinstance(ack, wire.JoinAck):
                raise RuntimeError(f"{self.wid}: join refused: {ack}")
            self.wid, self.version = ack.worker_id or self.wid, max(ack.version, 0)
            period = float(ack.config["worker"]["heartbeat_s"])
            tasks = [tg.create_task(self._heartbeats(period, until)),
                     tg.create_task(self._notices()), tg.create_task(self._work(until))]
            await asyncio.gather(tasks[0], tasks[2])
            tasks[1].cancel()
            await self.client.send(wire.Leave(worker_id=self.wid))  # its leases go back at once
            recv.cancel()

    async def _heartbeats(self, period: float, until: float) -> None:
        from echo import wire

        while time.monotonic() < until:
            await asyncio.sleep(period)
            t0 = time.monotonic()
            reply = await self.client.request(wire.Heartbeat(worker_id=self.wid,
                                                             version=self.version), 30)
            self.rtts.append(time.monotonic() - t0)
            if isinstance(reply, wire.HeartbeatAck):
                self.version = max(self.version, reply.version)

    async def _notices(self) -> None:
        from echo import wire

        while True:
            msg = await self.client.notices.get()
            if isinstance(msg, wire.SnapshotNotice):
                self.version = max(self.version, msg.version)

    async def _work(self, until: float) -> None:
        from echo import wire

        if self.gate is not None:
            await self.gate()
        while time.monotonic() < until:
            grant = await self.client.request(wire.WorkRequest(worker_id=self.wid, max_groups=1), 30)
            if not isinstance(grant, wire.WorkGrant) or not grant.groups:
                await asyncio.sleep(getattr(grant, "retry_after_s", 0.5) or 0.5)
                continue
            for g in grant.groups:
                await asyncio.sleep(self.group_s)  # "generating"
                recs = [self._record(g, i) for i in range(g.n)]
                reply = await self.client.request(wire.Trajectories(
                    worker_id=self.wid, batch_id=f"{self.wid}-{self.batches}", count=len(recs),
                    payload=wire.pack_records(recs)), 60)
                self.batches += 1
                if isinstance(reply, wire.Ack):
                    self.acked += reply.accepted

    def _record(self, g: Any, i: int) -> dict[str, Any]:
        ids = [self.rng.randrange(4, self.vocab) for _ in range(2)]
        text = self.adapter.tokenizer.decode(ids, skip_special_tokens=True)
        return {"group_id": g.group_id, "sample_idx": i, "prompt_ids": g.prompt_ids,
                "completion_ids": ids, "logprobs": [-1.0, -1.0],
                "reward": float(self.adapter.reward(g.task, ids, text)), "version": self.version,
                "worker_id": self.wid, "gen_s": self.group_s}


async def swarm(args: argparse.Namespace) -> dict[str, Any]:
    import zmq.asyncio

    from dataplane.adapter import load_adapter
    from echo.models import build_tiny_tokenizer
    from echo.security import JoinLine

    tok = build_tiny_tokenizer()
    adapter = load_adapter("toy-add", {"max_sum": 9}, tok)
    ctx = zmq.asyncio.Context()
    line = JoinLine.parse(args.line)
    until = time.monotonic() + args.seconds
    workers = [Synthetic(ctx, line, f"{args.prefix}{i:03d}", adapter, len(tok), args.group_s)
               for i in range(args.n)]
    # As the learner and real workers do after start-up: a full collection over the imported
    # libraries would add its pause to the round trips this process measures.
    gc.collect()
    gc.freeze()
    try:
        await asyncio.gather(*(w.run(until) for w in workers))
    finally:
        for w in workers:
            w.client.close()
        ctx.term()
    return {"rtts": [r for w in workers for r in w.rtts], "acked": sum(w.acked for w in workers),
            "batches": sum(w.batches for w in workers)}


# ----------------------------------------------------------------------------- driver


def run_once(workers: int, per_process: int, seconds: float, group_s: float,
             fsync_delay_ms: float, tmp: Path, group_commit: bool = True) -> dict[str, Any]:
    from echo.config import dump_toml, load_config
    from echo.procs import ProcessGroup, python_argv, wait_ready

    cfg = load_config(ROOT / "examples/quickstart.toml",
                      OVERRIDES + [f"learner.fsync_delay_s={fsync_delay_ms / 1000}",
                                   f"learner.group_commit={str(group_commit).lower()}"])
    tag = f"{fsync_delay_ms:g}ms-{'group' if group_commit else 'sync'}"
    run = tmp / f"run-{tag}"
    conf = tmp / f"cfg-{tag}.toml"
    conf.write_text(dump_toml(cfg))
    group = ProcessGroup()
    try:
        learner = group.start("learner", python_argv("echo.cli", "learn", str(conf), "--run-dir",
                                                     str(run)), tmp / "learner.err", pipe_stdout=True)
        line = wait_ready(learner, timeout=180)
        outs = []
        for p in range(-(-workers // per_process)):
            n = min(per_process, workers - p * per_process)
            out = tmp / f"swarm{p}-{tag}.json"
            outs.append(out)
            group.start(f"swarm{p}", [sys.executable, str(Path(__file__)), "swarm", "--line", line,
                                      "--n", str(n), "--prefix", f"s{p}w", "--seconds",
                                      str(seconds), "--group-s", str(group_s), "--out", str(out)],
                        tmp / f"swarm{p}.log")
        for p in range(len(outs)):
            group.procs[f"swarm{p}"].wait(seconds + 240)
        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
        group.stop("learner", timeout=60)
    finally:
        group.stop_all()
    out = _summary([json.loads(o.read_text()) for o in outs if o.exists()], rows, run, seconds,
                   workers, fsync_delay_ms)
    out["group_commit"] = group_commit
    out["durable_records"] = durable_records(run, cfg.learner.group_size)
    return out


def durable_records(run: Path, group_size: int) -> int:
    """Records the learner holds after it stopped: every sample of each group a step consumed
    (consumed.jsonl), plus what its write-ahead log still holds unconsumed."""
    from learner.durable import read_log

    trained = {g for line in (run / "consumed.jsonl").read_text().splitlines() if line.strip()
               for g in json.loads(line)["groups"]} if (run / "consumed.jsonl").exists() else set()
    admitted, consumed = read_log(run / "buffer.log")
    trained |= {g for groups in consumed.values() for g in groups}
    live = {(r.group_id, r.sample_idx) for r in admitted if r.group_id not in trained}
    return group_size * len(trained) + len(live)


def _summary(swarms: list[dict[str, Any]], rows: list[dict[str, Any]], run: Path, seconds: float,
             workers: int, fsync_delay_ms: float) -> dict[str, Any]:
    rtts = sorted(r for s in swarms for r in s["rtts"])
    q = lambda p: rtts[min(len(rtts) - 1, int(p * len(rtts)))] * 1000 if rtts else None  # noqa: E731
    log = (run / "learner.log").read_text()
    last = rows[-1] if rows else {}
    return {"workers": workers, "fsync_delay_ms": fsync_delay_ms, "seconds": seconds,
            "swarms_reported": len(swarms), "heartbeats": len(rtts),
            "heartbeat_rtt_ms": {"p50": q(0.50), "p99": q(0.99), "max": rtts[-1] * 1000 if rtts else None},
            "acked_records": sum(s["acked"] for s in swarms),
            "admitted_per_s": (last.get("admitted") or 0) / max(last.get("wall_s") or seconds, 1e-9),
            "bubble_ratio": last.get("bubble_ratio"), "steps": len(rows),
            "evicted": log.count("removed (no heartbeat")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd")
    s = sub.add_parser("swarm")
    s.add_argument("--line", required=True)
    s.add_argument("--n", type=int, required=True)
    s.add_argument("--prefix", required=True)
    s.add_argument("--seconds", type=float, required=True)
    s.add_argument("--group-s", type=float, default=1.0)
    s.add_argument("--out", type=Path, required=True)
    ap.add_argument("--workers", type=int, default=128)
    ap.add_argument("--per-process", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--group-s", type=float, default=1.0, help="seconds a synthetic group takes")
    ap.add_argument("--fsync-delay-ms", type=float, nargs="+", default=[0.0, 50.0])
    ap.add_argument("--sync-baseline", action="store_true",
                    help="also run each delay with the log written on the event loop "
                         "(learner.group_commit = false, the old behaviour)")
    ap.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "load_control.json")
    args = ap.parse_args(argv)
    if args.cmd == "swarm":
        args.out.write_text(json.dumps(asyncio.run(swarm(args))))
        return 0
    import tempfile

    from rich.console import Console
    from rich.table import Table

    from echo.machine import machine_info

    results = []
    with tempfile.TemporaryDirectory(prefix="echo-load-") as tmp:
        for delay in args.fsync_delay_ms:
            for group_commit in (True, False) if args.sync_baseline else (True,):
                results.append(run_once(args.workers, args.per_process, args.seconds,
                                        args.group_s, delay, Path(tmp), group_commit))
                print(json.dumps(results[-1]), flush=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"machine": machine_info(), "load": os.getloadavg(),
                                     "argv": sys.argv[1:], "results": results}, indent=2))
    t = Table(title=f"control plane under {args.workers} synthetic workers, {args.seconds:g} s")
    for col in ("fsync delay ms", "log", "heartbeats", "RTT p50 ms", "RTT p99 ms", "RTT max ms",
                "admitted/s", "bubble", "evicted", "acked / durable"):
        t.add_column(col, justify="right")
    for r in results:
        h = r["heartbeat_rtt_ms"]
        t.add_row(f"{r['fsync_delay_ms']:g}", "group commit" if r["group_commit"] else "on the loop",
                  str(r["heartbeats"]), f"{h['p50']:.1f}",
                  f"{h['p99']:.1f}", f"{h['max']:.1f}", f"{r['admitted_per_s']:.0f}",
                  f"{r['bubble_ratio']}", str(r["evicted"]),
                  f"{r['acked_records']} / {r['durable_records']}")
    Console().print(t)
    return 0


if __name__ == "__main__":
    sys.exit(main())
