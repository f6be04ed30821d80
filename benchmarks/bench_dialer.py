"""A version's fetch with a kept connection against a fresh one per version, over slow links.

A source (a CurveZMQ ``ChunkServer`` behind a ZAP handler, as the learner and every relay
serve) runs in its own process behind ``labs.chaos``, a TCP proxy that delays every byte by
half the round trip each way (this machine's ``tc`` has no netem); a child process fetches
``--versions`` versions in a row,
as a worker follows the versions: once opening a new encrypted connection per version (what
every fetch did before ``echo_rl/broadcast/dialer.py``), once keeping it (``Dialer``). Per version it
records the fetch's wall time; per round trip time the medians and their ratio. The payload is
small (one chunk by default, a LoRA adapter's delta), where the connection's set-up is most of
a fetch: TCP's handshake and CurveZMQ's HELLO/WELCOME/INITIATE/READY, about three round trips,
against one for the request and its chunk.

    .venv/bin/python benchmarks/bench_dialer.py [--rtt-ms 0,20,80] [--versions 30]

Writes ``benchmarks/results/dialer_rtt.json`` with the machine (RTT 0: no proxy).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

KEY_SEED = bytes(range(32))  # both sides build the same signed manifests from it
CHUNK = 256 * 1024


def manifests(versions: int, size: int) -> dict[int, tuple[Any, bytes]]:
    import numpy as np

    from echo_rl.broadcast.snapshot import RunKey, build_manifest

    key = RunKey.from_bytes(KEY_SEED)
    out = {}
    for v in range(1, versions + 1):
        payload = np.random.default_rng(v).bytes(size)
        m = build_manifest(
            run_id="bench",
            version=v,
            tensors=[],
            payload=payload,
            chunk_size=CHUNK,
            dtype="uint8",
            key=key,
        )
        out[v] = (m, payload)
    return out


async def serve(versions: int, size: int) -> None:
    """The source, in the namespace: prints its endpoint and key, serves until killed."""
    import zmq
    import zmq.asyncio

    from echo_rl.broadcast.source import ChunkServer
    from echo_rl.broadcast.store import SnapshotBuffer, SnapshotStore
    from echo_rl.core.security import KeyPair, ZapHandler, curve_server

    ctx = zmq.asyncio.Context()
    keys = KeyPair.generate()
    zap = ZapHandler(ctx, lambda address, key: "")
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    curve_server(sock, keys)
    sock.bind("tcp://127.0.0.1:*")
    store = SnapshotStore(keep=versions)
    for m, payload in manifests(versions, size).values():
        store.add(SnapshotBuffer(m, payload))
    server = ChunkServer(sock, store, 1 << 22)
    print(sock.getsockopt_string(zmq.LAST_ENDPOINT), keys.public.decode(), flush=True)
    async with asyncio.TaskGroup() as tg:
        tg.create_task(zap.serve())
        tg.create_task(server.serve_forever())


async def follow(endpoint: str, key: bytes, versions: int, size: int, keep: bool) -> list[float]:
    """Fetch every version in turn; seconds per fetch."""
    import zmq.asyncio

    from echo_rl.broadcast.dialer import Dialer
    from echo_rl.broadcast.fetch import fetch_into
    from echo_rl.broadcast.store import SnapshotBuffer, SnapshotStore
    from echo_rl.broadcast.tickets import Source
    from echo_rl.core.security import KeyPair

    ctx = zmq.asyncio.Context()
    keys = KeyPair.generate()
    dialer = Dialer(ctx, keys) if keep else None
    store, took = SnapshotStore(keep=2), []
    try:
        for v, (m, payload) in manifests(versions, size).items():
            buf = store.add(SnapshotBuffer(m))
            t0 = time.perf_counter()
            await fetch_into(
                ctx,
                store,
                v,
                Source(endpoint, key),
                window=4,
                timeout_s=10.0,
                max_bytes=1 << 22,
                keys=keys,
                dialer=dialer,
            )
            took.append(time.perf_counter() - t0)
            assert bytes(buf.payload) == payload, f"version {v}: wrong bytes"
    finally:
        if dialer is not None:
            dialer.close()
        ctx.destroy(linger=0)
    return took


def run_rtt(rtt_ms: float, versions: int, size: int) -> dict[str, Any]:
    argv = [sys.executable, __file__, "--serve", "--versions", str(versions), "--size", str(size)]
    procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, cwd=ROOT)]
    try:
        assert procs[0].stdout is not None
        endpoint, key = procs[0].stdout.readline().split()
        if rtt_ms > 0:  # the wide area: half the round trip each way
            target = endpoint.removeprefix("tcp://")
            chaos = [sys.executable, "-m", "labs.chaos", "--target", target]
            chaos += ["--latency-ms", f"{rtt_ms / 2:g}"]
            procs.append(subprocess.Popen(chaos, stdout=subprocess.PIPE, text=True, cwd=ROOT))
            assert procs[1].stdout is not None
            ready = procs[1].stdout.readline().split()
            endpoint = f"tcp://127.0.0.1:{ready[-1]}"
        row: dict[str, Any] = {"rtt_ms": rtt_ms}
        for mode, keep in (("fresh", False), ("kept", True)):
            took = asyncio.run(follow(endpoint, key.encode(), versions, size, keep))
            row[mode] = {
                "median_ms": round(1000 * statistics.median(took), 2),
                "p90_ms": round(1000 * sorted(took)[int(0.9 * (len(took) - 1))], 2),
                "first_ms": round(1000 * took[0], 2),
            }
        row["kept_over_fresh"] = round(row["kept"]["median_ms"] / row["fresh"]["median_ms"], 3)
        return row
    finally:
        for p in procs:
            p.kill()
            p.wait()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rtt-ms", default="0,20,80")
    ap.add_argument("--versions", type=int, default=30)
    ap.add_argument("--size", type=int, default=CHUNK, help="payload bytes per version")
    ap.add_argument("--json", default=str(ROOT / "benchmarks/results/dialer_rtt.json"))
    args = ap.parse_args(argv)
    if args.serve:
        asyncio.run(serve(args.versions, args.size))
        return 0
    rows = []
    for rtt in [float(x) for x in args.rtt_ms.split(",")]:
        row = run_rtt(rtt, args.versions, args.size)
        rows.append(row)
        print(
            f"RTT {rtt:5.0f} ms: fresh connection {row['fresh']['median_ms']:8.2f} ms/version, "
            f"kept {row['kept']['median_ms']:8.2f} ms/version ({row['kept_over_fresh']:.3f}x)",
            flush=True,
        )
    out = {
        "command": "python benchmarks/bench_dialer.py " + " ".join(argv or sys.argv[1:]),
        "machine": {
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "python": platform.python_version(),
            "load_avg": os.getloadavg(),
        },
        "versions": args.versions,
        "payload_bytes": args.size,
        "rows": rows,
    }
    Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
