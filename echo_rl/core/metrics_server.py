"""The learner's read-only HTTP server: ``/metrics`` (Prometheus text), ``/health`` and
``/api/state`` (JSON), ``/`` (the dashboard page, ``echo_rl/core/dashboard/index.html``, no external
assets), in a daemon thread with a bounded number of connections (stdlib ``http.server``)."""

from __future__ import annotations

import json
import math
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, TypeAlias, overload

from prometheus_client.exposition import CONTENT_TYPE_LATEST

from echo_rl.core.jsontypes import JsonObject, JsonValue

if TYPE_CHECKING:
    from echo_rl.core.metrics import LearnerMetrics

DASHBOARD = Path(__file__).parent / "dashboard" / "index.html"


class _Handler(BaseHTTPRequestHandler):
    metrics: LearnerMetrics  # set on the subclass made per server
    timeout = 10  # seconds a connection may sit idle (an idle flood must not hold threads)

    def log_message(self, format: str, *args: object) -> None:  # quiet
        pass

    def _send(self, code: int, body: bytes, ctype: str) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)

    def _json(self, obj: object) -> None:
        self._send(200, json.dumps(obj, allow_nan=False, default=str).encode(), "application/json")

    def do_GET(self) -> None:  # noqa: N802
        path = self.path.split("?", 1)[0]
        try:
            if path == "/metrics":
                self._send(200, self.metrics.prometheus_text(), CONTENT_TYPE_LATEST)
            elif path == "/health":
                self._json(self.metrics.health())
            elif path == "/api/state":
                self._json(_finite(self.metrics.state()))
            elif path in ("/", "/index.html"):
                self._send(200, DASHBOARD.read_bytes(), "text/html; charset=utf-8")
            else:
                self._send(404, b"not found\n", "text/plain")
        except (BrokenPipeError, ConnectionResetError):
            pass


def _finite(x: object) -> object:
    """NaN/inf are not JSON: send null."""
    return finite_or_null(x)[0]


@overload
def finite_or_null(x: JsonObject) -> tuple[JsonObject, int]: ...
@overload
def finite_or_null(x: JsonValue) -> tuple[JsonValue, int]: ...
@overload
def finite_or_null(x: object) -> tuple[object, int]: ...


def finite_or_null(x: object) -> tuple[object, int]:
    """``x`` with every non-finite float (nested in dicts, lists, tuples) replaced by None,
    and how many were replaced: what ``json.dumps(..., allow_nan=False)`` accepts."""
    if isinstance(x, float) and not math.isfinite(x):
        return None, 1
    if isinstance(x, dict):
        items = [(k, finite_or_null(v)) for k, v in x.items()]
        return {k: v for k, (v, _) in items}, sum(n for _, (_, n) in items)
    if isinstance(x, (list, tuple)):
        elems = [finite_or_null(v) for v in x]
        return [v for v, _ in elems], sum(n for _, n in elems)
    return x, 0


MAX_CONNECTIONS = 32
MAX_PER_IP = 8

# What socketserver hands a TCP server's request methods: the connection, and the peer's
# (host, port) or, over IPv6, (host, port, flowinfo, scope_id).
_Request: TypeAlias = socket.socket | tuple[bytes, socket.socket]
_Peer: TypeAlias = tuple[str, int] | tuple[str, int, int, int]


class _BoundedServer(ThreadingHTTPServer):
    """At most ``MAX_CONNECTIONS`` connections served at once (one thread each), and at most
    ``MAX_PER_IP`` from one address; more are closed at once and counted. 780 idle connections
    then cost 32 threads, not 780, and one address cannot take every slot from the others."""

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler]) -> None:
        super().__init__(address, handler)
        self.slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self.per_ip: dict[str, int] = {}
        self.lock = threading.Lock()
        self.refused = 0

    def _admit(self, ip: str) -> bool:
        with self.lock:
            if self.per_ip.get(ip, 0) >= MAX_PER_IP or not self.slots.acquire(blocking=False):
                self.refused += 1
                return False
            self.per_ip[ip] = self.per_ip.get(ip, 0) + 1
            return True

    def process_request(self, request: _Request, client_address: _Peer) -> None:
        if not self._admit(client_address[0]):
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: _Request, client_address: _Peer) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self.lock:
                self.per_ip[client_address[0]] -= 1
                if not self.per_ip[client_address[0]]:
                    del self.per_ip[client_address[0]]
            self.slots.release()


class MetricsServer:
    """``/metrics``, ``/health``, ``/api/state``, ``/`` on host:port (port 0: the OS picks) in a
    daemon thread, read-only, at most ``MAX_CONNECTIONS`` at once. ``close()`` stops it."""

    def __init__(self, metrics: LearnerMetrics, host: str = "127.0.0.1", port: int = 0):
        handler = type("Handler", (_Handler,), {"metrics": metrics})
        self.httpd = _BoundedServer((host, port), handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(
            target=self.httpd.serve_forever, name="echo-metrics", daemon=True
        )
        self.thread.start()

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.httpd.server_address[:2]
        return str(host), int(port)

    @property
    def url(self) -> str:
        host, port = self.address
        return f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{port}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
