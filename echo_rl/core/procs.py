"""Child processes for the quickstart and the integration tests.

Children run in their own session (so a terminal's Ctrl-C reaches only the parent, which then
stops them in order) and get ``PR_SET_PDEATHSIG`` so that even a SIGKILLed parent leaves no
orphans. They are stopped by their own pid, never by name.
"""

from __future__ import annotations

import ctypes
import os
import selectors
import signal
import socket
import subprocess
import sys
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from echo_rl.core.config import EchoConfig

# The learner prints this line, then its control address, on stdout once it serves.
READY_PREFIX = "ECHO_LEARNER_READY "

_PR_SET_PDEATHSIG = 1

# Each started child's log (ProcessGroup.start's), for wait_ready's message; gone with the child.
_LOGS: weakref.WeakKeyDictionary[subprocess.Popen[bytes], Path] = weakref.WeakKeyDictionary()


def terminate_with_parent() -> None:
    """A child's ``preexec_fn``: the kernel sends it SIGTERM when its parent dies (Linux
    ``prctl(PR_SET_PDEATHSIG)``), so no learner, worker or relay outlives a crashed parent."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass  # not Linux: the parent's own cleanup still stops the children


@dataclass
class ProcessGroup:
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def start(
        self,
        name: str,
        argv: list[str],
        log_path: Path,
        *,
        pipe_stdout: bool = False,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
    ) -> subprocess.Popen[bytes]:
        log = open(log_path, "ab")
        proc = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE if pipe_stdout else log,
            stderr=log,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=terminate_with_parent,
            env={**os.environ, **(env or {})},
            cwd=cwd,
        )
        log.close()
        _LOGS[proc] = log_path  # wait_ready quotes it on failure
        self.procs[name] = proc
        return proc

    def stop(self, name: str, timeout: float = 15.0, sig: int = signal.SIGTERM) -> int | None:
        proc = self.procs[name]
        if proc.poll() is None:
            proc.send_signal(sig)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        return proc.returncode

    def stop_all(self, timeout: float = 15.0) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (the OS's pick; another process may take it later)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def pin_learner_port(cfg: EchoConfig) -> int:
    """A fixed learner.port, for a learner that must come back where its workers know it
    (``--resume`` after a crash), with every other learner socket on a port the OS picks. Left
    derived, they would sit at port + 1 .. + 4 (docs/ports.md), ports any process's outgoing
    connection may hold meanwhile: the restart drill lost a run to a reflector port taken so."""
    cfg.learner.port = free_port(cfg.learner.host)
    cfg.learner.chunk_port, cfg.learner.reflector_ports, cfg.metrics.port = 0, [0, 0], 0
    return cfg.learner.port


def python_argv(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


def wait_ready(proc: subprocess.Popen[bytes], timeout: float) -> str:
    """Read the learner's stdout until it prints its address (or dies, or time runs out)."""
    assert proc.stdout is not None
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    buf = b""
    while time.monotonic() < deadline:
        if not sel.select(deadline - time.monotonic()):
            break
        chunk = os.read(proc.stdout.fileno(), 4096)
        if not chunk:
            raise RuntimeError(
                f"learner exited (code {proc.wait()}) before it was ready" + _log_tail(proc)
            )
        buf += chunk
        for line in buf.decode(errors="replace").splitlines():
            if line.startswith(READY_PREFIX):
                return line[len(READY_PREFIX) :].strip()
    raise RuntimeError(f"learner not ready within {timeout}s" + _log_tail(proc))


def _log_tail(proc: subprocess.Popen[bytes], chars: int = 3000) -> str:
    """The end of a process's log (ProcessGroup.start's), so a failure says why, not 'see its log'
    after the log's temporary folder is gone."""
    path = _LOGS.get(proc)
    if path is None or not path.exists():
        return "; see its log"
    return f"; the end of {path}:\n" + path.read_text(errors="replace")[-chars:]
