"""What a volunteer sees of their worker: the learner's books on it, and its own state.

The figures that matter to a volunteer (records accepted, refused and why, checks, earnings,
the rates the learner measured, the learner's last message) are the learner's accounting
(``echo_rl.control.accounts``), delivered in every heartbeat acknowledgement and, at the end, in the
``farewell`` or ``shutdown`` message: the worker shows them as told, never its own estimate.
Beside them it shows what only it knows: what it is doing now, the snapshot it installed and
how long that took, the groups it generated.

Three ways to look (docs/volunteers.md):
  * a live view on a terminal (``rich``), refreshed every second;
  * without a terminal, one plain line per minute in the log;
  * a status file, JSON, replaced atomically (written beside, then renamed) at most once a
    second when something changed: ``echo-worker status`` reads it, for workers run as a
    service. Its ``schema`` field versions the layout.
On exit the worker prints a summary table of the final account.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from echo_rl.core import wire
from echo_rl.core.jsontypes import JsonObject

if TYPE_CHECKING:
    from rich.console import Console
    from rich.live import Live
    from rich.table import Table

STATUS_SCHEMA = 1
PLAIN_EVERY_S = 60.0
STATUS_ENV = "ECHO_STATUS_DIR"


def default_status_dir() -> Path:
    """``$ECHO_STATUS_DIR``, else ``~/.local/state/echo/workers``."""
    env = os.environ.get(STATUS_ENV)
    return Path(env) if env else Path.home() / ".local" / "state" / "echo" / "workers"


class FirstInstall(BaseModel):
    """The first install's figures (``InstallProgress.installed``), seconds."""

    model_config = ConfigDict(extra="ignore")
    since_start_s: float  # from the worker's start
    since_join_s: float  # from its join
    model_s: float  # the model's load, after the join
    snapshot_s: float  # the snapshot's arrival, after the join


class Sharing(BaseModel):
    """This run's part of the worker's device (echo_rl/worker/sharing.py); alone, ``runs`` is 1."""

    runs: int  # runs the device serves
    share: float  # this run's fraction of the device-seconds used so far
    device_s: float  # device-seconds this run used
    switches: int  # times its model had to come back onto the device
    idle_fraction: float  # of the device, all runs together


class WorkerStatus(BaseModel):
    """The status file, schema ``STATUS_SCHEMA``: one declared type for the worker that
    writes it and ``echo-worker status``, the owner tools and the drills that read it.
    A renamed or mistyped field fails at assignment on the worker, not as a blank line in a
    reader. Fields after ``first_install`` are written once the worker has them (absent
    before). A field this version does not know is ignored on reading; a change of meaning
    or a removal bumps ``STATUS_SCHEMA``."""

    model_config = ConfigDict(extra="ignore", validate_assignment=True)
    schema_: int = Field(STATUS_SCHEMA, alias="schema")  # the layout's version
    # The worker writes every field down to first_install from its start; the defaults are
    # for reading a file written by hand or cut short.
    worker_id: str | None = None  # None until the learner confirms it
    learner: str = ""  # the endpoint joined
    pid: int = 0
    price_per_hour: float = 0.0  # $/h, as declared
    started_at: float = 0.0  # Unix time
    updated_at: float = 0.0  # Unix time of the last write
    activity: str = "starting"  # what the worker does (starting, generating, installing, ...)
    installed_version: int = -1  # -1: none yet
    installed_at: float | None = None  # Unix time of that install
    install_s: float | None = None  # s the install took
    groups_generated: int = 0
    samples_generated: int = 0
    exit: str | None = None  # why the worker stopped
    account: wire.Account | None = None  # the learner's books, as last told
    account_at: float | None = None  # Unix time they were told (None: a file from before)
    problem: str | None = None  # what keeps it from working now, in words
    install_phase: str | None = None  # what the first install waits on, in words
    first_install: FirstInstall | None = None
    run_id: str | None = None
    tokens_sampled: int | None = None  # tokens the backend sampled so far
    tokens_sent: int | None = None  # tokens delivered so far
    handed_back_tokens: int | None = None  # tokens of work handed back (docs/preemption.md)
    tail_groups: int | None = None  # groups the long-tail cut carried on (docs/scheduling.md)
    yielded_at: float | None = None  # Unix time the owner's notice came
    yield_stop_s: float | None = None  # s from that notice until generation stopped
    base_model: str | None = None  # a LoRA run's base model, and where it came from
    base_origin: str | None = None
    base_fetched_bytes: int | None = None
    memory: dict[str, int] | None = None  # bytes by use (docs/memory.md)
    sharing: Sharing | None = None  # joined to several runs (docs/multirun.md)

    def to_json(self) -> JsonObject:
        """The file's JSON: what was set (the fields a worker has not reached stay absent)."""
        return self.model_dump(mode="json", by_alias=True, exclude_unset=True)


