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
from dataclasses import asdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from echo_rl.core.steprow import COL  # noqa: E402
from echo_rl.provisioning.sim.control_load import ControlCosts, saturation  # noqa: E402  (no heavy imports)

# Every synthetic worker comes from 127.0.0.1, one IP prefix: the per-address and per-prefix
# limits (docs/security.md, "Sybils") would rightly hold a thousand keys from one host to a few
# a second, so they are raised here; the fleet-wide limits stay as configured.
OVERRIDES = [
    "security.audit=false",
    "provisioning.enabled=false",
    "learner.max_steps=100000",
    "security.handshakes_per_s_per_ip=400",
    "security.joins_per_s=200",
    "security.newcomers_per_s_per_prefix=400",
    "security.newcomer_burst=4096",
    "security.max_workers=16384",
    "learner.wait_timeout_s=600",
    "metrics.enabled=true",
]


# ----------------------------------------------------------------------------- swarm process


class Synthetic:
    """One made-up worker on a shared event loop."""

    def __init__(
        self,
        ctx: Any,
        line: Any,
        wid: str,
        adapter: Any,
        vocab: int,
        group_s: float,
        keys: Any = None,
        price: float = 0.1,
        gate: Any = None,
    ):
        """``keys``: the worker's identity (a restarted worker passes the same pair); a new
        pair when None. ``price``: what it declares, $/h. ``gate``: an async callable; the worker
        joins and heart-beats at once but asks for work only once it returns (a fleet that
        starts together)."""
        from echo_rl.core.client import Client
        from echo_rl.core.security import KeyPair

        self.wid, self.adapter, self.vocab, self.group_s = wid, adapter, vocab, group_s
        self.price, self.gate = price, gate
        self.client = Client(
            ctx,
            line.endpoint,
            16 << 20,
            keys=keys or KeyPair.generate(),
            server_key=line.server_key,
        )
        self.version, self.rtts, self.acked, self.batches = 0, [], 0, 0
        self.ledger: list[dict[str, Any]] = []  # per acknowledged batch: the keys stored
        self.periods: list[float] = []  # heartbeat periods the learner asked for
        self.rng = random.Random(wid)

    async def run(self, until: float, ramp_s: float = 0.0) -> None:
        from echo_rl.core import wire

        # A fleet does not join in one millisecond: joins spread over ramp_s (each a CURVE
        # handshake, the costliest message there is, on both sides).
        await asyncio.sleep(self.rng.uniform(0.0, ramp_s))
        async with asyncio.TaskGroup() as tg:
            recv = tg.create_task(self.client.receive_forever())
            ack = await self._join()
            if not isinstance(ack, wire.JoinAck):
                raise RuntimeError(f"{self.wid}: join refused: {ack}")
            self.wid, self.version = ack.worker_id or self.wid, max(ack.version, 0)
            period = float(ack.config["worker"]["heartbeat_s"])
            tasks = [
                tg.create_task(self._heartbeats(period, until)),
                tg.create_task(self._notices()),
                tg.create_task(self._work(until)),
            ]
            await asyncio.gather(tasks[0], tasks[2])
            tasks[1].cancel()
            await self.client.send(wire.Leave(worker_id=self.wid))  # its leases go back at once
            recv.cancel()

    async def _join(self) -> Any:
        """Join, retrying a handshake that failed while many connect at once, as a real
        worker does (echo_rl.core.client: a failure is final only after WRONG_KEY_AFTER in a row)."""
        from echo_rl.core import wire
        from echo_rl.core.client import ConnectionLost

        for attempt in range(10):
            try:
                return await self.client.request(
                    wire.Join(worker_id=self.wid, price=self.price), 60
                )
            except ConnectionLost:
                if not self.client.retryable or attempt == 9:
                    raise
                await asyncio.sleep(0.5 * (attempt + 1))

    async def _heartbeats(self, period: float, until: float) -> None:
        from echo_rl.core import wire

        while time.monotonic() < until:
            await asyncio.sleep(period)
            t0 = time.monotonic()
            reply = await self.client.request(
                wire.Heartbeat(worker_id=self.wid, version=self.version), 30
            )
            self.rtts.append(time.monotonic() - t0)
            if isinstance(reply, wire.HeartbeatAck):
                self.version = max(self.version, reply.version)
                period = reply.heartbeat_s or period  # as a real worker: the learner's period
                self.periods.append(period)

    async def _notices(self) -> None:
        from echo_rl.core import wire

        while True:
            msg = await self.client.notices.get()
            if isinstance(msg, wire.SnapshotNotice):
                self.version = max(self.version, msg.version)

    async def _work(self, until: float) -> None:
        from echo_rl.core import wire

        if self.gate is not None:
            await self.gate()
        while time.monotonic() < until:
            grant = await self.client.request(
                wire.WorkRequest(worker_id=self.wid, max_groups=1), 30
            )
            if not isinstance(grant, wire.WorkGrant) or not grant.groups:
                await asyncio.sleep(getattr(grant, "retry_after_s", 0.5) or 0.5)
                continue
            for g in grant.groups:
                await asyncio.sleep(self.group_s)  # "generating"
                recs = [self._record(g, i) for i in range(g.n)]
                reply = await self.client.request(
                    wire.Trajectories(
                        worker_id=self.wid,
                        batch_id=f"{self.wid}-{self.batches}",
                        count=len(recs),
                        payload=wire.pack_records(recs),
                    ),
                    60,
                )
                self.batches += 1
                if isinstance(reply, wire.Ack):
                    self.acked += reply.accepted
                    not_stored = set(reply.rejected_idx)
                    self.ledger.append(
                        {
                            "batch_id": f"{self.wid}-{self.batches - 1}",
                            "stored": [
                                [r["group_id"], r["sample_idx"]]
                                for i, r in enumerate(recs)
                                if i not in not_stored
                            ],
                        }
                    )

    def _record(self, g: Any, i: int) -> dict[str, Any]:
        ids = [self.rng.randrange(4, self.vocab) for _ in range(2)]
        text = self.adapter.tokenizer.decode(ids, skip_special_tokens=True)
        return {
            "group_id": g.group_id,
            "sample_idx": i,
            "prompt_ids": g.prompt_ids,
            "completion_ids": ids,
            "logprobs": [-1.0, -1.0],
            "reward": float(self.adapter.reward(g.task, ids, text)),
            "version": self.version,
            "worker_id": self.wid,
            "gen_s": self.group_s,
        }


