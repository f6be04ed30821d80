"""CPU load of the owner's processes, from ``/proc`` (Linux).

Every period the CPU time of each process is read from ``/proc/<pid>/stat``; the owner's load
is the CPU those processes used since the previous sample, in cores. Not the owner's: this
worker and its children, and Echo's own processes on the same machine (a learner or other
workers started by ``echo-rl quickstart``, recognised by their command line). The owner is
busy when their load stays above ``cores`` for two samples in a row (a single spike, e.g. a
shell starting, is not a game).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from echo_rl.worker.owner.base import OwnerSignal

ECHO_COMMANDS = ("echo-worker", "echo-rl", "echo_rl")  # console scripts and `python -m echo_rl...`
TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat(pid: str) -> tuple[int, float] | None:
    """(parent pid, CPU seconds) of a process, or None if it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    rest = raw[raw.rfind(")") + 2 :].split()  # the name may hold spaces and parentheses
    return int(rest[1]), (int(rest[11]) + int(rest[12])) / TICK


class CpuSignal(OwnerSignal):
    last_seen: str  # OwnerSignal's: what the last sample saw, for the log line

    def __init__(self, quiet_s: float = 30.0, cores: float = 0.5, proc: str = "/proc"):
        super().__init__(quiet_s)
        if not cores > 0:
            raise ValueError(f"--owner-cpu-cores must be > 0, got {cores}")
        if not Path(proc, "self", "stat").exists():
            raise ValueError("the cpu owner signal reads /proc (Linux); use --owner-signal file")
        self.cores = cores
        self.me = os.getpid()
        self._cpu: dict[str, float] = {}
        self._ours: dict[str, bool] = {}
        self._t = time.monotonic()
        self._over = 0
        self.load = 0.0
        self.sample()

    def _is_ours(self, pid: str, parents: dict[str, int]) -> bool:
        if pid not in self._ours:
            ours = False
            p = pid
            for _ in range(64):  # ancestry: this worker's children are ours
                if p == str(self.me):
                    ours = True
                    break
                q = parents.get(p)
                if q is None or q <= 1:
                    break
                p = str(q)
            if not ours:
                try:
                    cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
                except OSError:
                    cmd = ""
                ours = any(c in cmd for c in ECHO_COMMANDS)
            self._ours[pid] = ours
        return self._ours[pid]

    def sample(self) -> bool:
        now = time.monotonic()
        stats = {p: s for p in os.listdir("/proc") if p.isdigit() and (s := _stat(p)) is not None}
        parents = {p: s[0] for p, s in stats.items()}
        used, top = 0.0, ("", 0.0)
        for pid, (_, cpu) in stats.items():
            d = cpu - self._cpu.get(pid, cpu)
            if d > 0 and not self._is_ours(pid, parents):
                used += d
                top = max(top, (pid, d), key=lambda x: x[1])
        self._cpu = {p: s[1] for p, s in stats.items()}
        self._ours = {p: v for p, v in self._ours.items() if p in stats}
        dt = max(now - self._t, 1e-3)
        self._t = now
        self.load = used / dt
        self._over = self._over + 1 if self.load > self.cores else 0
        self.last_seen = (
            f"other processes use {self.load:.2f} cores (pid {top[0]} the most), "
            f"over {self.cores:g}"
        )
        return self._over >= 2
