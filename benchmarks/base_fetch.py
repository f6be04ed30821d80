"""What the base model's one trip costs (issue 32, item 3): publish, fetch over loopback, cache.

For a model folder: the learner's side (read the files and hash the chunks, sign:
``build_base_manifest``), a worker's fetch of every chunk from a peer relay over loopback with
the chunk checks (``obtain_base``, empty cache), and a second worker's cache hit (pack the cached
files again and compare every chunk hash: what a join on the same base costs instead of the
fetch). Prints one JSON line per run and writes them to ``--json``.

    .venv/bin/python benchmarks/base_fetch.py models/smollm2-135m-instruct --runs 3 \\
        --json benchmarks/results/base_fetch.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import zmq.asyncio

from echo_rl.broadcast.basemodel import BaseCache, build_base_manifest, verify_base_manifest
from echo_rl.broadcast.relay import Relay, RelayConfig
from echo_rl.broadcast.snapshot import RunKey
from echo_rl.broadcast.tickets import Source
from echo_rl.worker.base import obtain_base


async def one_run(folder: Path, chunk_kib: int, tmp: Path) -> dict:
    key = RunKey.generate()
    t0 = time.perf_counter()
    manifest, payload = build_base_manifest(
        run_id="bench", base_model="ab" * 32, folder=folder, chunk_size=chunk_kib * 1024, key=key
    )
    publish_s = time.perf_counter() - t0
    ctx = zmq.asyncio.Context()
    peer, joiner, second = (Relay(ctx, RelayConfig(chunk_bytes=chunk_kib * 1024)) for _ in range(3))
    peer.hold_base(manifest, payload)
    tasks = [asyncio.create_task(r.serve_forever()) for r in (peer, joiner, second)]

    async def ask(*_):
        return Source(peer.endpoint)

    try:
        cache = BaseCache(tmp / "cache")
        t0 = time.perf_counter()
        got = await obtain_base(
            verify_base_manifest(manifest.to_wire(), key.public_bytes, "bench"),
            model_name="absent",
            relay=joiner,
            ask=ask,
            cache=cache,
        )
        fetch_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        hit = await obtain_base(
            verify_base_manifest(manifest.to_wire(), key.public_bytes, "bench"),
            model_name="absent",
            relay=second,
            ask=ask,
            cache=cache,
        )
        hit_s = time.perf_counter() - t0
    finally:
        for t in tasks:
            t.cancel()
        for r in (peer, joiner, second):
            r.close()
        ctx.destroy(linger=0)
    return {
        "folder": str(folder),
        "bytes": len(payload),
        "files": len(manifest.files),
        "chunks": manifest.layout.num_chunks,
        "publish_s": round(publish_s, 3),
        "fetch_bytes": got.fetched_bytes,
        "fetch_s": round(fetch_s, 3),
        "fetch_mbit": round(got.fetched_bytes * 8 / 1e6 / fetch_s, 1),
        "cache_hit_bytes": hit.fetched_bytes,
        "cache_hit_s": round(hit_s, 3),
        "load": round(os.getloadavg()[0], 1),
        "cpus": os.cpu_count(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--chunk-kib", type=int, default=1024)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    rows = []
    for _ in range(args.runs):
        with tempfile.TemporaryDirectory() as tmp:
            rows.append(asyncio.run(one_run(args.folder, args.chunk_kib, Path(tmp))))
        print(json.dumps(rows[-1]), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