async def swarm(args: argparse.Namespace) -> dict[str, Any]:
    import zmq.asyncio

    from echo_rl.core.models import build_tiny_tokenizer
    from echo_rl.core.security import JoinLine
    from echo_rl.data.adapter import load_adapter

    tok = build_tiny_tokenizer()
    adapter = load_adapter("toy-add", {"max_sum": 9}, tok)
    ctx = zmq.asyncio.Context()
    line = JoinLine.parse(args.line)
    started = time.monotonic()
    until = started + args.ramp_s + args.seconds
    workers = [
        Synthetic(ctx, line, f"{args.prefix}{i:03d}", adapter, len(tok), args.group_s)
        for i in range(args.n)
    ]
    # As the learner and real workers do after start-up: a full collection over the imported
    # libraries would add its pause to the round trips this process measures.
    gc.collect()
    gc.freeze()
    try:
        await asyncio.gather(*(w.run(until, args.ramp_s) for w in workers))
    finally:
        for w in workers:
            w.client.close()
        ctx.term()
    # the swarm's ledger, as a real worker's --ledger (echo_rl.learner.run_audit reads it)
    args.out.with_suffix(".ledger").write_text(
        "".join(json.dumps(row) + "\n" for w in workers for row in w.ledger)
    )
    return {
        "rtts": [r for w in workers for r in w.rtts],
        "acked": sum(w.acked for w in workers),
        "period_max": max((p for w in workers for p in w.periods), default=0.0),
        "cpu_s": time.process_time(),
        "wall_s": time.monotonic() - started,
        "batches": sum(w.batches for w in workers),
    }


