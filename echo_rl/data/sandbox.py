"""Run a policy's program under limits: for rewards that execute model-written code.

``call_entry(code, entry, calls, limits)`` starts a fresh Python (``-I -S``: no site folders,
no PYTHON* variables, no working folder on ``sys.path``) in an empty temporary folder, with an
empty environment, which before it runs anything of the program

* leaves the network: a new network namespace with no interface up (``unshare``; as root
  directly, otherwise inside a new user namespace). Where the kernel refuses, the call fails
  with ``SandboxError`` naming the fix, unless ``Limits.network_optional`` (documented risk);
* caps CPU seconds (RLIMIT_CPU), address space (RLIMIT_AS), file size written (RLIMIT_FSIZE),
  open files (RLIMIT_NOFILE) and core dumps;
* as root, drops to the ``nobody`` user (so RLIMIT_NPROC applies: no fork bombs, and the
  machine's files are read-only to it); otherwise RLIMIT_NPROC holds it to the user's count;
* runs in its own session, so a timeout kills everything it started.

Then it executes the program and calls ``entry(*args)`` for each of ``calls``, and writes the
results as JSON on a line of its own, last. The caller compares them with what it expects:
the program never sees the expected values, so it cannot claim a pass it did not earn by
printing one (what it prints before is ignored; a result that is not JSON counts as wrong).

The sandbox bounds what a program can cost and reach; it does not make running untrusted code
safe against kernel exploits. docs/scheduling.md ("The code adapter's sandbox") says what each
limit stops and the tests that show it (tests/test_sandbox.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from echo_rl.core.errors import EchoError

NOBODY = 65534
# Imported before the program runs: as root the child drops to ``nobody``, who may not be able
# to read the interpreter's own folders (under /root, say), so these are what it can import.
PRELOAD = (
    "bisect", "collections", "dataclasses", "decimal", "fractions", "functools", "heapq",
    "itertools", "math", "operator", "random", "re", "statistics", "string", "typing",
)  # fmt: skip


class SandboxError(EchoError, RuntimeError):
    """The sandbox cannot be set up on this machine (not a program's fault)."""

    default_reason = "sandbox"


@dataclass(frozen=True)
class Limits:
    cpu_s: int = 2  # CPU seconds (RLIMIT_CPU), the program's own
    wall_s: float = 5.0  # wall seconds for the whole call, start-up included
    memory_mib: int = 512  # address space (RLIMIT_AS); Python itself takes about 30
    file_kib: int = 64  # the largest file it may write (RLIMIT_FSIZE)
    disk_kib: int = 1024  # each writable place (a private tmpfs) holds at most this
    output_kib: int = 64  # what is read of its standard output (the end of it)
    network_optional: bool = False  # run with the network where no namespace can be had


@dataclass(frozen=True)
class Outcome:
    results: list[Any] | None  # one per call (None: the program never got that far)
    status: str  # "ok", "timeout", "crashed" (no result line), "error" (it raised)
    detail: str = ""


# The child's own code: set up the limits, then run the program. Kept as a string (not a
# module) so that the child imports nothing of Echo and starts in ~20 ms.
_LAUNCHER = r"""
import ctypes, json, os, resource, sys
job = json.loads(sys.stdin.read())
CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWNET = 0x00020000, 0x10000000, 0x40000000
MS_REC, MS_PRIVATE = 0x4000, 0x40000
libc = ctypes.CDLL(None, use_errno=True)
uid, gid = os.getuid(), os.getgid()
flags = CLONE_NEWNS | CLONE_NEWNET | (0 if uid == 0 else CLONE_NEWUSER)
def refuse(what):
    print(json.dumps({"sandbox": what + " failed: errno " + str(ctypes.get_errno())}))
    sys.exit(3)
if libc.unshare(flags) != 0:
    if not job["network_optional"]:
        refuse("unshare")
else:
    # The world-writable places become small private tmpfs, gone when it exits; it works in
    # the new /tmp.
    if libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None) != 0:
        refuse("mount --make-rprivate /")
    size = ("size=%dk,mode=1777" % job["disk_kib"]).encode()
    for where in ("/tmp", "/var/tmp", "/dev/shm"):
        if os.path.isdir(where) and libc.mount(b"tmpfs", where.encode(), b"tmpfs", 0, size) != 0:
            refuse("mount tmpfs on " + where)
    os.chdir("/tmp")
for name in PRELOAD:
    __import__(name)
__import__("random").seed(0)  # a program that draws numbers scores the same every run
def limit(what, n):
    resource.setrlimit(what, (n, n))
limit(resource.RLIMIT_CORE, 0)
limit(resource.RLIMIT_CPU, job["cpu_s"])
limit(resource.RLIMIT_FSIZE, job["file_kib"] * 1024)  # its standard output too
limit(resource.RLIMIT_NOFILE, 16)
if uid == 0:
    os.setgroups([])
    os.setgid(NOBODY_UID)
    os.setuid(NOBODY_UID)
limit(resource.RLIMIT_NPROC, 0)  # counted per user: its user already has a process, so no fork
limit(resource.RLIMIT_AS, job["memory_mib"] << 20)
out = sys.stdout
results = []
try:
    space = {"__name__": "__sandbox__"}
    exec(compile(job["code"], "<program>", "exec"), space)
    fn = space[job["entry"]]
    for args in job["calls"]:
        try:
            value = fn(*args)
            json.dumps(value)
        except BaseException as exc:
            value = {"__error__": type(exc).__name__}
        results.append(value)
    status, detail = "ok", ""
except BaseException as exc:
    status, detail = "error", type(exc).__name__ + ": " + str(exc)[:200]
out.write("\n" + json.dumps({"results": results, "status": status, "detail": detail}) + "\n")
out.flush()
os._exit(0)
""".replace("NOBODY_UID", str(NOBODY)).replace("PRELOAD", repr(PRELOAD))


def call_entry(code: str, entry: str, calls: Sequence[Sequence[object]], limits: Limits) -> Outcome:
    """Run ``code`` in the sandbox and call ``entry(*args)`` for each of ``calls``."""
    job = {
        "code": code,
        "entry": entry,
        "calls": calls,
        "cpu_s": limits.cpu_s,
        "file_kib": limits.file_kib,
        "disk_kib": limits.disk_kib,
        "memory_mib": limits.memory_mib,
        "network_optional": limits.network_optional,
    }
    with tempfile.TemporaryDirectory(prefix="echo-sandbox-") as folder:
        # Files, not pipes: what the program prints is bounded by its file-size limit (a pipe
        # read to the end would hold whatever it printed in the caller's memory).
        job_path, out_path = os.path.join(folder, "job.json"), os.path.join(folder, "out")
        with open(job_path, "w") as f:
            json.dump(job, f)
        with open(job_path, "rb") as stdin, open(out_path, "w+b") as stdout:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _LAUNCHER],
                stdin=stdin,
                stdout=stdout,
                stderr=subprocess.DEVNULL,
                cwd=folder,
                env={"PYTHONHASHSEED": "0"},  # set() and dict orders the same in every run
                start_new_session=True,
            )
            try:
                proc.wait(timeout=limits.wall_s)
            except subprocess.TimeoutExpired:
                return Outcome(None, "timeout", f"over {limits.wall_s:g} s")
            finally:
                # Still running (over time, or the caller interrupted): it and whatever it
                # started go. Once reaped its process id may be another's: never signalled then.
                if proc.returncode is None:
                    _kill_session(proc)
            size = stdout.seek(0, os.SEEK_END)
            stdout.seek(max(0, size - limits.output_kib * 1024))
            out = stdout.read()
    return _parse(out, proc.returncode)


def _kill_session(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, 9)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _parse(out: bytes, returncode: int) -> Outcome:
    lines = out.decode("utf-8", "replace").strip().splitlines()
    try:
        last = json.loads(lines[-1]) if lines else None
    except (ValueError, RecursionError):  # not JSON, or nested deeper than the decoder goes
        last = None
    if returncode == 3 and isinstance(last, dict) and "sandbox" in last:
        raise SandboxError(
            f"cannot take the program off the network ({last['sandbox']}): run the worker as "
            f"root, or enable unprivileged user namespaces (sysctl "
            f"kernel.unprivileged_userns_clone=1), or accept the risk with the adapter option "
            f'sandbox_network = "optional"'
        )
    if not isinstance(last, dict) or not isinstance(last.get("results"), list):
        return Outcome(None, "crashed", f"exit {returncode}, no result line")
    return Outcome(last["results"], str(last.get("status")), str(last.get("detail", ""))[:200])