class StatusBoard:
    """The worker's status: updated by the worker, shown and written from here."""

    def __init__(self, worker_id: str, learner: str, price: float, path: Path | None):
        self.path = path
        now = time.time()
        self.doc = WorkerStatus(
            schema=STATUS_SCHEMA,
            worker_id=worker_id,
            learner=learner,
            pid=os.getpid(),
            price_per_hour=price,
            started_at=now,
            updated_at=now,
            activity="starting",
            installed_version=-1,
            installed_at=None,
            install_s=None,
            groups_generated=0,
            samples_generated=0,
            exit=None,
            account=None,
            problem=None,
            install_phase=None,
            first_install=None,
        )
        self._dirty = True
        self._written = 0.0

    # ------------------------------------------------------------------ updates (the worker)

    def update(self, **fields: object) -> None:
        """Set fields of the status by name (validated: an unknown or mistyped one raises). New
        books are stamped with the time they came (their message's age counts on from it)."""
        if "account" in fields:
            fields.setdefault("account_at", time.time())
        for name, value in fields.items():
            setattr(self.doc, name, value)
        self._dirty = True

    def account(self, account: wire.Account | None) -> None:
        """The learner's books, as received."""
        if account is not None:
            self.update(account=account)

    def generated(self, groups: int, samples: int) -> None:
        self.update(
            groups_generated=self.doc.groups_generated + groups,
            samples_generated=self.doc.samples_generated + samples,
        )

    # ------------------------------------------------------------------ the file

    def flush(self, force: bool = False) -> bool:
        """Write the status file when something changed (at most once a second unless
        ``force``). Returns whether it wrote."""
        now = time.time()
        if self.path is None or not self._dirty or (not force and now - self._written < 1.0):
            return False
        self.doc.updated_at = now
        write_atomic(self.path, self.doc.to_json())
        self._dirty, self._written = False, now
        return True


class InstallProgress:
    """The first install's phases on the worker's clock: joined, model loaded, snapshot
    received, installed. While they last the status says which one it waits on and for how
    long; after, how long each took (``first_install``)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.started_at = clock()
        self.joined_at: float | None = None
        self.loaded_at: float | None = None
        self.received_at: float | None = None
        self.done = False

    def joined(self) -> None:
        if self.joined_at is None:
            self.joined_at = self.clock()

    def loaded(self) -> None:
        self.loaded_at = self.clock()

    def received(self) -> None:
        if self.received_at is None:
            self.received_at = self.clock()

    def phase(self, fetching: tuple[int, int, int] | None) -> str | None:
        """What the first install waits on, in words (None before the join and after it)."""
        if self.joined_at is None or self.done:
            return None
        now = self.clock()
        model = (
            "loading the model"
            if self.loaded_at is None
            else f"model loaded in {self.loaded_at - self.joined_at:.1f} s"
        )
        if self.received_at is not None:
            snap = "snapshot received, installing"
        elif fetching is not None:
            snap = f"fetching snapshot v{fetching[0]}: {fetching[1]}/{fetching[2]} chunks"
        else:
            snap = "waiting for the learner's snapshot"
        return f"{model}; {snap} ({now - self.joined_at:.0f} s since joining)"

    def installed(self) -> dict[str, float] | None:
        """The first install's figures, once (None after): seconds from the start and from
        the join, the model's load and the snapshot's arrival after the join."""
        if self.done or self.joined_at is None:
            return None
        self.done = True
        now, j = self.clock(), self.joined_at
        return {
            "since_start_s": round(now - self.started_at, 3),
            "since_join_s": round(now - j, 3),
            "model_s": round((self.loaded_at or now) - j, 3),
            "snapshot_s": round((self.received_at or now) - j, 3),
        }


def exit_text(exc: BaseException) -> str:
    """What a status file's ``exit`` says of the failure that ended a run: its first cause."""
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return str(exc)


