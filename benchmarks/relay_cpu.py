"""Where a relay's CPU goes, against a bare pyzmq chain of the same hops (docs/broadcast.md,
"A relay's CPU").

    .venv/bin/python benchmarks/relay_cpu.py                 # 3 alternating pairs, 1 GiB: ~2 min
    .venv/bin/python benchmarks/relay_cpu.py --runs 1 --mib 256

One chain of 4 relays (``labs.broadcast_bench``, CurveZMQ off, unshaped loopback, 4 MiB
chunks) and a bare PUSH/PULL chain of 4 hop processes (``labs.bare_chain``: no hashing, no
protocol), run in turn. For each, the CPU seconds per GB moved that the root and the hops spent
over the broadcast, split by thread (``labs.cpu_meter``): ``main`` (Python: requests, receive
into the payload, BLAKE3 per chunk, the event loop), ``io`` (libzmq's I/O thread: the kernel's
TCP copies), ``other`` (BLAKE3's threads, libzmq's reaper).

Two ways to read it:

* **CPU-bound** (fewer cores than threads, as on a 2-core VM): the chain moves bytes at the rate
  the machine's cores allow, so its throughput goes as 1 / (all CPU per GB); the predicted
  ratio is bare CPU per GB / Echo CPU per GB. The measured ratio should be close to it.
* **A core per thread** (a relay on its own multi-core host, as in the field): each thread is a
  pipeline stage, so the chain moves bytes at the rate of its busiest thread; the projected
  ratio is bare's busiest thread's CPU per GB / Echo's. A projection from measured CPU costs,
  not a measured throughput.

Writes benchmarks/results/broadcast/relay_cpu.json (every run, and the machine).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from echo_rl.core.machine import write_result  # noqa: E402
from labs import bare_chain  # noqa: E402
from labs.broadcast_bench import run_one  # noqa: E402
from labs.broadcast_root import BenchParams  # noqa: E402
from labs.cpu_meter import CpuMeter  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "broadcast" / "relay_cpu.json"
HOPS = 4
SIDES = ("echo_cpu_s_per_gb", "bare_cpu_s_per_gb")


def per_gb(meter: CpuMeter, nbytes: int) -> dict[str, dict[str, float]]:
    """CPU seconds per GB moved, per role and thread kind; ``hops``: the hops' sum."""
    gb = nbytes / 1e9
    roles = {r: {k: v / gb for k, v in s.items()} for r, s in meter.seconds.items()}
    hops = [s for r, s in roles.items() if r != "root"]
    roles["hops"] = {k: sum(h[k] for h in hops) for k in ("main", "io", "other", "total")}
    roles["busiest_thread"] = {
        "cpu_s_per_gb": max(max(s["main"], s["io"]) for r, s in roles.items() if r != "hops")
    }
    return roles


def hash_gb_s(chunk_bytes: int, reps: int = 64) -> float:
    """BLAKE3 on one core, GB/s, over one chunk-sized buffer (hot in cache: a ceiling)."""
    import os
    import time

    import blake3

    data = os.urandom(chunk_bytes)
    blake3.blake3(data).digest()
    t0 = time.perf_counter()
    for _ in range(reps):
        blake3.blake3(data).digest()
    return reps * chunk_bytes / (time.perf_counter() - t0) / 1e9


def one_pair(i: int, mib: int, chunk_kib: int) -> dict[str, Any]:
    size = mib * 2**20
    echo_meter, bare_meter = CpuMeter(), CpuMeter()
    params = BenchParams(HOPS, mib, 0, 0, "chains", chunk_kib=chunk_kib, chains=1, seed=i)
    r = asyncio.run(run_one(params, meter=echo_meter))
    bare_s = bare_chain.run(HOPS, size, chunk_kib * 1024, meter=bare_meter)
    echo, bare = per_gb(echo_meter, size), per_gb(bare_meter, size)
    total = lambda x: x["root"]["total"] + x["hops"]["total"]  # noqa: E731
    busiest = lambda x: x["busiest_thread"]["cpu_s_per_gb"]  # noqa: E731
    row = {
        "run": i,
        "echo_mb_s": size / r["t_bcast_s"] / 1e6,
        "bare_mb_s": size / bare_s / 1e6,
        "corrupt_installs": r["corrupt_installs"],
        "echo_cpu_s_per_gb": echo,
        "bare_cpu_s_per_gb": bare,
        "predicted_ratio_cpu_bound": total(bare) / total(echo),
        "projected_ratio_core_per_thread": busiest(bare) / busiest(echo),
    }
    row["ratio"] = row["echo_mb_s"] / row["bare_mb_s"]
    return row


def table(rows: list[dict[str, Any]]) -> str:
    med = lambda f: statistics.median(f(r) for r in rows)  # noqa: E731
    lines = [
        "CPU seconds per GB moved (medians), one chain of 4 hops:",
        f"{'':24}{'Echo':>10}{'bare':>10}",
    ]
    cells = [(who, kind) for who in ("root", "hops") for kind in ("main", "io", "other", "total")]
    for who, kind in [*cells, ("busiest_thread", "cpu_s_per_gb")]:
        e, b = (statistics.median(r[side][who][kind] for r in rows) for side in SIDES)
        label = "busiest thread" if who == "busiest_thread" else f"{who} {kind}"
        lines.append(f"{label:24}{e:>10.3f}{b:>10.3f}")
    lines.append(
        f"throughput: Echo {med(lambda r: r['echo_mb_s']):.0f} MB/s, "
        f"bare {med(lambda r: r['bare_mb_s']):.0f} MB/s, "
        f"measured ratio {med(lambda r: r['ratio']):.3f}"
    )
    lines.append(
        f"predicted ratio when CPU-bound (bare CPU / Echo CPU): "
        f"{med(lambda r: r['predicted_ratio_cpu_bound']):.3f}"
    )
    lines.append(
        f"projected ratio with a core per thread (busiest thread): "
        f"{med(lambda r: r['projected_ratio_core_per_thread']):.3f}"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3, help="alternating Echo/bare pairs")
    ap.add_argument("--mib", type=int, default=1024, help="payload (MiB)")
    ap.add_argument("--chunk-kib", type=int, default=4096)
    ap.add_argument("--json", type=Path, default=OUT)
    args = ap.parse_args(argv)
    rows = []
    for i in range(args.runs):
        row = one_pair(i, args.mib, args.chunk_kib)
        rows.append(row)
        print(
            f"pair {i + 1}/{args.runs}: Echo {row['echo_mb_s']:.0f} MB/s, "
            f"bare {row['bare_mb_s']:.0f} MB/s, ratio {row['ratio']:.3f}",
            flush=True,
        )
    blake = hash_gb_s(args.chunk_kib * 1024)
    print(table(rows))
    print(f"BLAKE3 on one core, one chunk hot in cache: {blake:.2f} GB/s")
    write_result(
        args.json,
        {
            "generated_by": "benchmarks/relay_cpu.py",
            "params": {"hops": HOPS, "mib": args.mib, "chunk_kib": args.chunk_kib},
            "runs": rows,
            "blake3_gb_s_one_core": blake,
            "table": table(rows),
        },
    )
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
