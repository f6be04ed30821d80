"""One message from one peer, from frames to a reply: the gate's per-key limits and bans, the
strict decode of ``echo_rl.core.wire``, then the handler for its type. Whatever the message holds ends
at most that message: a bad one is answered with ``error{reason}``, counted under that reason
and logged with the sender's key, and the server goes on serving everyone else.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from typing import Any

from echo_rl.control.deliveries import Deferred
from echo_rl.control.gate import Gate
from echo_rl.core import wire
from echo_rl.core.security import LogThrottle

log = logging.getLogger("echo.control")

SMALL_FRAME = 1 << 16

# What a request comes to: a reply, a reply deferred until its records are durable, or none.
Reply = wire.Message | Deferred | None
# A handler: (routing id, sender key, message) -> its reply. Each takes its own message type
# (the dispatcher looks it up by that type), hence Any for the message.
Handler = Callable[[bytes, str, Any], Reply]


def ban_detail(note: str) -> str:
    """What a banned worker is told: the reason written with the ban (docs/volunteers.md)."""
    return f"this key is banned ({note})" if note else "this key is banned"


def small(frame: bytes, max_bytes: int) -> wire.Message | None:
    """A refused frame decoded only when small (for its request id, so the sender's request
    ends with the refusal instead of a timeout); a large one is not worth the CPU."""
    if len(frame) > SMALL_FRAME:
        return None
    try:
        return wire.decode(frame, max_bytes)
    except wire.WireError:
        return None


class Dispatcher:
    def __init__(
        self,
        *,
        gate: Gate,
        handlers: dict[type, Handler],
        max_bytes: int,
        rejected: Counter[str],
        end_session: Callable[[str, str], None],
    ):
        """``end_session(key, why)``: a banned key's live session ends at its next message."""
        self.gate = gate
        self.handlers = handlers
        self.max_bytes = max_bytes
        self.rejected = rejected  # the server's refusal counts, by reason (shared)
        self.end_session = end_session
        self.kind = ""  # the type of the message being handled (the loop's CPU book)
        self._log_gate = LogThrottle()  # one refusal line per peer per 10 s

    async def handle(self, ident: bytes, key: str, frames: list[bytes]) -> Reply:
        """One message from one peer: whatever it holds ends at most this message."""
        msg: wire.Message | None = None
        try:
            if len(frames) != 1:
                raise wire.WireError("malformed", f"{len(frames)} frames, expected 1")
            refused = self.gate.message(key, len(frames[0])) if key else ""
            if refused:
                if refused == "banned":
                    self.end_session(key, "banned")
                msg = small(frames[0], self.max_bytes)  # for its request id, if cheap
                raise wire.WireError(
                    refused,
                    ban_detail(self.gate.bans.note(key))
                    if refused == "banned"
                    else "too many messages from this key: slow down",
                )
            msg = wire.decode(frames[0], self.max_bytes)
            return await self.dispatch(ident, key, msg)
        except wire.WireError as err:
            self.rejected[err.reason] += 1
            if self._log_gate.ok(key or ident.hex()):
                log.warning("rejected message from %s: %s", key or ident.hex(), err)
            # The request id, when the message had one, so the sender's request ends now.
            return wire.Error(reason=err.reason, detail=err.detail, rid=msg.rid if msg else 0)
        except Exception:
            # A bug in one handler must not take the learner's server down with it:
            # the message is answered, counted and logged with its traceback.
            self.rejected["internal_error"] += 1
            log.exception("internal error handling a message from %s", key or ident.hex())
            return wire.Error(reason="internal_error", detail="see the learner's log")

    async def dispatch(self, ident: bytes, key: str, msg: wire.Message) -> Reply:
        handler = self.handlers.get(type(msg))
        if handler is None:
            raise wire.WireError("unknown_type", f"{msg.type} is not a request the learner serves")
        self.kind = msg.TYPE
        if not key:
            if self.gate.keys is not None:  # CURVE on, yet no key: never trust the claimed id
                raise wire.WireError(
                    "unauthenticated",
                    "this connection carries no verified "
                    "key; reconnect (the learner may have been starting)",
                )
            key = f"id:{getattr(msg, 'worker_id', '')}"  # plaintext: the claimed id is all there is
        reply = handler(ident, key, msg)
        if isinstance(reply, Deferred):
            reply.reply.rid = msg.rid
        elif reply is not None:
            reply.rid = msg.rid
        return reply
