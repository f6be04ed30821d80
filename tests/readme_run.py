"""README "Running for real", taken from README.md and run as written on hosts of a NAT lab
(tests/test_readme_real.py; issue 30, item 7).

``block`` cuts the section's first ``bash`` block into commands (continuations joined, comments
cut, each with the README line it starts on); ``steps`` names what each one is, and refuses a
command it does not know and a block that lacks one it needs, so a README that gains, loses or
changes a command fails here, naming the line. ``Hosts`` runs a command on one host of the lab
(``ip netns exec``, its own HOME and working folder); ``Step.argv`` is the command with only
the operator's placeholders put in: HOST, the learner key, TOKEN, PUBLIC_IP, the id to ban, and
the model (the README's is a 0.6B model on the operator's disk; the test runs the tiny one).
A command that fails raises ``ReadmeStepError`` with its README line and its output.
"""

from __future__ import annotations

import re
import shlex
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from echo_rl.core.procs import READY_PREFIX, ProcessGroup

SECTION = "## Running for real"

# What each command of the block is, by its first words; the first match wins.
KINDS = (
    (("echo-rl", "learn"), "--resume", "resume"),
    (("echo-rl", "learn"), "", "learn"),
    (("echo-rl", "token", "create"), "", "token"),
    (("echo-rl", "doctor"), "", "rl_doctor"),
    (("echo-worker", "doctor"), "", "worker_doctor"),
    (("echo-worker", "join"), "--relay-host", "join_public"),
    (("echo-worker", "join"), "", "join_home"),
    (("echo-worker", "status"), "", "status"),
    (("echo-rl", "workers"), "", "workers"),
    (("echo-rl", "worker", "ban"), "", "ban"),
    (("torchrun",), "", "torchrun"),
)
NEEDED = (
    "learn",
    "token",
    "rl_doctor",
    "worker_doctor",
    "join_public",
    "join_home",
    "status",
    "workers",
    "ban",
)


class ReadmeError(AssertionError):
    """The README's block cannot be run as this test reads it; the message names the line."""


class ReadmeStepError(AssertionError):
    """A README command failed on its host; the message has the line, the host and the output."""


@dataclass(frozen=True)
class Step:
    line: int  # README.md line the command starts on
    text: str  # as written (continuations joined, comment kept)
    words: tuple[str, ...]  # shell words, comment cut
    kind: str

    def where(self) -> str:
        return f"README.md line {self.line}: {self.text.strip()}"


def block(readme: str) -> list[tuple[int, str, list[str]]]:
    """(line, text, words) for every command of the section's first bash block."""
    before, sep, rest = readme.partition(SECTION)
    if not sep:
        raise ReadmeError(f"README.md has no {SECTION!r} section")
    fence = rest.find("```bash")
    end = rest.find("```", fence + 7)
    if fence < 0 or end < 0:
        raise ReadmeError(f"README.md {SECTION!r} has no ```bash block")
    first = before.count("\n") + rest[:fence].count("\n") + 2  # the line after the fence
    out, pending, start = [], "", 0
    for i, raw in enumerate(rest[fence:end].splitlines()[1:]):
        if not pending:
            start = first + i
        pending += raw
        if pending.rstrip().endswith("\\"):
            pending = pending.rstrip()[:-1] + " "
            continue
        text, pending = pending, ""
        try:
            words = shlex.split(text, comments=True)
        except ValueError as exc:
            raise ReadmeError(
                f"README.md line {start}: {text.strip()}: not shell words ({exc})"
            ) from None
        if words:
            out.append((start, text, words))
    return out


def steps(readme: str) -> list[Step]:
    """The block's commands, each named; unknown commands and missing ones are errors."""
    out = []
    for line, text, words in block(readme):
        kind = next(
            (
                k
                for head, flag, k in KINDS
                if tuple(words[: len(head)]) == head and (not flag or flag in words)
            ),
            None,
        )
        if kind is None:
            raise ReadmeError(
                f"README.md line {line}: {text.strip()}: a command this test does "
                f"not know; say in tests/readme_run.py (KINDS) where it runs and "
                f"what it must do"
            )
        out.append(Step(line, text, tuple(words), kind))
    missing = [k for k in NEEDED if k not in {s.kind for s in out}]
    if missing:
        raise ReadmeError(
            f"README.md {SECTION!r} lacks a command for: {', '.join(missing)} "
            f"(commands found: {[' '.join(s.words[:3]) for s in out]})"
        )
    return out


def said(readme: str, lead: str) -> str:
    """What a comment of the block says after ``lead`` (to the end of its line), or ''."""
    m = re.search(re.escape(lead) + r"\s*(.+)", readme.partition(SECTION)[2].split("```")[1])
    return m.group(1).strip() if m else ""