# ----------------------------------------------------------------------------- driver


def pinned(argv: list[str], cpus: str | None) -> list[str]:
    """``argv`` confined to ``cpus`` (taskset), so the learner's figures do not include the
    swarm's: the learner gets its core, the swarm the rest."""
    return ["taskset", "-c", cpus, *argv] if cpus else argv


def cpu_split() -> tuple[str | None, str | None]:
    """(learner's CPUs, swarm's CPUs): CPU 0 for the learner, the others for the swarm; no
    split on one CPU or without taskset."""
    import shutil

    n = os.cpu_count() or 1
    if n < 2 or shutil.which("taskset") is None:
        return None, None
    return "0", f"1-{n - 1}"


def run_once(
    workers: int,
    per_process: int,
    seconds: float,
    group_s: float,
    fsync_delay_ms: float,
    tmp: Path,
    pin: bool = True,
    heartbeat_s: float | None = None,
    ramp_s: float = 0.0,
) -> dict[str, Any]:
    from echo_rl.core.config import dump_toml, load_config
    from echo_rl.core.procs import ProcessGroup, python_argv, wait_ready
    from labs import child_env

    extra = [f"worker.heartbeat_s={heartbeat_s}"] if heartbeat_s else []
    cfg = load_config(ROOT / "examples/quickstart.toml", OVERRIDES + extra)
    tag = f"{workers}w-{fsync_delay_ms:g}ms"
    run = tmp / f"run-{tag}"
    conf = tmp / f"cfg-{tag}.toml"
    conf.write_text(dump_toml(cfg))
    learner_cpus, swarm_cpus = cpu_split() if pin else (None, None)
    group = ProcessGroup()
    try:
        # The disk's fsync delay is the slow-disk double's (labs/slow_disk.py), not a config key.
        argv = python_argv(
            "labs.slow_disk",
            "--fsync-delay-s",
            str(fsync_delay_ms / 1000),
            "learn",
            str(conf),
            "--run-dir",
            str(run),
        )
        learner = group.start(
            "learner",
            pinned(argv, learner_cpus),
            tmp / f"learner-{tag}.err",
            pipe_stdout=True,
            env=child_env(),
        )
        line = wait_ready(learner, timeout=180)
        outs = []
        for p in range(-(-workers // per_process)):
            n = min(per_process, workers - p * per_process)
            out = tmp / f"swarm{p}-{tag}.json"
            outs.append(out)
            group.start(
                f"swarm{p}",
                pinned(
                    [
                        sys.executable,
                        str(Path(__file__)),
                        "swarm",
                        "--line",
                        line,
                        "--n",
                        str(n),
                        "--prefix",
                        f"s{p}w",
                        "--seconds",
                        str(seconds),
                        "--group-s",
                        str(group_s),
                        "--out",
                        str(out),
                        "--ramp-s",
                        str(ramp_s),
                    ],
                    swarm_cpus,
                ),
                tmp / f"swarm{p}-{tag}.log",
            )
        for p in range(len(outs)):
            group.procs[f"swarm{p}"].wait(ramp_s + seconds + 240)
        group.stop("learner", timeout=60)
        rows = [
            json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()
        ]
    finally:
        group.stop_all()
    out = _summary(
        [json.loads(o.read_text()) for o in outs if o.exists()],
        rows,
        run,
        seconds,
        workers,
        fsync_delay_ms,
    )
    out.update(
        group_commit=True,
        pinned={"learner": learner_cpus, "swarm": swarm_cpus},
        heartbeat_s=cfg.worker.heartbeat_s,
    )
    out["accounting"] = accounting(
        run, [o.with_suffix(".ledger") for o in outs], cfg.learner.group_size
    )
    out["cpu"] = cpu_costs(
        rows[-1].get(COL.control_cpu, {}) if rows else {},
        workers,
        cfg.worker.heartbeat_s,
        rows[-1].get("wall_s", seconds) if rows else seconds,
        cfg.transport.heartbeats_per_s,
        out["acked_records"],
    )
    out["heartbeats_per_s"] = cfg.transport.heartbeats_per_s
    return out


def accounting(run: Path, ledgers: list[Path], group_size: int) -> dict[str, int]:
    """Every record the swarm saw acknowledged: trained, dropped by a named rule, or still
    buffered (echo_rl.learner.run_audit); ``unaccounted`` must be 0."""
    from echo_rl.learner.run_audit import audit_run

    return audit_run(run, [p for p in ledgers if p.exists()], group_size).accounting()


REQUESTS = (
    "heartbeat",
    "work_request",
    "trajectories",
    "join",
    "leave",
    "installed",
    "source_request",
    "nat_report",
    "handback",
    "refused",
)


def cpu_costs(
    cpu: dict[str, Any],
    workers: int,
    heartbeat_s: float,
    seconds: float,
    budget: float = 0.0,
    records: int = 0,
) -> dict[str, Any]:
    """The learner's CPU per unit of work, from its own counters (echo_rl.control.cpu): microseconds
    on the control loop per message of each kind; the loop's time no handler accounts for
    (the sockets' receive path, the chunk server, handshakes) and ZeroMQ's I/O threads (CURVE,
    sockets) shared out per message; the fleet-wide passes (housekeeping, stats) per worker
    per second. From them, the fleet size at which one core saturates (``saturation``)."""
    kinds = {k: (int(v[0]), float(v[1])) for k, v in cpu.get("kinds", {}).items()}
    threads = cpu.get("threads", {})
    requests = sum(kinds[k][0] for k in REQUESTS if k in kinds)
    messages = 2 * requests + kinds.get("notice", (0, 0))[0]
    io_us = threads.get("zmq_io", 0.0) / messages * 1e6 if messages else 0.0
    attributed = sum(s for _, s in kinds.values())
    overhead_us = (
        max(0.0, threads.get("control", 0.0) - attributed) / requests * 1e6 if requests else 0.0
    )
    per = {k: round(s / n * 1e6, 1) for k, (n, s) in kinds.items() if n}
    sweep_s = sum(kinds.get(k, (0, 0.0))[1] for k in ("housekeeping", "stats"))
    sweep_us = sweep_s / max(seconds, 1e-9) / max(workers, 1) * 1e6  # per worker-second
    out: dict[str, Any] = {
        "loop_us": per,
        "zmq_io_us_per_message": round(io_us, 1),
        "loop_overhead_us_per_request": round(overhead_us, 1),
        "sweep_us_per_worker_s": round(sweep_us, 2),
        "threads_s": threads,
    }
    full = lambda k: per.get(k, 0.0) + 2 * io_us + overhead_us  # noqa: E731  (in, reply out)
    if "heartbeat" in per:
        out["heartbeat_us"] = round(full("heartbeat"), 1)
    if "trajectories" in per:
        out["trajectories_us"] = round(full("trajectories"), 1)
        out["work_request_us"] = round(full("work_request"), 1)
        if records:  # a batch's cost over the records the batches carried
            out["per_record_us"] = round(
                out["trajectories_us"] * kinds["trajectories"][0] / records, 1
            )
    if "heartbeat" in per and "trajectories" in per:
        costs = control_costs(out, kinds["trajectories"][0], seconds)
        out["model"] = asdict(costs)
        out["saturation"] = {
            "period_fixed": saturation(costs, heartbeat_s, budget, False),
            "period_scaled": saturation(costs, heartbeat_s, budget, True),
        }
        out["workers_per_core"] = out["saturation"]["period_scaled" if budget else "period_fixed"]
    return out


def control_costs(out: dict[str, Any], batches: int, seconds: float) -> ControlCosts:
    """The load model's inputs (echo_rl.provisioning.sim.control_load): an empty work request costs what a
    work request costs; admission is one granted request and one trajectory batch per batch."""
    return ControlCosts(
        heartbeat_us=out["heartbeat_us"],
        poll_us=out["work_request_us"],
        sweep_us_per_worker_s=out["sweep_us_per_worker_s"],
        admission_us_per_s=round(
            batches * (out["trajectories_us"] + out["work_request_us"]) / max(seconds, 1e-9), 1
        ),
    )


def _summary(
    swarms: list[dict[str, Any]],
    rows: list[dict[str, Any]],
    run: Path,
    seconds: float,
    workers: int,
    fsync_delay_ms: float,
) -> dict[str, Any]:
    rtts = sorted(r for s in swarms for r in s["rtts"])
    q = lambda p: rtts[min(len(rtts) - 1, int(p * len(rtts)))] * 1000 if rtts else None  # noqa: E731
    log = (run / "learner.log").read_text()
    last = rows[-1] if rows else {}
    return {
        "workers": workers,
        "fsync_delay_ms": fsync_delay_ms,
        "seconds": seconds,
        "swarms_reported": len(swarms),
        "heartbeats": len(rtts),
        "heartbeat_rtt_ms": {
            "p50": q(0.50),
            "p99": q(0.99),
            "max": rtts[-1] * 1000 if rtts else None,
        },
        "acked_records": sum(s["acked"] for s in swarms),
        "admitted_per_s": (last.get("admitted") or 0) / max(last.get("wall_s") or seconds, 1e-9),
        COL.bubble_ratio: last.get(COL.bubble_ratio),
        "steps": len(rows),
        # the swarm's share of its CPUs: near 1 per swarm CPU, its own delays are in the RTTs
        "swarm_cpu_s": round(sum(s.get("cpu_s", 0.0) for s in swarms), 1),
        "swarm_wall_s": round(max((s.get("wall_s", 0.0) for s in swarms), default=0.0), 1),
        "evicted": log.count("removed (no heartbeat"),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd")
    s = sub.add_parser("swarm")
    s.add_argument("--line", required=True)
    s.add_argument("--n", type=int, required=True)
    s.add_argument("--prefix", required=True)
    s.add_argument("--seconds", type=float, required=True)
    s.add_argument("--group-s", type=float, default=1.0)
    s.add_argument("--ramp-s", type=float, default=0.0)
    s.add_argument("--out", type=Path, required=True)
    ap.add_argument("--workers", type=int, nargs="+", default=[128])
    ap.add_argument("--per-process", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--group-s", type=float, default=1.0, help="seconds a synthetic group takes")
    ap.add_argument("--fsync-delay-ms", type=float, nargs="+", default=[0.0])
    ap.add_argument(
        "--heartbeat-s",
        type=float,
        default=None,
        help="worker.heartbeat_s for the run (default: the config's)",
    )
    ap.add_argument(
        "--ramp-s",
        type=float,
        default=None,
        help="seconds over which the workers join (default: 50 joins a second)",
    )
    ap.add_argument(
        "--no-pin",
        action="store_true",
        help="let the learner and the swarm share every CPU (the old figures)",
    )
    ap.add_argument(
        "--json", type=Path, default=ROOT / "benchmarks" / "results" / "load_control.json"
    )
    args = ap.parse_args(argv)
    if args.cmd == "swarm":
        args.out.write_text(json.dumps(asyncio.run(swarm(args))))
        return 0
    import tempfile

    from rich.console import Console

    from echo_rl.core.machine import write_result

    results = []
    with tempfile.TemporaryDirectory(prefix="echo-load-") as tmp:
        for workers in args.workers:
            for delay in args.fsync_delay_ms:
                results.append(
                    run_once(
                        workers,
                        args.per_process,
                        args.seconds,
                        args.group_s,
                        delay,
                        Path(tmp),
                        pin=not args.no_pin,
                        heartbeat_s=args.heartbeat_s,
                        ramp_s=args.ramp_s if args.ramp_s is not None else workers / 50,
                    )
                )
                print(json.dumps(results[-1]), flush=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    write_result(args.json, {"load": os.getloadavg(), "argv": sys.argv[1:], "results": results})
    console = Console(width=200)
    console.print(_rtt_table(results, args.seconds))
    console.print(_cpu_table(results))
    bad = [r for r in results if r["accounting"]["unaccounted"]]
    for r in bad:
        console.print(
            f"[red]{r['workers']} workers: {r['accounting']['unaccounted']} acknowledged "
            f"records are neither trained, dropped by a rule, nor buffered[/red]"
        )
    return 1 if bad else 0


def _rtt_table(results: list[dict[str, Any]], seconds: float) -> Any:
    from rich.table import Table

    t = Table(
        title=f"control plane under synthetic workers, {seconds:g} s (learner on its own core)"
    )
    for col in (
        "workers",
        "fsync ms",
        "log",
        "heartbeats",
        "RTT p50 ms",
        "RTT p99 ms",
        "RTT max ms",
        "admitted/s",
        "bubble",
        "evicted",
        "acked = trained + dropped + buffered",
    ):
        t.add_column(col, justify="right")
    for r in results:
        h, a = r["heartbeat_rtt_ms"], r["accounting"]
        dropped = " + ".join(
            f"{v} {k[len('dropped_') :]}" for k, v in a.items() if k.startswith("dropped_")
        )
        books = f"{a['acked']} = {a['trained']} + {dropped or '0'} + {a['buffered']}" + (
            f" ({a['unaccounted']} UNACCOUNTED)" if a["unaccounted"] else ""
        )
        t.add_row(
            str(r["workers"]),
            f"{r['fsync_delay_ms']:g}",
            "group commit" if r["group_commit"] else "on the loop",
            str(r["heartbeats"]),
            f"{h['p50']:.1f}",
            f"{h['p99']:.1f}",
            f"{h['max']:.1f}",
            f"{r['admitted_per_s']:.0f}",
            f"{r[COL.bubble_ratio]}",
            str(r["evicted"]),
            books,
        )
    return t


def _cpu_table(results: list[dict[str, Any]]) -> Any:
    from rich.table import Table

    t = Table(
        title="the learner's CPU per unit of work (its own counters; echo_rl.control.cpu), and the "
        "fleet one core serves"
    )
    for col in (
        "workers",
        "heartbeat µs",
        "work request µs",
        "trajectory batch µs",
        "per record µs",
        "of which I/O µs/msg",
        "loop overhead µs/req",
        "sweeps µs/worker/s",
        "admission µs/s",
        "one core: fixed period",
        "one core: scaled period",
    ):
        t.add_column(col, justify="right")
    for r in results:
        c = r["cpu"]
        sat = c.get("saturation", {})
        t.add_row(
            str(r["workers"]),
            str(c.get("heartbeat_us", "-")),
            str(c.get("work_request_us", "-")),
            str(c.get("trajectories_us", "-")),
            str(c.get("per_record_us", "-")),
            str(c["zmq_io_us_per_message"]),
            str(c["loop_overhead_us_per_request"]),
            str(c["sweep_us_per_worker_s"]),
            str(c.get("model", {}).get("admission_us_per_s", "-")),
            f"{sat.get('period_fixed', 0):,}",
            f"{sat.get('period_scaled', 0):,}",
        )
    return t


if __name__ == "__main__":
    sys.exit(main())
