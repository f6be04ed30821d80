"""What the learner server's loop costs in CPU, per kind of work (docs/scale.md).

The control loop runs on its own thread, so its thread CPU clock (``time.thread_time``) read
around each message gives that message's cost without counting the trainer, the write-ahead
log's thread or anything else sharing the process, and without depending on where the
workers run. CURVE encryption and the sockets' I/O happen on ZeroMQ's I/O threads
("ZMQbg/IO/N"), whose CPU is read from ``/proc/self/task`` and shared out per message.

Kinds: each request type (``heartbeat``, ``work_request``, ``trajectories``, ...) is counted
per message; ``notice`` per snapshot notice sent; ``housekeeping`` and ``stats`` per pass (a
pass visits every worker, so their cost grows with the fleet).
"""

from __future__ import annotations

import os
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import TypedDict

CLOCK_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01


class CpuKinds(TypedDict):
    """``LearnerServer.stats().control_cpu``: cumulative over the run."""

    kinds: dict[str, list[float]]  # kind -> [count, CPU seconds on the control loop's thread]
    threads: dict[str, float]  # "control", "zmq_io", "process": CPU seconds


class CpuBook:
    """Per-kind counts and CPU seconds on one thread (the control loop's). Not thread-safe:
    only that thread writes it; ``snapshot`` is read through the loop."""

    def __init__(self) -> None:
        self.count: Counter[str] = Counter()
        self.seconds: dict[str, float] = defaultdict(float)
        self.native_id: int | None = None  # the control thread's, set when the loop starts

    def bind_thread(self) -> None:
        import threading

        self.native_id = threading.get_native_id()

    def add(self, kind: str, seconds: float, n: int = 1) -> None:
        self.count[kind] += n
        self.seconds[kind] += seconds

    def snapshot(self) -> CpuKinds:
        return {
            "kinds": {k: [self.count[k], round(self.seconds[k], 6)] for k in self.count},
            "threads": thread_cpu(self.native_id),
        }


def thread_cpu(control_tid: int | None) -> dict[str, float]:
    """CPU seconds (user + system) of the control thread, of ZeroMQ's I/O threads, and of the
    whole process, from /proc (zeros where there is no /proc)."""
    out = {"control": 0.0, "zmq_io": 0.0, "process": time.process_time()}
    tasks = Path("/proc/self/task")
    if not tasks.is_dir():
        return out
    for task in tasks.iterdir():
        try:
            comm = (task / "comm").read_text().strip()
            # /proc/PID/task/TID/stat: fields after the ")" closing comm; utime and stime are
            # the 14th and 15th fields overall, so the 12th and 13th after it
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the thread ended meanwhile
        cpu = (int(fields[11]) + int(fields[12])) * CLOCK_TICK_S
        if control_tid is not None and int(task.name) == control_tid:
            out["control"] += cpu
        elif comm.startswith("ZMQbg/IO"):
            out["zmq_io"] += cpu
    return {k: round(v, 3) for k, v in out.items()}
