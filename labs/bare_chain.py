"""The yardstick for the unshaped loopback broadcast: a bare pyzmq chain of the same hops.

No hashing, no manifest, no requests: the root PUSHes the payload in chunks to hop 0 and each
hop forwards every chunk to the next the moment it arrives (zero-copy frames); each hop reports
to the root when it holds all of them. What Echo's relays add on top (BLAKE3 per chunk,
request windows, parking, the ROUTER/DEALER protocol) shows as the ratio of the two throughputs
measured in the same run, which holds across machines whose absolute MB/s differ threefold.

    python -m labs.bare_chain hop --next EP --done EP --chunks N   (one hop, a process)
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from typing import Any

import zmq

READY = "BARE_HOP_READY "


def hop(args: argparse.Namespace) -> int:
    from echo_rl.broadcast.memory import keep_chunk_buffers

    # The relays' malloc setting (no mmap/munmap and page faults per received chunk): a
    # yardstick without it ran its I/O threads about 10% slower than the relays' (measured
    # with benchmarks/relay_cpu.py) and flattered the ratio.
    keep_chunk_buffers()
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.RCVHWM, 64)
    pull.bind("tcp://127.0.0.1:*")
    push = None
    if args.next:
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.SNDHWM, 64)
        push.connect(args.next)
    done = ctx.socket(zmq.PUSH)
    done.connect(args.done)
    print(READY + pull.getsockopt_string(zmq.LAST_ENDPOINT), flush=True)
    got = 0
    for _ in range(args.chunks):
        frame = pull.recv(copy=False)
        got += len(frame)
        if push is not None:
            push.send(frame, copy=False)
    done.send_string(f"{args.id} {got}")
    if args.hold:  # alive (its threads readable in /proc) until the root closes our stdin
        sys.stdin.read()
    done.close(linger=5000)
    if push is not None:
        push.close(linger=-1)
    pull.close(linger=0)
    ctx.term()
    return 0


def run(hops: int, size: int, chunk: int, meter: Any = None) -> float:
    """Seconds from the root's first send until every hop holds the whole payload;
    ``meter`` (a ``labs.cpu_meter.CpuMeter``): the root's and each hop's CPU time over them."""
    from echo_rl.core.procs import terminate_with_parent
    from labs import child_env

    ctx = zmq.Context()
    done = ctx.socket(zmq.PULL)
    done.bind("tcp://127.0.0.1:*")
    done_ep = done.getsockopt_string(zmq.LAST_ENDPOINT)
    chunks = -(-size // chunk)
    procs, nxt = [], ""
    try:
        for i in reversed(range(hops)):  # the tail binds first: each hop connects to the next
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "labs.bare_chain",
                    "hop",
                    "--id",
                    str(i),
                    "--next",
                    nxt,
                    "--done",
                    done_ep,
                    "--chunks",
                    str(chunks),
                    "--hold",
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                preexec_fn=terminate_with_parent,
                env=child_env(),
            )
            procs.append(proc)
            line = proc.stdout.readline()
            if not line.startswith(READY):
                raise RuntimeError(f"bare chain hop {i} did not start: {line!r}")
            nxt = line[len(READY) :].strip()
        payload = memoryview(bytes(size))
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.SNDHWM, 64)
        push.connect(nxt)
        if meter is not None:  # procs[0] is the tail: hop i is procs[hops - 1 - i]
            meter.start(
                {"root": os.getpid(), **{f"hop{i}": procs[hops - 1 - i].pid for i in range(hops)}}
            )
        t0 = time.monotonic()
        for start in range(0, size, chunk):
            push.send(payload[start : start + chunk], copy=False)
        got = [done.recv_string().split() for _ in range(hops)]
        elapsed = time.monotonic() - t0
        if meter is not None:
            meter.stop()
        short = [hop_id for hop_id, n in got if int(n) != size]
        if short:
            raise RuntimeError(f"bare chain hops {short} did not get all {size} bytes")
        push.close(linger=0)
        return elapsed
    finally:
        for proc in procs:
            proc.stdin.close()  # type: ignore[union-attr]
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
        done.close(linger=0)
        ctx.term()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m labs.bare_chain")
    sub = ap.add_subparsers(dest="cmd", required=True)
    h = sub.add_parser("hop")
    h.add_argument("--id", default="0")
    h.add_argument("--next", default="")
    h.add_argument("--done", required=True)
    h.add_argument("--chunks", type=int, required=True)
    h.add_argument("--hold", action="store_true", help="stay until stdin closes")
    r = sub.add_parser("run")
    r.add_argument("--hops", type=int, default=4)
    r.add_argument("--mib", type=float, default=256)
    r.add_argument("--chunk-kib", type=int, default=4096)
    args = ap.parse_args(argv)
    if args.cmd == "hop":
        return hop(args)
    size = int(args.mib * 2**20)
    s = run(args.hops, size, args.chunk_kib * 1024)
    print(f"{args.hops} hops, {args.mib:g} MiB: {s:.3f} s, {size / s / 1e6:.0f} MB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
