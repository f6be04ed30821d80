"""Every worker a run knows, from what its run folder records (and, read-only, its live
learner): for ``echo-rl workers`` and for ``echo-rl worker ban`` by id or fingerprint.

Sources, all written by the learner:
  * ``fleet.json`` (``echo_rl.control.fleet``, rewritten every 2 s and at shutdown): each worker id's
    key and books (price, accepted, refused), and the provisioner's memory by key (measured
    throughput, active or not);
  * ``security/quarantine.jsonl``: quarantined workers (id, key, reason);
  * ``security/audits.jsonl``: every check, ok or not (a failed one is a strike);
  * ``security/bans.txt`` and ``security/tokens.json``: banned keys (with why), keys that
    redeemed a token (they joined, though perhaps before fleet.json names them);
  * the learner's ``/api/state`` (its URL in ``learner.json``), when it answers: each worker's
    state, NAT class, transport, measured link rates and strikes as the learner counts them now,
    and its parent and role in the current relay tree (``echo_rl.core.tree.RelayTree``, validated).
Nothing here writes; a missing or damaged file is skipped (the roster says so).
"""

from __future__ import annotations

import json
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

from echo_rl.control.fleet import FLEET_FILE
from echo_rl.core.errors import EchoError
from echo_rl.core.jsontypes import JsonObject, JsonValue

LIVE_TIMEOUT_S = 2.0
KEY_LEN = 40


class RosterError(EchoError, ValueError):
    """A worker named ambiguously or not at all; the message says what to do."""

    default_reason = "roster"


def fingerprint(key: str) -> str:
    from echo_rl.core.security import fingerprint as fp  # pyzmq: late, so --help stays instant

    return fp(key)


@dataclass
class Entry:
    worker_id: str  # "" when only the key is known (a token redeemed, a ban)
    key: str  # "" when the run folder does not record it
    fingerprint: str = ""
    state: str = (
        "unknown"  # live: standby | active | left; else from the files; banned, quarantined
    )
    nat: str = ""
    transport: str = ""
    price: float | None = None
    accepted: int | None = None
    rejected: int | None = None
    strikes: int | None = None
    throughput: float | None = None  # trajectories/s the learner measured
    down_mbit: float | None = None
    up_mbit: float | None = None
    parent: str = ""  # live: "learner" or a worker id, in the current version's relay tree
    role: str = ""  # live: head | relay | tail | unplaced
    note: str = ""  # why banned or quarantined

    @property
    def links(self) -> str:
        """Measured down/up Mbit/s, "" until measured (the learner's books say 0 then)."""
        if not self.down_mbit and not self.up_mbit:
            return ""
        return f"{self.down_mbit or 0:.0f}/{self.up_mbit or 0:.0f}"

    def as_dict(self) -> dict[str, str | float | int | None]:
        row: dict[str, str | float | int | None] = asdict(self)
        return row


@dataclass
class Roster:
    run_dir: Path
    entries: list[Entry] = field(default_factory=list)
    live_url: str = ""  # the learner's metrics URL, when it answered
    notes: list[str] = field(default_factory=list)  # files skipped, learner not answering

    def find(self, text: str) -> Entry:
        """The one worker ``text`` names: a worker id, a fingerprint or a full key."""
        text = text.strip()
        by_key = {e.key: e for e in self.entries if e.key}
        if len(text) == KEY_LEN:
            return by_key.get(text) or Entry("", text, fingerprint(text))
        hits = {
            e.key or f"id:{e.worker_id}": e
            for e in self.entries
            if text in (e.worker_id, e.fingerprint)
        }
        if len(hits) == 1:
            hit = next(iter(hits.values()))
            if not hit.key:
                raise RosterError(
                    f"worker {text!r} is known to {self.run_dir} but its key is not "
                    f"recorded yet (fleet.json is written every 2 s while the "
                    f"learner runs): try again, or pass the full key, quoted"
                )
            return hit
        if hits:
            names = ", ".join(
                sorted(f"{e.worker_id or '-'} (fingerprint {e.fingerprint})" for e in hits.values())
            )
            raise RosterError(
                f"{text!r} names {len(hits)} workers in {self.run_dir}: {names}; "
                f"pass the full key instead, quoted ('KEY')"
            )
        known = ", ".join(sorted({e.worker_id for e in self.entries if e.worker_id})[:8])
        raise RosterError(
            f"no worker with id or fingerprint {text!r} in {self.run_dir}"
            + (
                f" (ids: {known}{', ...' if len(self.entries) > 8 else ''})"
                if known
                else " (it records no workers yet)"
            )
            + f"; `echo-rl workers --run-dir {self.run_dir}` lists them, or pass "
            f"the full key (40 characters, quoted)"
        )


