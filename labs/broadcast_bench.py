"""The broadcast benchmark: real processes moving a real snapshot over loopback.

The root (this process, ``labs.broadcast_root``) plays the learner's broadcast side with the
same code the learner uses (``Coordinator`` + ``ChunkServer``, uplink shaped at U); each of N
relay processes (``python -m labs.broadcast_relay``) is what a worker runs (``Relay``:
download and upload shaped at b). Optionally a fraction of relays is SIGKILLed at random moments and K relays
corrupt every chunk they forward. Reports per-worker install times, ``T_bcast`` (q = 1), the
lower bound of docs/design.md §5, bytes the root sent, and corrupt installs (payload digests that differ
from the root's).

``--publications P`` publishes P versions in a row (the coordinator re-plans at each, on the
link rates the relays measured for the previous ones: ``echo_rl.broadcast.link_meter``). ``--liar-up-mbit X``
shapes relay r00's uplink at X but has it declare 10x X; ``--trust-declared`` plans on the
declarations alone (the old behaviour). ``--liar-json FILE`` runs the honest fleet, the fleet
with the liar, and (as a baseline) the liar with declarations trusted, and writes T_bcast per
publication and whether the liar headed a chain.

    python -m labs.broadcast_bench --workers 16 --snapshot-mib 64 --uplink-mbit 400 --link-mbit 100
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import blake3
import numpy as np

from echo_rl.broadcast.coordinator import Coordinator
from echo_rl.broadcast.manifest import Manifest
from echo_rl.broadcast.planner import lower_bound_s, star_limited_s, star_unlimited_s
from echo_rl.broadcast.topology import TOPOLOGIES
from echo_rl.core.machine import write_result
from echo_rl.core.security import key_hex
from echo_rl.core.steprow import COL
from labs import child_env, natlab, netns
from labs.broadcast_root import BenchParams, RecordedVersions, Root


def _spawn_relays(root: Root, p: BenchParams) -> dict[str, Any]:
    from echo_rl.core.procs import terminate_with_parent

    rng = random.Random(p.seed)
    corrupt = set(rng.sample(range(p.workers), p.corrupt_relays)) if p.corrupt_relays else set()
    procs = {}
    for i in range(p.workers):
        argv = [
            sys.executable,
            "-m",
            "labs.broadcast_relay",
            "--root",
            root.endpoint,
            "--id",
            f"r{i:02d}",
            "--down-mbit",
            str(p.link_mbit),
            "--up-mbit",
            str(p.link_mbit),
            "--chunk-kib",
            str(p.chunk_kib),
            "--window",
            str(p.window),
            "--timeout",
            str(p.timeout_s),
            "--reserve-mib",
            str(p.snapshot_mib),
            "--reserve-count",
            str(min(2, p.publications)),
        ]
        if root.keys is not None:
            argv += ["--root-key", key_hex(root.keys.public)]
        if p.trace:
            argv += ["--trace", str(Path(p.trace) / f"r{i:02d}.json")]
        if i in corrupt:
            argv.append("--corrupt")
        if i == 0 and p.liar_up_mbit:  # declares 10x the uplink it is shaped at
            argv += ["--up-mbit", str(10 * p.liar_up_mbit), "--real-up-mbit", str(p.liar_up_mbit)]
        if p.netns and p.nat:
            node = natlab.fleet(p.workers, p.nat, p.symmetric)[i]
            argv = [
                "ip",
                "netns",
                "exec",
                node.ns,
                *argv,
                "--kernel-shaped",
                "--bind-host",
                node.address,
            ]
            if node.nat != "public" and not p.punch:
                argv.append("--no-serve")  # today's way in: behind NAT, a tail
        elif p.netns:
            argv = [
                "ip",
                "netns",
                "exec",
                netns.node_name(i),
                *argv,
                "--kernel-shaped",
                "--bind-host",
                netns.address(i),
            ]
        procs[f"r{i:02d}"] = subprocess.Popen(
            argv, preexec_fn=terminate_with_parent, stdin=subprocess.DEVNULL, env=child_env()
        )
    return procs


async def _killer(root: Root, procs: dict[str, Any], p: BenchParams, horizon_s: float) -> None:
    rng = random.Random(p.seed + 1)
    victims = rng.sample(sorted(procs), round(p.kill_fraction * p.workers))
    moments = sorted(rng.uniform(0.05, 0.8) * horizon_s for _ in victims)
    t0 = time.monotonic()
    for wid, at in zip(victims, moments):
        await asyncio.sleep(max(0.0, at - (time.monotonic() - t0)))
        procs[wid].send_signal(signal.SIGKILL)
        root.events.append({"at": time.time(), "event": "killed", "worker": wid})
        root.dead.add(wid)
        root._check_done()


async def run_one(p: BenchParams, progress: Any = None, meter: Any = None) -> dict[str, Any]:
    """One benchmark run; ``meter`` (a ``labs.cpu_meter.CpuMeter``): the CPU time of the root
    and of each relay over the first publication's broadcast (the timed window)."""
    root = Root(p)
    recorded = RecordedVersions(p, root.key) if p.versions_dir else None
    if recorded is not None:
        p.snapshot_mib = recorded.full_bytes / 2**20  # relays reserve a keyframe's buffer
        p.publications = (
            min(p.publications, len(recorded.files)) if p.publications > 1 else len(recorded.files)
        )
    procs = _spawn_relays(root, p)
    payload = b"" if recorded else np.random.default_rng(p.seed).bytes(int(p.snapshot_mib * 2**20))
    expected: dict[int, bytes] = {}  # version -> digest of its full payload
    try:
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(root.serve()), tg.create_task(root.server.serve_forever())]
            await asyncio.wait_for(root.joined.wait(), 120)
            m = recorded.full_bytes if recorded else len(payload)
            lb = _lower_bound(p, m)
            horizon = (
                star_limited_s(m, p.link_mbit, p.uplink_mbit, p.workers)
                if p.topology == "star" and p.link_mbit
                else max(lb, 0.5)
            )
            pubs = []
            for version in range(1, p.publications + 1):
                # encoding, hashing, signing: before the clock
                if recorded is not None:
                    manifest, expected[version] = recorded.prepare(root, version)
                else:
                    manifest, expected[version] = (
                        root.prepare(payload, version),
                        blake3.blake3(payload).digest(),
                    )
                if meter is not None and version == 1:
                    meter.start({"root": os.getpid(), **{w: x.pid for w, x in procs.items()}})
                t0 = time.monotonic()
                sources = await root.publish(manifest)
                if p.kill_fraction and version == 1:
                    tasks.append(tg.create_task(_killer(root, procs, p, horizon)))
                await asyncio.wait_for(root.all_installed.wait(), max(120.0, 10 * horizon))
                elapsed = time.monotonic() - t0
                if meter is not None and version == 1:
                    meter.stop()
                await root.audit()  # each survivor rebuilds it and answers with its digest
                pubs.append(_publication(root, version, sources, manifest, expected[version]))
            await root.shutdown()
            for t in tasks:
                t.cancel()
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs.values():
            try:
                proc.wait(10)
            except Exception:
                proc.kill()
        root.ctx.destroy(linger=0)
        if p.trace:
            Path(p.trace, "root.json").write_text(
                json.dumps(
                    {
                        "endpoint": root.coord.source,
                        "events": root.events,
                        "relays": {w: x.endpoint for w, x in root.coord.peers.items()},
                        "load": os.getloadavg(),
                    },
                    indent=1,
                )
            )
    survivors = sorted(set(procs) - root.dead)
    times = root.coord.install_times(p.publications)
    last = root.digests.get(p.publications, {})
    return {
        "params": p.__dict__,
        "t_bcast_s": max(times[w] for w in survivors),
        "elapsed_s": elapsed,
        "lower_bound_s": lb,
        "star_limited_s": star_limited_s(m, p.link_mbit, p.uplink_mbit, p.workers)
        if p.link_mbit and p.uplink_mbit
        else None,
        "star_unlimited_s": star_unlimited_s(m, p.link_mbit) if p.link_mbit else None,
        COL.learner_bytes_sent: root.store.bytes_sent,
        "snapshot_bytes": m,
        "installed": sum(1 for w in survivors if w in last),
        "survivors": len(survivors),
        "killed": sorted(root.dead),
        "corrupt_installs": sum(x["corrupt_installs"] for x in pubs),
        "reattaches": root.reattaches,
        "parents": _parents(sources, root.coord),
        "install_times_s": times,
        "publications": pubs,
    }


