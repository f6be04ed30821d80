"""``echo-rl token create``, ``echo-rl workers`` and ``echo-rl worker ban``: the operator's side
of who may join.

``token create`` and ``worker ban`` edit files in ``<run>/security/`` (``echo_rl.core.security``); a
running learner re-reads them within half a second, so a new token works at once and a ban ends
the key's live session at its next message. ``workers`` lists what the run folder records about
each worker (``echo_rl.control.roster``), with the live learner's view when it answers; ``worker ban``
takes a worker id, a fingerprint or a full key. Keys are printed shell-quoted: Z85 has ``&``,
``>`` and ``]``, which cut an unquoted command short.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from echo_rl.control.roster import Roster

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> float:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", text)
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"--expires {text!r}: write a positive duration like 90m, 24h or 7d")
    return float(m.group(1)) * _UNITS[m.group(2) or "s"]


def _run_dir(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--run-dir",
        type=Path,
        required=True,
        help="the learner's run folder (where learner.json and security/ live)",
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="echo-rl", description="who may join a run")
    sub = p.add_subparsers(dest="what", required=True)
    tok = sub.add_parser("token", help="join tokens").add_subparsers(dest="action", required=True)
    create = tok.add_parser("create", help="make a join token (printed once; stored hashed)")
    _run_dir(create)
    create.add_argument("--uses", type=int, default=1, help="how many keys may redeem it")
    create.add_argument("--expires", default="24h", help="lifetime, e.g. 90m, 24h, 7d")
    create.add_argument("--note", default="", help="a label kept with it (who it is for)")
    ls = sub.add_parser(
        "workers",
        help="every worker the run knows: id, fingerprint, state, "
        "NAT, parent and role in the relay tree, transport, measured link rates, "
        "accepted work, strikes, key (shell-quoted)",
    )
    _run_dir(ls)
    ls.add_argument("--json", action="store_true", help="one JSON object per worker, all fields")
    ls.add_argument(
        "--offline",
        action="store_true",
        help="read the run folder only (do not ask the running learner)",
    )
    wk = sub.add_parser("worker", help="workers").add_subparsers(dest="action", required=True)
    ban = wk.add_parser("ban", help="ban a worker: refused at once, live session ended")
    _run_dir(ban)
    ban.add_argument(
        "key",
        metavar="WORKER",
        help="its worker id, fingerprint (10 hex digits) or public key (40 "
        "characters, in single quotes: Z85 has & > ]), as `echo-rl workers` shows",
    )
    ban.add_argument("--reason", default="banned by the operator")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    from echo_rl.control.gate import security_dir
    from echo_rl.control.roster import RosterError, load_roster
    from echo_rl.core.security import KeyList, SecurityError, TokenStore

    d = security_dir(args.run_dir)
    try:
        if args.what == "workers":
            if not args.run_dir.is_dir():
                raise ValueError(f"{args.run_dir} is not a folder: pass the learner's --run-dir")
            return _list_workers(load_roster(args.run_dir, live=not args.offline), args.json)
        if args.what == "token":
            token = TokenStore(d / "tokens.json").create(
                args.uses, parse_duration(args.expires), args.note
            )
            print(token)
            info = args.run_dir / "learner.json"
            if info.is_file():
                join = json.loads(info.read_text()).get("join", "")
                print(
                    f"workers join with: echo-worker join '{join}?token={token}'", file=sys.stderr
                )
            return 0
        who = load_roster(args.run_dir, live=False).find(args.key)
        KeyList(d / "bans.txt").add(who.key, args.reason)
        print(
            f"banned {who.worker_id or 'key'} (fingerprint {who.fingerprint}, key "
            f"{shlex.quote(who.key)})",
            file=sys.stderr,
        )
        return 0
    except (SecurityError, RosterError, ValueError) as err:
        print(f"echo-rl: {err}", file=sys.stderr)
        return 2


COLUMNS = (
    "worker_id",
    "fingerprint",
    "state",
    "nat",
    "parent",
    "role",
    "transport",
    "links",
    "accepted",
    "strikes",
    "key",
)
HEADERS = (
    "ID",
    "FINGERPRINT",
    "STATE",
    "NAT",
    "PARENT",
    "ROLE",
    "TRANSPORT",
    "MBIT_DOWN/UP",
    "ACCEPTED",
    "STRIKES",
    "KEY",
)


def _cell(name: str, value: object) -> str:
    if value in (None, ""):
        return "-"
    return shlex.quote(str(value)) if name == "key" else str(value)


def _list_workers(roster: Roster, as_json: bool) -> int:
    """The table (or JSON lines) on stdout; where the figures come from on stderr."""
    if as_json:
        for e in roster.entries:
            print(json.dumps(e.as_dict()))
    elif roster.entries:
        rows = [HEADERS] + [tuple(_cell(c, getattr(e, c)) for c in COLUMNS) for e in roster.entries]
        widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS) - 1)]
        for r in rows:
            print("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1])
    source = (
        f"live from the learner at {roster.live_url}"
        if roster.live_url
        else "from the run folder only"
    )
    print(f"{len(roster.entries)} worker(s) in {roster.run_dir}, states {source}", file=sys.stderr)
    for note in roster.notes:
        print(f"  note: {note}", file=sys.stderr)
    if roster.entries:
        print(
            f"ban one with: echo-rl worker ban ID --run-dir {shlex.quote(str(roster.run_dir))} "
            f"(an id, a fingerprint or the quoted key)",
            file=sys.stderr,
        )
    return 0
