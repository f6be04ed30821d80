"""The fleet's books in the run folder, so a restarted learner knows its workers (issue 39).

``fleet.json`` holds, by worker identity (the public key), what the provisioner measured
(throughput, failed probations, whether the worker was active) and each worker's account
(records accepted and refused, active time, earnings). The learner server rewrites it every
``SAVE_EVERY_S`` seconds and at shutdown (atomic rename, written off the event loop);
``--resume`` reads it back before the first worker re-joins. A returning key is then not a
stranger: it is measured, not on probation, active again if it was, and its books go on
where they stopped. A SIGKILL loses at most the last ``SAVE_EVERY_S`` seconds of changes,
which cost nothing but a slightly older estimate. A missing or damaged file is logged and the
resume goes on with empty books (every worker is then a stranger, as before this file).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

from echo_rl.core.jsontypes import JsonObject

if TYPE_CHECKING:
    from echo_rl.control.accounts import Accounts, BookState
    from echo_rl.provisioning.controller import Controller

log = logging.getLogger("echo.fleet")

FLEET_FILE = "fleet.json"
SAVE_EVERY_S = 2.0
SCHEMA = 1


class FleetDoc(TypedDict):
    """What the learner writes (``FleetRecord.state``; the file adds its schema and the time):
    the provisioner's memory by key (``Controller.state``) and the accounts by worker id."""

    controller: Mapping[str, Mapping[str, object]]
    accounts: dict[str, BookState]


@dataclass
class FleetState:
    """The file's content as read back, before the provisioner and the accounts check it:
    the provisioner's memory and the accounts, both by identity."""

    controller: dict[str, object] = field(default_factory=dict)  # Controller.state()
    accounts: JsonObject = field(default_factory=dict)  # Accounts.state()


class FleetBooks:
    def __init__(self, path: Path, every_s: float = SAVE_EVERY_S):
        self.path, self.every_s = path, every_s
        self._last = -float("inf")

    def due(self, now: float) -> bool:
        if now - self._last < self.every_s:
            return False
        self._last = now
        return True

    def save(self, state: FleetDoc) -> None:
        tmp = self.path.with_suffix(".tmp")
        try:
            tmp.write_text(json.dumps({"schema": SCHEMA, "saved_at": time.time(), **state}))
            os.replace(tmp, self.path)
        except OSError as exc:
            log.error(
                "could not save the fleet's books to %s: %s (a restart would treat "
                "every worker as a stranger)",
                self.path,
                exc,
            )

    def load(self) -> FleetState:
        if not self.path.exists():
            log.warning(
                "resume: no %s in the run folder: every worker re-joins as a stranger",
                self.path.name,
            )
            return FleetState()
        try:
            doc = json.loads(self.path.read_text())
            if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
                raise ValueError(
                    f"schema {doc.get('schema') if isinstance(doc, dict) else None!r}, "
                    f"expected {SCHEMA}"
                )
            ctl, acc = doc.get("controller", {}), doc.get("accounts", {})
            if not isinstance(ctl, dict) or not isinstance(acc, dict):
                raise ValueError("controller and accounts must be objects")
            return FleetState(ctl, acc)
        except (OSError, ValueError) as exc:
            log.error(
                "resume: %s is unreadable (%s): every worker re-joins as a stranger", self.path, exc
            )
            return FleetState()


class FleetRecord:
    """The fleet's books bound to what they record: the provisioner's memory (None: no
    provisioner) and the accounts. The server saves ``state()`` every ``SAVE_EVERY_S`` and at
    shutdown (written off its loop); ``--resume`` calls ``restore`` before the loop starts."""

    def __init__(self, books: FleetBooks, controller: Controller | None, accounts: Accounts):
        self.books, self.controller, self.accounts = books, controller, accounts

    def state(self) -> FleetDoc:
        """What a restarted learner needs to know about its fleet (read on the loop)."""
        return {
            "controller": self.controller.state() if self.controller is not None else {},
            "accounts": self.accounts.state(),
        }

    def restore(self) -> None:
        """``--resume``: the books the last instance saved; before the loop starts."""
        state = self.books.load()
        n = self.controller.restore(state.controller) if self.controller is not None else 0
        m = self.accounts.restore(state.accounts)
        log.info(
            "resume: fleet books restored for %d worker identities (provisioner) and %d accounts",
            n,
            m,
        )