def one(all_steps: list[Step], kind: str) -> Step:
    return next(s for s in all_steps if s.kind == kind)


@dataclass
class Placeholders:
    """The operator's values for the README's placeholders (empty until known)."""

    host: str
    public_ip: str
    model: str
    learner_key: str = ""
    token: str = ""
    ban: str = ""
    extra_sets: tuple[str, ...] = ()  # sizing for a 2-core test, appended to `echo-rl learn`

    def argv(self, step: Step) -> list[str]:
        words = [self.fill(w) for w in step.words]
        if step.kind == "ban" and self.ban:
            words[3] = self.ban  # the README's example id
        if step.kind == "learn":
            words = [re.sub(r"^model\.name=.*", f"model.name={self.model}", w) for w in words]
            words += [a for s in self.extra_sets for a in ("--set", s)]
        return words

    def fill(self, word: str) -> str:
        for name, value in (
            ("<learner key>", self.learner_key),
            ("TOKEN", self.token),
            ("PUBLIC_IP", self.public_ip),
            ("HOST", self.host),
        ):
            if value:
                word = word.replace(name, value)
        return word


@dataclass
class Host:
    name: str
    ns: str
    folder: Path

    def env(self, venv_bin: Path) -> list[str]:
        home = self.folder / "home"
        home.mkdir(parents=True, exist_ok=True)
        # a host of its own: nothing of the test's environment (ECHO_STATUS_DIR, ...) leaks in
        return [
            "env",
            "-i",
            "-C",
            str(self.folder),
            f"HOME={home}",
            "LANG=C.UTF-8",
            f"PATH={venv_bin}:/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin",
            "PYTHONUNBUFFERED=1",
        ]


@dataclass
class Hosts:
    """Runs README commands on the lab's hosts; every process it starts, it stops by pid."""

    venv_bin: Path
    group: ProcessGroup = field(default_factory=ProcessGroup)
    log: list[str] = field(default_factory=list)  # every command run, for the failure message

    def argv(self, host: Host, words: list[str]) -> list[str]:
        return ["ip", "netns", "exec", host.ns, *host.env(self.venv_bin), *words]

    def run(
        self,
        host: Host,
        step: Step,
        words: list[str],
        *,
        expect: int | None = 0,
        timeout: float = 90,
    ) -> subprocess.CompletedProcess:
        self.log.append(f"[{host.name}] {shlex.join(words)}")
        try:
            done = subprocess.run(
                self.argv(host, words), capture_output=True, text=True, timeout=timeout, check=False
            )
        except subprocess.TimeoutExpired as exc:
            raise ReadmeStepError(
                f"{step.where()}\n  on {host.name}: {shlex.join(words)}\n  "
                f"still running after {timeout:g} s\n{exc.stdout or ''}"
            ) from None
        if expect is not None and done.returncode != expect:
            raise ReadmeStepError(
                f"{step.where()}\n  on {host.name}: {shlex.join(words)}\n  "
                f"exit {done.returncode} (expected {expect})\n--- stdout\n"
                f"{done.stdout[-3000:]}\n--- stderr\n{done.stderr[-3000:]}"
            )
        return done

    def start(self, host: Host, step: Step, words: list[str], name: str) -> subprocess.Popen:
        self.log.append(f"[{host.name}] {shlex.join(words)} &")
        log = host.folder / f"{name}.log"
        proc = self.group.start(name, self.argv(host, words), log)
        proc.readme_step, proc.log_path = step, log  # type: ignore[attr-defined]
        return proc

    def alive(self, name: str) -> None:
        proc = self.group.procs[name]
        if proc.poll() is not None:
            raise ReadmeStepError(
                f"{proc.readme_step.where()}\n  exited {proc.returncode}; its "
                f"log ends:\n{tail(proc.log_path)}"
            )

    def stop(self, name: str, timeout: float = 20.0) -> int | None:
        return self.group.stop(name, timeout, signal.SIGTERM)

    def stop_all(self) -> None:
        self.group.stop_all(timeout=10.0)


def tail(path: Path, n: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return "(no log)"


def wait_for(what: str, check, timeout: float, every: float = 1.0, alive=()):
    """Poll ``check()`` until it returns something true; ``alive``: callables that raise when
    a process they watch has died (its README line is then the error)."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        for a in alive:
            a()
        last = check()
        if last:
            return last
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}; last seen: {last!r}")


def ready_line(log: Path) -> str:
    """The address the learner printed after READY_PREFIX, or ''."""
    for line in tail(log, 1 << 20).splitlines():
        if line.startswith(READY_PREFIX):
            return line[len(READY_PREFIX) :].strip()
    return ""