def _lower_bound(p: BenchParams, m: int) -> float:
    return lower_bound_s(
        m, p.uplink_mbit or 1e9, [p.link_mbit or 1e9] * p.workers, [p.link_mbit or 1e9] * p.workers
    )


def _publication(
    root: Root, version: int, sources: dict[str, str], manifest: Manifest, expected: bytes
) -> dict[str, Any]:
    """One publication: T_bcast, what it sent, its audit, the plan and its rates."""
    parents = _parents(sources, root.coord)
    times = root.coord.install_times(version)
    alive = set(root.idents) - root.dead
    digests = root.digests.get(version, {})
    return {
        "version": version,
        "t_bcast_s": max(times[w] for w in alive if w in times),
        "encoding": manifest.encoding,
        "payload_bytes": manifest.payload_size,
        "full_bytes": manifest.result_size,
        "lower_bound_s": _lower_bound(root.p, manifest.payload_size),
        "corrupt_installs": sum(1 for w in alive if digests.get(w) != expected),
        # the liar (r00) heads a chain that it feeds: it pulls from the root and uploads
        "install_times_s": {w: round(t, 3) for w, t in sorted(times.items())},
        "parents": parents,
        "liar_head": (parents.get("r00") == "root" and any(p == "r00" for p in parents.values()))
        if root.p.liar_up_mbit
        else None,
        # (down, up) the *next* plan gets, after this publication's measurements
        "next_plan_mbit": {
            w: [round(d, 1), round(u, 1)] for w, (d, u) in sorted(root.coord.rates().items())
        },
    }


