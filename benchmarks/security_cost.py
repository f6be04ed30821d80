"""The price of CurveZMQ on this machine: receiver CPU per MiB and throughput, plaintext against
CURVE in the same run, plus the time to connect and get a first reply (docs/security.md).

    .venv/bin/python benchmarks/security_cost.py [--mib 512] [--repeat 3]

A sender process pushes 1 MiB frames (a snapshot chunk or a large trajectory batch) to a receiver
process (the learner's side) over loopback; the receiver measures its own CPU time
(``time.process_time``) and the wall time. Writes benchmarks/results/security_cost.json.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from echo_rl.core.machine import write_result  # noqa: E402
from echo_rl.core.security import KeyPair, curve_client, curve_server  # noqa: E402

FRAME = 1 << 20
WAIT_MS = 60_000  # any one receive: far above a frame's time, so only a dead peer reaches it


def _joined(proc: mp.process.BaseProcess) -> None:
    proc.join(WAIT_MS / 1000)
    if proc.exitcode != 0:
        proc.kill()
        raise RuntimeError(f"{proc.name} ended with {proc.exitcode}: see its output above")


RESULTS = Path(__file__).parent / "results" / "security_cost.json"


def _zap_accept_all(ctx: zmq.Context) -> None:
    """A minimal ZAP handler in a thread: the benchmark measures crypto, not admission."""
    import threading

    sock = ctx.socket(zmq.REP)
    sock.bind("inproc://zeromq.zap.01")

    def serve() -> None:
        while True:
            try:
                f = sock.recv_multipart()
            except zmq.ContextTerminated:  # ctx.term() in the main thread: close and go
                sock.close(linger=0)
                return
            sock.send_multipart([b"1.0", f[1], b"200", b"OK", b"user", b""])

    threading.Thread(target=serve, daemon=True).start()


def _sender(endpoint: str, server_key: bytes | None, frames: int) -> None:
    ctx = zmq.Context()
    s = ctx.socket(zmq.PUSH)
    if server_key:
        curve_client(s, KeyPair.generate(), server_key)
    s.connect(endpoint)
    payload = b"\x5a" * FRAME
    for _ in range(frames):
        s.send(payload, copy=False)
    s.close(linger=-1)
    ctx.term()


def transfer(curve: bool, mib: int) -> dict[str, float]:
    ctx = zmq.Context()
    keys = KeyPair.generate() if curve else None
    if keys:
        _zap_accept_all(ctx)
    pull = ctx.socket(zmq.PULL)
    if keys:
        curve_server(pull, keys)
    pull.setsockopt(zmq.RCVTIMEO, WAIT_MS)  # a sender that died is an error, not a hang
    pull.bind("tcp://127.0.0.1:*")
    endpoint = pull.getsockopt_string(zmq.LAST_ENDPOINT)
    proc = mp.get_context("spawn").Process(
        target=_sender, args=(endpoint, keys.public if keys else None, mib)
    )
    proc.start()
    pull.recv()  # the clock starts at the first frame: process start-up is not the link
    cpu0, t0 = time.process_time(), time.perf_counter()
    for _ in range(mib - 1):
        pull.recv(copy=False)
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    _joined(proc)
    pull.close(linger=0)
    ctx.term()  # not destroy(): the ZAP thread closes its own socket (sockets are per thread)
    n = mib - 1
    return {"mb_per_s": n * FRAME / wall / 1e6, "receiver_cpu_ms_per_mib": 1000 * cpu / n}


def _echo_server(endpoint_q: mp.Queue, secret: bytes | None, public: bytes | None, n: int) -> None:
    ctx = zmq.Context()
    if secret:
        _zap_accept_all(ctx)
    r = ctx.socket(zmq.ROUTER)
    if secret:
        curve_server(r, KeyPair(public, secret))
    r.bind("tcp://127.0.0.1:*")
    endpoint_q.put(r.getsockopt_string(zmq.LAST_ENDPOINT))
    for _ in range(n):
        ident, msg = r.recv_multipart()
        r.send_multipart([ident, msg])
    r.close(linger=500)
    # not destroy(): it would close the ZAP thread's socket from this thread, which libzmq
    # does not allow (it aborted or hung one run in four); term() lets that thread close it
    ctx.term()


def first_reply(curve: bool, n: int = 50) -> float:
    """Median ms from connect to the first reply of a fresh connection (handshake included)."""
    keys = KeyPair.generate() if curve else None
    q: mp.Queue = mp.get_context("spawn").Queue()
    srv = mp.get_context("spawn").Process(
        target=_echo_server,
        args=(q, keys.secret if keys else None, keys.public if keys else None, n),
    )
    srv.start()
    endpoint = q.get(timeout=30)
    ctx = zmq.Context()
    times = []
    for _ in range(n):
        d = ctx.socket(zmq.DEALER)
        d.setsockopt(zmq.RCVTIMEO, WAIT_MS)
        if keys:
            curve_client(d, KeyPair.generate(), keys.public)
        t0 = time.perf_counter()
        d.connect(endpoint)
        d.send(b"x")
        d.recv()
        times.append(1000 * (time.perf_counter() - t0))
        d.close(linger=0)
    _joined(srv)
    ctx.term()
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", default=str(RESULTS))
    args = ap.parse_args(argv)
    runs: dict[str, list[dict[str, float]]] = {"plain": [], "curve": []}
    for _ in range(args.repeat):  # interleaved, so both see the same machine load
        for mode in ("plain", "curve"):
            runs[mode].append(transfer(mode == "curve", args.mib))
    med = {m: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for m, rs in runs.items()}
    out = {
        "frame_bytes": FRAME,
        "mib_per_run": args.mib,
        "runs": runs,
        "median": med,
        "curve_over_plain_throughput": med["curve"]["mb_per_s"] / med["plain"]["mb_per_s"],
        "first_reply_ms": {"plain": first_reply(False), "curve": first_reply(True)},
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    write_result(args.json, out)
    from rich.console import Console
    from rich.table import Table

    t = Table(title="CurveZMQ cost (loopback, 1 MiB frames, medians)")
    for c in ("mode", "MB/s", "receiver CPU ms/MiB", "connect + first reply ms"):
        t.add_column(c, justify="right")
    for m in ("plain", "curve"):
        t.add_row(
            m,
            f"{med[m]['mb_per_s']:.0f}",
            f"{med[m]['receiver_cpu_ms_per_mib']:.3f}",
            f"{out['first_reply_ms'][m]:.2f}",
        )
    Console().print(t)
    print(f"curve / plain throughput: {out['curve_over_plain_throughput']:.3f}; wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
