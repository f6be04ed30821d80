"""``echo-rl token create`` and ``echo-rl worker ban``: the operator's side of who may join.

Both edit files in ``<run>/security/`` (``echo.security``); a running learner re-reads them
within half a second, so a new token works at once and a ban ends the key's live session at its
next message.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> float:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", text)
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"--expires {text!r}: write a positive duration like 90m, 24h or 7d")
    return float(m.group(1)) * _UNITS[m.group(2) or "s"]


def _run_dir(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run-dir", type=Path, required=True,
                   help="the learner's run folder (where learner.json and security/ live)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="echo-rl", description="who may join a run")
    sub = p.add_subparsers(dest="what", required=True)
    tok = sub.add_parser("token", help="join tokens").add_subparsers(dest="action", required=True)
    create = tok.add_parser("create", help="make a join token (printed once; stored hashed)")
    _run_dir(create)
    create.add_argument("--uses", type=int, default=1, help="how many keys may redeem it")
    create.add_argument("--expires", default="24h", help="lifetime, e.g. 90m, 24h, 7d")
    create.add_argument("--note", default="", help="a label kept with it (who it is for)")
    wk = sub.add_parser("worker", help="workers").add_subparsers(dest="action", required=True)
    ban = wk.add_parser("ban", help="ban a worker key: refused at once, live session ended")
    _run_dir(ban)
    ban.add_argument("key", help="the worker's public key (40 characters, as in the learner's log)")
    ban.add_argument("--reason", default="banned by the operator")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    from echo.security import KeyList, SecurityError, TokenStore
    from learner.gate import security_dir

    d = security_dir(args.run_dir)
    try:
        if args.what == "token":
            token = TokenStore(d / "tokens.json").create(args.uses, parse_duration(args.expires), args.note)
            print(token)
            info = args.run_dir / "learner.json"
            if info.is_file():
                join = json.loads(info.read_text()).get("join", "")
                print(f"workers join with: echo-worker join '{join}?token={token}'", file=sys.stderr)
            return 0
        KeyList(d / "bans.txt").add(args.key, args.reason)
        print(f"banned {args.key}", file=sys.stderr)
        return 0
    except (SecurityError, ValueError) as err:
        print(f"echo-rl: {err}", file=sys.stderr)
        return 2