def _parents(sources: dict[str, str], coord: Coordinator) -> dict[str, str]:
    """worker -> the worker it pulled from ("root" for the learner side)."""
    by_ep = {p.endpoint: p.worker_id for p in coord.peers.values() if p.endpoint}
    return {w: by_ep.get(s, "root") for w, s in sorted(sources.items())}


# ----------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m labs.broadcast_bench", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--snapshot-mib", type=float, default=64)
    ap.add_argument(
        "--uplink-mbit", type=float, default=400, help="learner uplink U (0 = unshaped)"
    )
    ap.add_argument(
        "--link-mbit", type=float, default=100, help="worker link b, both ways (0 = unshaped)"
    )
    ap.add_argument(
        "--topology",
        default="chains",
        help=f"one or several of {sorted(TOPOLOGIES)}, comma-separated",
    )
    ap.add_argument("--kill-fraction", type=float, default=0.0)
    ap.add_argument("--corrupt-relays", type=int, default=0)
    ap.add_argument("--chunk-kib", type=int, default=1024)
    ap.add_argument("--window", type=int, default=4)
    ap.add_argument(
        "--chains", type=int, default=0, help="force the number of chains (0 = planner)"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run each topology this many times (seeds seed, seed+1, ...): the spread",
    )
    ap.add_argument(
        "--json", default=None, help="write results here (e.g. benchmarks/results/broadcast.json)"
    )
    ap.add_argument(
        "--netns",
        action="store_true",
        help="shape with the kernel: namespaces, veth, tc tbf (needs root)",
    )
    ap.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument(
        "--nat",
        type=int,
        default=0,
        help="with --netns: this many workers behind home NAT routers (docs/nat.md)",
    )
    ap.add_argument(
        "--symmetric",
        type=int,
        default=0,
        help="of the --nat workers, this many behind symmetric NATs (cannot punch)",
    )
    ap.add_argument(
        "--no-punch",
        action="store_true",
        help="NAT'd workers join without a relay (tails), as before hole punching",
    )
    ap.add_argument(
        "--curve",
        action="store_true",
        help="CurveZMQ on every socket with pull tickets, as a real run (docs/security.md)",
    )
    ap.add_argument(
        "--publications",
        type=int,
        default=1,
        help="publish this many versions in a row, re-planned on measured rates",
    )
    ap.add_argument(
        "--liar-up-mbit",
        type=float,
        default=0.0,
        help="relay r00's real uplink; it declares 10x this (0 = no liar)",
    )
    ap.add_argument(
        "--trust-declared",
        action="store_true",
        help="plan on declared link rates only (the behaviour before measurement)",
    )
    ap.add_argument(
        "--versions-dir",
        default="",
        help="replay recorded real versions (benchmarks/delta_real.py --record DIR) "
        "instead of a random payload, one publication per file",
    )
    ap.add_argument(
        "--delta",
        choices=("on", "off", "both"),
        default="both",
        help="with --versions-dir: deltas between keyframes, full snapshots, or both "
        "runs and their T_bcast ratio",
    )
    ap.add_argument("--keyframe-every", type=int, default=10)
    ap.add_argument(
        "--trace",
        default="",
        help="write per-node traces into this folder: root.json (publications, "
        "re-attaches granted, kills) and rNN.json (each relay's sources per "
        "version: chunks, first/last chunk time, why it left one)",
    )
    ap.add_argument(
        "--liar-json",
        default=None,
        help="run honest / liar / liar-with-declarations-trusted (needs --liar-up-mbit) "
        "and write T_bcast per publication here",
    )
    return ap