def load_roster(run_dir: Path, live: bool = True) -> Roster:
    run_dir = Path(run_dir)
    roster = Roster(run_dir)
    sec = run_dir / "security"
    rows: dict[str, Entry] = {}  # worker id (or "key:" + key) -> entry
    memory = _fleet(run_dir, rows, roster.notes)
    _quarantine(sec / "quarantine.jsonl", rows, roster.notes)
    by_key = {e.key: e for e in rows.values() if e.key}
    for key in _token_keys(sec / "tokens.json", roster.notes):
        if key not in by_key:
            by_key[key] = rows[f"key:{key}"] = Entry("", key)
    bans = _bans(sec / "bans.txt")
    for key in bans:
        if key not in by_key:
            by_key[key] = rows[f"key:{key}"] = Entry("", key)
    strikes = _strikes(sec / "audits.jsonl")
    for e in rows.values():
        e.fingerprint = e.fingerprint or (fingerprint(e.key) if e.key else "")
        if e.worker_id in strikes:
            e.strikes = strikes[e.worker_id]
        mem = memory.get(e.key) if e.key else None
        if isinstance(mem, dict):
            mu = mem.get("mu")
            e.throughput = float(mu) if isinstance(mu, (int, float)) and mu else e.throughput
    if live:
        roster.live_url = _live(run_dir, rows, roster.notes)
    for e in rows.values():
        if e.key in bans and e.state != "quarantined":
            e.state, e.note = "banned", bans[e.key]
    roster.entries = sorted(rows.values(), key=lambda e: (not e.worker_id, e.worker_id, e.key))
    return roster


# ------------------------------------------------------------------ the files


def _read_json(path: Path, notes: list[str]) -> JsonValue:
    if not path.exists():
        return None
    try:
        doc: JsonValue = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        notes.append(f"{path} skipped: unreadable ({exc})")
        return None
    return doc


def _fleet(run_dir: Path, rows: dict[str, Entry], notes: list[str]) -> JsonObject:
    """Entries from fleet.json's accounts; returns the provisioner's memory by key."""
    doc = _read_json(run_dir / FLEET_FILE, notes)
    if not isinstance(doc, dict):
        return {}
    accounts = doc.get("accounts")
    for wid, book in accounts.items() if isinstance(accounts, dict) else []:
        key = book.get("key") if isinstance(book, dict) else None
        if not isinstance(book, dict) or not isinstance(key, str):
            continue
        rejected = book.get("rejected")
        rows[str(wid)] = Entry(
            str(wid),
            key,
            price=_num(book.get("price")),
            accepted=_int(book.get("accepted")),
            rejected=(
                sum(v for v in rejected.values() if isinstance(v, int))
                if isinstance(rejected, dict)
                else None
            ),
        )
    memory = doc.get("controller")
    return memory if isinstance(memory, dict) else {}


def _quarantine(path: Path, rows: dict[str, Entry], notes: list[str]) -> None:
    for row in _jsonl(path):
        wid, key = str(row.get("worker_id", "")), row.get("key")
        if not wid:
            continue
        e = rows.get(wid)
        if e is None or (isinstance(key, str) and key and e.key and e.key != key):
            # an id re-used by another key after the quarantine: both stay listed
            e = rows[wid if e is None else f"{wid} ({key})"] = Entry(wid, "")
        if isinstance(key, str) and key and not e.key:
            e.key = key
        e.state, e.note = "quarantined", str(row.get("reason", ""))


def _token_keys(path: Path, notes: list[str]) -> list[str]:
    doc = _read_json(path, notes)
    tokens = doc.get("tokens") if isinstance(doc, dict) else None
    keys: list[str] = []
    for entry in tokens.values() if isinstance(tokens, dict) else []:
        listed = entry.get("keys") if isinstance(entry, dict) else None
        if isinstance(listed, list):
            keys += [k for k in listed if isinstance(k, str) and len(k) == KEY_LEN]
    return keys


