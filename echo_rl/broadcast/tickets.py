"""Pull tickets: which peer may pull snapshot chunks from which server (docs/security.md).

A relay serves only the children the learner assigned to it. The learner knows the plan; a
relay does not (the plan changes at every publication and on every re-attach). So the learner
hands each worker, with its source, a *ticket*: ``(child key, parent endpoint, run id,
expiry)`` signed with the run's Ed25519 key, which every worker already holds to verify
manifests. The child sends the ticket with its chunk requests; the server checks the
signature, that the child named is the CURVE key the request came from (``User-Id``), and that
the parent named is itself. A stranger, or a worker assigned elsewhere, is refused with a
counted reason. Verified tickets are cached (bounded), so a chunk request costs one dict look-up.

Wire form: ``signature (64 bytes) + msgpack([child, parent, run_id, expires])``, written only by
``Ticket.body`` and read only by ``Ticket.parse``.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import msgpack
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from echo_rl.broadcast.snapshot import RunKey

SIG = 64
MAX_TICKET = 512
CACHE = 4096


@dataclass(frozen=True)
class Source:
    """Where to pull a snapshot from: endpoint, its CURVE public key (b"": plaintext) and the
    ticket that lets us in."""

    endpoint: str
    key: bytes = b""
    ticket: bytes = b""

    def __str__(self) -> str:
        return self.endpoint


@dataclass(frozen=True)
class Ticket:
    """``child`` (a CURVE key, as text) may pull from ``parent`` (an endpoint) until
    ``expires`` (Unix seconds), in run ``run_id``."""

    child: str
    parent: str
    run_id: str
    expires: float

    def body(self) -> bytes:
        """What the run's key signs and what travels after the signature."""
        packed: bytes = msgpack.packb([self.child, self.parent, self.run_id, self.expires])
        return packed

    @classmethod
    def parse(cls, body: bytes) -> Ticket | None:
        """The ticket a (verified) body holds, None when it is not one."""
        try:
            child, parent, run_id, expires = msgpack.unpackb(
                body, raw=False, max_array_len=4, max_str_len=256
            )
        except (ValueError, TypeError, msgpack.UnpackException):
            return None
        if not all(isinstance(f, str) for f in (child, parent, run_id)) or not isinstance(
            expires, (int, float)
        ):
            return None
        return cls(child, parent, run_id, float(expires))


def mint(
    run_key: RunKey, child: str, parent: str, run_id: str, ttl_s: float, now: float | None = None
) -> bytes:
    body = Ticket(child, parent, run_id, (now or time.time()) + ttl_s).body()
    return run_key.sign(body) + body


class TicketCheck:
    """The server side: ``check(peer_key, ticket)`` returns "" when the peer may pull here,
    else the reason counted for the refusal."""

    def __init__(
        self, public_key: Callable[[], bytes], endpoint: str, clock: Callable[[], float] = time.time
    ):
        self.public_key = public_key  # the run's key can change when the worker re-joins
        self.endpoint = endpoint
        self.clock = clock
        self._ok: OrderedDict[bytes, tuple[str, float]] = OrderedDict()

    def check(self, peer: str, ticket: bytes) -> str:
        hit = self._ok.get(ticket)
        if hit is None:
            reason, hit = self._verify(ticket)
            if reason:
                return reason
            self._ok[ticket] = hit
            if len(self._ok) > CACHE:
                self._ok.popitem(last=False)
        child, expires = hit
        if child != peer:
            return "not_your_ticket"
        if expires < self.clock():
            return "ticket_expired"
        return ""

    def _verify(self, ticket: bytes) -> tuple[str, tuple[str, float]]:
        none = ("", 0.0)
        if not ticket:
            return "no_ticket", none
        if len(ticket) > MAX_TICKET:
            return "bad_ticket", none
        sig, body = ticket[:SIG], ticket[SIG:]
        try:
            Ed25519PublicKey.from_public_bytes(self.public_key()).verify(sig, body)
        except (InvalidSignature, ValueError, TypeError):
            return "bad_ticket", none
        parsed = Ticket.parse(body)
        if parsed is None:
            return "bad_ticket", none
        if parsed.parent != self.endpoint:
            return "not_assigned_here", none
        return "", (parsed.child, parsed.expires)