def print_table(results: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="Snapshot broadcast (real processes, loopback)")
    for col in (
        "topology",
        "N",
        "M MiB",
        "U / b Mbit/s",
        "killed",
        "corrupt relays",
        "T_bcast s",
        "lower bound s",
        "ratio",
        "MB/s",
        "installed",
        "corrupt installs",
        "learner sent MiB",
    ):
        t.add_column(col, justify="right")
    for r in results:
        p = r["params"]
        t.add_row(
            p["topology"],
            str(p["workers"]),
            f"{p['snapshot_mib']:g}",
            f"{p['uplink_mbit']:g} / {p['link_mbit']:g}",
            str(len(r["killed"])),
            str(p["corrupt_relays"]),
            f"{r['t_bcast_s']:.2f}",
            f"{r['lower_bound_s']:.2f}",
            f"{r['t_bcast_s'] / r['lower_bound_s']:.3f}" if p["link_mbit"] else "unshaped",
            f"{r['snapshot_bytes'] / r['t_bcast_s'] / 1e6:.0f}",
            f"{r['installed']}/{r['survivors']}",
            str(r["corrupt_installs"]),
            f"{r['learner_bytes_sent'] / 2**20:.0f}",
        )
    Console(width=200).print(t)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    if args.netns and not args.inside:
        if os.geteuid() != 0:
            print("--netns needs root (it creates namespaces, veth and tc qdiscs)", file=sys.stderr)
            return 2
        if args.nat:
            if natlab.missing_tools():
                print(f"--nat: {natlab.missing_tools()}", file=sys.stderr)
                return 2
            with natlab.lab(
                natlab.fleet(args.workers, args.nat, args.symmetric),
                args.uplink_mbit,
                args.link_mbit,
            ):
                return subprocess.run(
                    [
                        "ip",
                        "netns",
                        "exec",
                        natlab.ROOT_NS,
                        sys.executable,
                        "-m",
                        "labs.broadcast_bench",
                        *argv,
                        "--inside",
                    ],
                    env=child_env(),
                ).returncode
        with netns.lab(args.workers, args.uplink_mbit, args.link_mbit):
            # The root runs inside its own namespace, behind its own shaped veth.
            return subprocess.run(
                [
                    "ip",
                    "netns",
                    "exec",
                    netns.node_name(None),
                    sys.executable,
                    "-m",
                    "labs.broadcast_bench",
                    *argv,
                    "--inside",
                ],
                env=child_env(),
            ).returncode
    if args.liar_json:
        return liar_main(args)
    if args.versions_dir:
        return versions_main(args)
    results = []
    for topo in args.topology.split(","):
        if topo not in TOPOLOGIES:
            print(f"unknown topology {topo!r}: choose from {sorted(TOPOLOGIES)}", file=sys.stderr)
            return 2
        for rep in range(args.repeat):
            p = BenchParams(
                args.workers,
                args.snapshot_mib,
                args.uplink_mbit,
                args.link_mbit,
                topo,
                args.kill_fraction,
                args.corrupt_relays,
                args.chunk_kib,
                args.window,
                args.chains,
                seed=args.seed + rep,
                netns=args.netns,
                curve=args.curve,
                publications=args.publications,
                liar_up_mbit=args.liar_up_mbit,
                trust_declared=args.trust_declared,
                nat=args.nat,
                symmetric=args.symmetric,
                punch=not args.no_punch,
                trace=str(Path(args.trace) / f"{topo}-{rep}") if args.trace else "",
            )
            if p.trace:
                Path(p.trace).mkdir(parents=True, exist_ok=True)
            results.append(asyncio.run(run_one(p)))
    print_table(results)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        write_result(args.json, {"results": results})
    return 0


