"""CPU time per process and per thread over a window, read from /proc (Linux).

The broadcast benchmarks (``benchmarks/relay_cpu.py``) use it to say where a relay's time goes
without a profiler: each process's main thread (Python: requests, receive into the payload,
BLAKE3, the event loop) apart from libzmq's I/O thread (``ZMQbg/IO/0``: the kernel's TCP copies)
and anything else (``ZMQbg/Reaper``, BLAKE3's pool). Clock-tick resolution (usually 10 ms):
windows of a second or more.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def thread_kind(comm: str, tid: int, pid: int) -> str:
    """``main`` (the process's own thread), ``io`` (libzmq's I/O thread) or ``other``."""
    if tid == pid:
        return "main"
    return "io" if comm.startswith("ZMQbg/IO") else "other"


def _stat(path: Path) -> tuple[str, float]:
    """(comm, CPU seconds so far: user + system) from a /proc stat file."""
    stat = path.read_text()
    comm = stat[stat.index("(") + 1 : stat.rindex(")")]
    fields = stat[stat.rindex(")") + 2 :].split()
    return comm, (int(fields[11]) + int(fields[12])) * TICK_S  # utime, stime


def _threads(pid: int) -> dict[int, tuple[str, float]]:
    """tid -> (kind, CPU seconds so far) of every live thread of ``pid``, and -1 -> the
    process's total (which keeps the time of threads that have ended)."""
    out: dict[int, tuple[str, float]] = {-1: ("total", _stat(Path(f"/proc/{pid}/stat"))[1])}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            comm, cpu = _stat(task / "stat")
        except OSError:  # the thread ended meanwhile
            continue
        out[int(task.name)] = (thread_kind(comm, int(task.name), pid), cpu)
    return out


@dataclass
class CpuMeter:
    """``start`` and ``stop`` around a window; ``seconds`` per role and thread kind."""

    roles: dict[str, int] = field(default_factory=dict)  # role name -> pid
    _before: dict[str, dict[int, tuple[str, float]]] = field(default_factory=dict)
    seconds: dict[str, dict[str, float]] = field(default_factory=dict)

    def start(self, roles: dict[str, int]) -> None:
        self.roles = dict(roles)
        self._before = {role: _threads(pid) for role, pid in self.roles.items()}

    def stop(self) -> None:
        """CPU seconds spent in the window by each role's main and io threads, and the rest
        (``other``: the process's total less those two, threads that ended included)."""
        self.seconds = {}
        for role, pid in self.roles.items():
            spent = {"main": 0.0, "io": 0.0, "total": 0.0}
            before = self._before.get(role, {})
            for tid, (kind, cpu) in _threads(pid).items():
                if kind in spent:
                    spent[kind] += cpu - before.get(tid, (kind, 0.0))[1]
            spent["other"] = max(0.0, spent["total"] - spent["main"] - spent["io"])
            self.seconds[role] = spent