def _bans(path: Path) -> dict[str, str]:
    from echo_rl.core.security import KeyList  # the learner's own reading of the file

    return KeyList(path).notes


def _strikes(path: Path) -> dict[str, int]:
    """Failed checks per worker id (a line per check; only the failed ones are parsed)."""
    out: dict[str, int] = {}
    if not path.exists():
        return out
    with path.open() as f:
        for line in f:
            if '"ok": false' not in line:
                continue
            try:
                wid = str(json.loads(line)["worker_id"])
            except (ValueError, KeyError, TypeError):
                continue  # a torn last line
            out[wid] = out.get(wid, 0) + 1
    return out


def _jsonl(path: Path) -> list[JsonObject]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            row: JsonValue = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            out.append(row)
    return out


# ------------------------------------------------------------------ the live learner


def _live(run_dir: Path, rows: dict[str, Entry], notes: list[str]) -> str:
    """Fill state, NAT, transport, rates and strikes from the learner's /api/state (GET only).
    Returns its URL, or "" (with a note) when there is none or it does not answer."""
    info = _read_json(run_dir / "learner.json", notes)
    given = info.get("metrics", "") if isinstance(info, dict) else ""
    url = str(given) if given else ""
    if not url:
        notes.append("no learner metrics URL in learner.json: states are from the run folder")
        return ""
    try:
        with urllib.request.urlopen(f"{url}/api/state", timeout=LIVE_TIMEOUT_S) as resp:
            state = json.loads(resp.read())
    except (OSError, ValueError) as exc:
        notes.append(
            f"the learner at {url} did not answer ({exc}): states are from the run "
            f"folder, as of its last save"
        )
        return ""
    for a in _rows(state, "accounts"):
        e = rows.setdefault(str(a["worker"]), Entry(str(a["worker"]), ""))
        if e.state != "quarantined":  # the file's verdict outlives a restart's books
            e.state = str(a.get("state", e.state))
        e.nat = str(a.get("nat", "")) if a.get("nat") not in (None, "unknown") else e.nat
        e.accepted = _int(a.get("accepted"), e.accepted)
        rejected = a.get("rejected")
        if isinstance(rejected, dict):
            e.rejected = sum(v for v in rejected.values() if isinstance(v, int))
        e.strikes = _int(a.get("check_failures"), e.strikes)
        e.throughput = _num(a.get("throughput")) or e.throughput
        e.down_mbit, e.up_mbit = _num(a.get("down_mbit")), _num(a.get("up_mbit"))
        e.price = _num(a.get("price"), e.price)
    for w in _rows(state, "workers"):
        entry = rows.get(str(w["worker"]))
        if entry is not None:
            entry.transport = str(w.get("transport", ""))
            nat = str(w["nat"]) if w.get("nat") not in (None, "unknown") else ""
            entry.nat = entry.nat or nat
    _tree(state, rows, notes)
    return url


def _tree(state: JsonValue, rows: dict[str, Entry], notes: list[str]) -> None:
    """Parents, roles and transports from the served relay tree (absent from an older
    learner): all three from the one plan, so they cannot disagree (issue 55: the workers
    list's transport, read apart from the tree, said "punched" beside PARENT learner, ROLE
    head in 23 of 30 polls)."""
    raw = state.get("tree") if isinstance(state, dict) else None
    if raw is None:
        return
    from pydantic import ValidationError

    from echo_rl.core.tree import RelayTree

    try:
        tree = RelayTree.model_validate(raw)
    except ValidationError as exc:
        notes.append(
            f"the learner's relay tree did not validate ({exc.error_count()} errors): "
            f"no parents shown"
        )
        return
    for n in tree.nodes:
        e = rows.get(n.worker)
        if e is not None:
            e.parent, e.role, e.transport = n.parent or "", n.role, n.transport


def _rows(state: JsonValue, name: str) -> list[JsonObject]:
    rows = state.get(name) if isinstance(state, dict) else None
    listed = rows if isinstance(rows, list) else []
    return [r for r in listed if isinstance(r, dict) and r.get("worker") is not None]


def _num(v: JsonValue, default: float | None = None) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else default


def _int(v: JsonValue, default: int | None = None) -> int | None:
    return int(v) if isinstance(v, int) and not isinstance(v, bool) else default
