"""In-memory doubles for the worker's parts (echo_rl/worker/session.py, generation.py, delivery.py,
install.py): a learner link that answers from a script, and the parts wired to it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from echo_rl.core import wire
from echo_rl.core.security import JoinLine
from echo_rl.worker.delivery import Deliveries
from echo_rl.worker.generation import Generation
from echo_rl.worker.install import Held
from echo_rl.worker.lifecycle import Activity, Lifecycle
from echo_rl.worker.session import JoinTerms, RelayOffer, Session, SessionHooks
from echo_rl.worker.status import StatusBoard
from echo_rl.worker.unreachable import Unreachable

VIEW = {
    "worker": {
        "groups_per_request": 2,
        "max_new_tokens": 4,
        "temperature": 1.0,
        "max_unacked_batches": 4,
        "heartbeat_s": 0.01,
    },
    "transport": {"request_timeout_s": 1.0, "max_message_mib": 8, "heartbeat_timeout_s": 1.0},
    "model": {"name": "tiny-qwen3"},
}


class ScriptedClient:
    """The learner link: ``answer(msg)`` replies to each request (an exception is raised);
    every request and send is kept in ``sent``."""

    endpoint = "tcp://127.0.0.1:9"
    handshake_error = ""
    retryable = True
    max_bytes = 0

    def __init__(self, answer: Callable[[Any], Any]):
        self.answer, self.sent = answer, []
        self.notices: asyncio.Queue = asyncio.Queue()

    async def request(self, msg: Any, timeout: float) -> Any:
        self.sent.append(msg)
        reply = self.answer(msg)
        if isinstance(reply, BaseException):
            raise reply
        return reply

    async def send(self, msg: Any) -> None:
        self.sent.append(msg)


def make_session(
    client: Any,
    *,
    view: dict | None = None,
    worker_id: str = "w0",
    hooks: SessionHooks | None = None,
) -> Session:
    endpoint = getattr(client, "endpoint", "tcp://127.0.0.1:9")
    s = Session(
        client,
        JoinLine(endpoint, None),
        JoinTerms(worker_id, 0.0, RelayOffer("", 0.0, 0.0), 0.05),
        status=StatusBoard(worker_id, endpoint, 0.0, None),
        unreachable=Unreachable(endpoint, None),
        life=Lifecycle(lambda: worker_id),
        hooks=hooks
        or SessionHooks(
            joined=lambda *a: None,
            offer=lambda *a: None,
            punch=lambda m: None,
            beat=lambda wid: wire.Heartbeat(worker_id=wid),
        ),
    )
    s.view = dict(view or VIEW)
    return s


class FakeInstaller:
    """A model installed at ``version``: nothing new to install."""

    def __init__(self, backend: Any = None, adapter: Any = None, version: int = 3):
        self.held = Held(backend, adapter, version)
        self.new_snapshot = asyncio.Event()

    async def ensure_installed(self) -> None:
        pass


def make_generation(
    client: Any,
    backend: Any = None,
    adapter: Any = None,
    *,
    cls: type[Generation] = Generation,
    version: int = 3,
) -> Generation:
    session = make_session(client)
    deliveries = Deliveries(client, lambda: session.timeout, session.banned)
    return cls(
        session,
        FakeInstaller(backend, adapter, version),
        deliveries,  # type: ignore[arg-type]
        life=session.life,
        activity=Activity(),
        status=session.status,
    )


def scripted_backend(completions: list[list[int]]) -> Any:
    """A backend answering every group with the same finished completions."""
    from echo_rl.worker.backends import Sample

    tok = SimpleNamespace(decode=lambda ids, skip_special_tokens=True: "")
    return SimpleNamespace(
        tokenizer=tok,
        tokens_sampled=0,
        base_hash=None,
        generate=lambda groups, n, t, stop=None: [
            [Sample(list(c), [-0.5] * len(c)) for c in completions] for _ in groups
        ],
    )