def notice_path(status: Path) -> Path:
    """Where ``echo-worker preempt`` leaves a preemption notice for the worker of ``status``."""
    return status.with_name(status.name + ".preempt")


def write_atomic(path: Path, doc: JsonObject) -> None:
    """Readers see the old file or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, indent=1, allow_nan=False)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_status(path: Path) -> WorkerStatus:
    """A status file, checked enough to show it; ValueError says what is wrong with it."""
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(
            f"no status file at {path}: is the worker running with --status-file {path}?"
        ) from None
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} is not a worker status file ({exc})") from None
    if not isinstance(doc, dict) or doc.get("schema") != STATUS_SCHEMA:
        raise ValueError(
            f"{path}: status schema {doc.get('schema') if isinstance(doc, dict) else '?'}"
            f", this echo-worker reads {STATUS_SCHEMA}: use the same version as the worker"
        )
    try:
        return WorkerStatus.model_validate(doc)
    except ValidationError as exc:
        raise ValueError(
            f"{path} is not a worker status file of schema {STATUS_SCHEMA} "
            f"({exc.error_count()} bad field(s): {exc.errors()[0]['loc']})"
        ) from None


def latest_status(folder: Path) -> Path:
    files = (
        sorted(folder.glob("*.json"), key=lambda p: p.stat().st_mtime) if folder.is_dir() else []
    )
    if not files:
        raise ValueError(
            f"no worker status file in {folder}: start a worker (echo-worker join), "
            f"or pass the file it writes (--status-file)"
        )
    return files[-1]


# ------------------------------------------------------------------ showing it


def state_of(doc: WorkerStatus) -> str:
    """standby, active, quarantined or left (the learner's word), with what the worker does:
    "installing" until the first snapshot is in the model (loading the model, fetching and
    rebuilding the snapshot), whatever the worker's loop says meanwhile."""
    state = doc.account.state if doc.account else "joining"
    if doc.exit:
        return f"{state}, exited"
    if state not in ("standby", "active"):
        return state
    activity = doc.activity
    if doc.installed_version < 0 and activity != "yielded":
        activity = "installing (model and first snapshot)"
    return f"{state} · {activity}"


def _money(x: float) -> str:
    return f"${x:.6f}"


def ago(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s ago"
    return f"{seconds / 60:.0f} min ago" if seconds < 7200 else f"{seconds / 3600:.1f} h ago"


def since_told(doc: WorkerStatus, now: float | None = None) -> float:
    """Seconds since the learner's books came (a file without that time: since the file was
    last written, which for an exited worker is its exit); 0 for a file without a time."""
    at = doc.account_at or doc.updated_at
    if at <= 0:
        return 0.0
    return max(0.0, (time.time() if now is None else now) - at)


def rows(doc: WorkerStatus, now: float | None = None) -> list[tuple[str, str]]:
    """The figures, as (name, value) rows: the live view, the summary and ``status`` show these.
    ``now`` (Unix time; default the clock's): the learner's message is as old as the learner
    said when it came, plus the time since it came (an exited worker's: since its exit)."""
    a = doc.account
    out = [("state", state_of(doc)), ("worker", str(doc.worker_id)), ("learner", str(doc.learner))]
    if doc.problem and not doc.exit:
        out.append(("problem", str(doc.problem)))
    out += [
        ("installed snapshot", _installed(doc)),
        ("groups generated", f"{doc.groups_generated} ({doc.samples_generated} samples)"),
    ]
    if doc.tail_groups:  # worker.tail_cut is on
        out.append(("tail cuts", f"{doc.tail_groups} groups carried into a next rollout"))
    if a is None:
        return out + [("learner's books", "none yet (they come with the first heartbeat reply)")]
    out += [
        ("groups granted", str(a.granted)),
        ("records accepted", str(a.accepted)),
        ("records rejected", str(sum(a.rejected.values()))),
    ]
    out += [(f"  rejected: {reason}", str(n)) for reason, n in sorted(a.rejected.items())]
    out += [
        ("duplicates (resends)", str(a.duplicates)),
        ("checks / failed", f"{a.checks} / {a.check_failures}"),
        ("throughput (learner)", f"{a.throughput:.3f} traj/s"),
        ("links (learner)", _links(a)),
        ("NAT", str(a.nat)),
        ("active time", f"{a.active_s:.1f} s"),
        ("earned", f"{_money(a.earned_usd)} at ${a.price:.3f}/h"),
        ("learner says", f"{a.message or '-'} ({ago(a.message_age_s + since_told(doc, now))})"),
    ]
    if doc.sharing is not None and doc.sharing.runs == 1:
        out.append(("device idle", _idle(doc, doc.sharing)))
    elif doc.sharing is not None:
        sh = doc.sharing
        out.append(
            (
                "shared device",
                f"{sh.runs} runs; this run {sh.share:.0%} of the device time "
                f"({sh.device_s:.0f} s), {sh.switches} switches; device idle "
                f"{sh.idle_fraction:.0%}",
            )
        )
    if doc.exit:
        out.append(("exit", str(doc.exit)))
    return out


def _idle(doc: WorkerStatus, sh: Sharing) -> str:
    """The device's idle share; before any rollout there is none to speak of (its clock starts
    at the model's load, so a worker never given work read "86%")."""
    if not doc.groups_generated:
        return "no rollout yet"
    return f"{sh.idle_fraction:.0%} since the model loaded"


def _installed(doc: WorkerStatus) -> str:
    """The installed version and its timing; before the first install, what it waits on."""
    v = doc.installed_version
    if v < 0:
        phase = doc.install_phase
        return f"none yet: {phase}" if phase and not doc.exit else "none yet"
    inst = f"v{v}"
    if doc.install_s is not None:
        inst += f" (loaded in {doc.install_s:.2f} s"
        if doc.account and doc.account.install_s:
            inst += f"; {doc.account.install_s:.2f} s after publication"
        inst += ")"
    first = doc.first_install
    if first:
        inst += (
            f"; first install {first.since_join_s:.1f} s after joining (model "
            f"{first.model_s:.1f} s, snapshot {first.snapshot_s:.1f} s)"
        )
    return inst


def _links(a: wire.Account) -> str:
    down, up = a.down_mbit, a.up_mbit
    if not down and not up:
        return "not measured yet"

    def fmt(x: float) -> str:
        return f"{x:.1f} Mbit/s" if x else "not measured"

    return f"down {fmt(down)}, up {fmt(up)}"


def table(doc: WorkerStatus, title: str = "echo-worker") -> Table:
    from rich.table import Table

    t = Table(title=title, show_header=False, title_justify="left", expand=False)
    t.add_column("figure", style="bold")
    t.add_column("value", overflow="fold")
    for name, value in rows(doc):
        t.add_row(name, value)
    return t


def plain_line(doc: WorkerStatus) -> str:
    """One line for a log without a terminal (once a minute)."""
    a = doc.account or wire.Account(state="standby")  # zeros until the learner's books come
    rejected = sum(a.rejected.values())
    v, phase = doc.installed_version, doc.install_phase
    snapshot = f"snapshot v{v}" if v >= 0 or not phase else f"first snapshot: {phase}"
    return (
        f"status: {state_of(doc)}; {snapshot}; "
        f"groups {doc.groups_generated}; accepted {a.accepted}, "
        f"rejected {rejected}, checks {a.checks}/{a.check_failures} failed; "
        f"earned {_money(a.earned_usd)}; learner says: {a.message or '-'}"
    )


class LiveView:
    """The status as a live table on a terminal (log lines scroll above it)."""

    def __init__(self, console: Console):
        self.console = console
        self.live: Live | None = None

    def __enter__(self) -> LiveView:
        from rich.live import Live

        self.live = Live(console=self.console, refresh_per_second=2, transient=True)
        self.live.start()
        return self

    def show(self, board: StatusBoard) -> None:
        assert self.live is not None, "shown inside its with block"
        self.live.update(table(board.doc))

    def __exit__(self, *exc: object) -> None:
        assert self.live is not None
        self.live.stop()


class PlainView:
    """Without a terminal: one plain status line per minute, in the log."""

    def __init__(self, log: logging.Logger, every_s: float = PLAIN_EVERY_S):
        self.log, self.every_s, self.last = log, every_s, -float("inf")

    def __enter__(self) -> PlainView:
        return self

    def show(self, board: StatusBoard) -> None:
        now = time.monotonic()
        if board.doc.account is not None and now - self.last >= self.every_s:
            self.last = now
            self.log.info("%s", plain_line(board.doc))

    def __exit__(self, *exc: object) -> None:
        pass