def versions_main(args: argparse.Namespace) -> int:
    """Recorded real versions broadcast as deltas and as full snapshots: T_bcast per version."""
    arms = {"on": [True], "off": [False], "both": [True, False]}[args.delta]
    out: dict[str, Any] = {}
    for delta in arms:
        p = BenchParams(
            args.workers,
            0.0,
            args.uplink_mbit,
            args.link_mbit,
            args.topology,
            corrupt_relays=args.corrupt_relays,
            chunk_kib=args.chunk_kib,
            window=args.window,
            chains=args.chains,
            seed=args.seed,
            curve=args.curve,
            publications=args.publications,
            versions_dir=args.versions_dir,
            delta=delta,
            keyframe_every=args.keyframe_every,
        )
        out["delta" if delta else "full"] = asyncio.run(run_one(p))
    if len(out) == 2:
        out["t_bcast_ratio_delta_full"] = [
            d["t_bcast_s"] / f["t_bcast_s"]
            for d, f in zip(out["delta"]["publications"], out["full"]["publications"])
        ]
    print_versions(out)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        write_result(args.json, {"load": os.getloadavg(), "argv": sys.argv[1:], **out})
    return 0


def print_versions(out: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="Recorded real versions: T_bcast per publication (real processes, loopback)")
    for col in (
        "arm",
        "version",
        "encoding",
        "MiB sent",
        "T_bcast s",
        "lower bound s",
        "corrupt installs",
        "learner sent MiB",
    ):
        t.add_column(col, justify="right")
    for arm in ("delta", "full"):
        if arm not in out:
            continue
        for x in out[arm]["publications"]:
            t.add_row(
                arm,
                str(x["version"]),
                x["encoding"],
                f"{x['payload_bytes'] / 2**20:.2f}",
                f"{x['t_bcast_s']:.2f}",
                f"{x['lower_bound_s']:.2f}",
                str(x["corrupt_installs"]),
                "",
            )
        t.add_row(
            arm,
            "all",
            "",
            "",
            f"{sum(x['t_bcast_s'] for x in out[arm]['publications']):.2f}",
            "",
            str(out[arm]["corrupt_installs"]),
            f"{out[arm]['learner_bytes_sent'] / 2**20:.0f}",
        )
    Console(width=200).print(t)
    if "t_bcast_ratio_delta_full" in out:
        print(
            "T_bcast delta / full per version:",
            " ".join(f"{r:.3f}" for r in out["t_bcast_ratio_delta_full"]),
        )


def liar_main(args: argparse.Namespace) -> int:
    """Honest fleet vs the same fleet with one liar (measured rates, then declared ones)."""
    if not args.liar_up_mbit or args.publications < 2:
        print("--liar-json needs --liar-up-mbit X and --publications >= 2", file=sys.stderr)
        return 2
    arms = {
        "honest": {},
        "liar_measured": {"liar_up_mbit": args.liar_up_mbit},
        "liar_declared_trusted": {"liar_up_mbit": args.liar_up_mbit, "trust_declared": True},
    }
    out: dict[str, Any] = {}
    for name, extra in arms.items():
        p = BenchParams(
            args.workers,
            args.snapshot_mib,
            args.uplink_mbit,
            args.link_mbit,
            args.topology,
            chunk_kib=args.chunk_kib,
            window=args.window,
            seed=args.seed,
            curve=args.curve,
            publications=args.publications,
            **extra,
        )
        r = asyncio.run(run_one(p))
        out[name] = {
            "params": r["params"],
            "publications": r["publications"],
            "corrupt_installs": r["corrupt_installs"],
            "lower_bound_s": r["lower_bound_s"],
        }
        print(
            name,
            [(x["version"], round(x["t_bcast_s"], 3), x["liar_head"]) for x in r["publications"]],
            flush=True,
        )
    honest = [x["t_bcast_s"] for x in out["honest"]["publications"]]
    ratios = {
        arm: [round(x["t_bcast_s"] / h, 3) for x, h in zip(out[arm]["publications"], honest)]
        for arm in ("liar_measured", "liar_declared_trusted")
    }
    summary = {
        "t_bcast_ratio_vs_honest": ratios,
        "liar_head": {
            arm: [x["liar_head"] for x in out[arm]["publications"]]
            for arm in ("liar_measured", "liar_declared_trusted")
        },
    }
    print(json.dumps(summary))
    Path(args.liar_json).parent.mkdir(parents=True, exist_ok=True)
    write_result(
        args.liar_json,
        {"load": os.getloadavg(), "argv": sys.argv[1:], "summary": summary, "arms": out},
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
