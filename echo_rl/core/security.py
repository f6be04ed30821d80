"""Who a peer is, and who may join: CurveZMQ keys, the join line, tokens, bans, rate limits.

Identity comes from keys (docs/security.md). Every Echo socket speaks CurveZMQ: the learner's
control and chunk sockets and every relay's chunk socket are CURVE servers; a peer's identity is
its CURVE public key, which libzmq authenticates in the handshake and our ZAP handler attaches to
every message it receives (``User-Id``). No message field can claim another identity.

On disk (all written atomically, secrets with mode 0600):
  * a key pair: two lines, public then secret, Z85 (``KeyPair``);
  * ``<run>/security/tokens.json``: join tokens, stored hashed (``TokenStore``);
  * ``<run>/security/bans.txt``: banned public keys, one per line (``BanList``);
  * an allow-list: public keys, one per line (``security.join = "allowlist"``).
The CLI (``echo-rl token create``, ``echo-rl worker ban``) edits these files; the running learner
re-reads them when they change, so a ban reaches live sessions at their next message.

The join line a volunteer copies: ``echo://HOST:PORT/<learner public key, hex>[?token=T]``.
"""

from __future__ import annotations

import fcntl
import hashlib
import hmac
import json
import os
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict, TypeVar
from urllib.parse import parse_qs, urlsplit

import zmq
import zmq.utils.z85 as z85

from echo_rl.core.errors import EchoError
from echo_rl.core.rates import TokenBucket

if TYPE_CHECKING:
    import zmq.asyncio

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
ZAP_DOMAIN = b"echo"  # every CURVE server socket has one: without, libzmq may skip ZAP
KEY_ENV = "ECHO_HOME"


class SecurityError(EchoError, ValueError):
    """A key, token or join line that cannot be used; the message says what to do."""

    default_reason = "security"


# ----------------------------------------------------------------------------- keys


@dataclass(frozen=True)
class KeyPair:
    public: bytes  # Z85, 40 bytes: what peers pin and what identifies us
    secret: bytes

    @classmethod
    def generate(cls) -> KeyPair:
        public, secret = zmq.curve_keypair()
        return cls(public, secret)

    @classmethod
    def load(cls, path: str | Path) -> KeyPair:
        p = Path(path)
        try:
            lines = p.read_text().split()
        except OSError as exc:
            raise SecurityError(f"cannot read key file {str(p)!r}: {exc.strerror}") from None
        if len(lines) != 2 or any(len(x) != 40 for x in lines):
            raise SecurityError(
                f"key file {str(p)!r} is not an Echo key pair (two Z85 lines): "
                f"delete it and a new one is made, or pass another --identity"
            )
        pair = cls(lines[0].encode(), lines[1].encode())
        if zmq.curve_public(pair.secret) != pair.public:
            raise SecurityError(f"key file {str(p)!r}: the public key does not match the secret")
        return pair

    @classmethod
    def load_or_create(cls, path: str | Path) -> KeyPair:
        p = Path(path)
        if p.exists():
            return cls.load(p)
        pair = cls.generate()
        atomic_write(p, (pair.public + b"\n" + pair.secret + b"\n").decode(), mode=0o600)
        return pair

    @property
    def text(self) -> str:
        return self.public.decode()


def default_identity_path() -> Path:
    """Where ``echo-worker join`` keeps this host's key pair unless ``--identity`` says."""
    base = os.environ.get(KEY_ENV) or os.path.join(os.path.expanduser("~"), ".config", "echo")
    return Path(base) / "worker.key"


def key_hex(public: bytes) -> str:
    return z85.decode(public).hex()


def key_from_hex(text: str) -> bytes:
    try:
        raw = bytes.fromhex(text)
    except ValueError:
        raw = b""
    if len(raw) != 32:
        raise SecurityError(
            f"learner key {text!r} is not 64 hex digits: copy the whole join "
            f"line the learner printed"
        )
    return z85.encode(raw)


def fingerprint(public: bytes | str) -> str:
    """A short stable name for a key (logs, default worker ids)."""
    raw = public.encode() if isinstance(public, str) else public
    return hashlib.sha256(raw).hexdigest()[:10]


# ----------------------------------------------------------------------------- join line


@dataclass(frozen=True)
class JoinLine:
    endpoint: str  # tcp://HOST:PORT
    server_key: bytes | None  # None: plaintext (insecure learner)
    token: str = ""

    def __str__(self) -> str:
        host_port = self.endpoint.removeprefix("tcp://")
        if self.server_key is None:
            return self.endpoint
        q = f"?token={self.token}" if self.token else ""
        return f"echo://{host_port}/{key_hex(self.server_key)}{q}"

    @classmethod
    def parse(cls, text: str) -> JoinLine:
        if text.startswith("tcp://"):
            return cls(text, None)
        if not text.startswith("echo://"):
            raise SecurityError(
                f"learner address {text!r} must be the join line the learner "
                f"printed (echo://HOST:PORT/KEY) or tcp://HOST:PORT with --insecure"
            )
        parts = urlsplit(text)
        if not parts.hostname or not parts.port:
            raise SecurityError(f"join line {text!r} names no HOST:PORT")
        key = key_from_hex(parts.path.strip("/"))
        token = parse_qs(parts.query).get("token", [""])[0]
        return cls(f"tcp://{parts.netloc}", key, token)


# ----------------------------------------------------------------------------- files


def atomic_write(path: Path, text: str, mode: int = 0o644) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


@contextmanager
def locked(path: Path) -> Iterator[None]:
    """Serialises the CLI and the learner editing the same file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


class _Watched:
    """A file re-read when its mtime or size changes (polled by the learner's housekeeping)."""

    def __init__(self, path: Path):
        self.path = path
        self._stamp: tuple[int, int] | None = None

    def changed(self) -> bool:
        try:
            st = self.path.stat()
            stamp = (st.st_mtime_ns, st.st_size)
        except FileNotFoundError:
            stamp = (0, 0)
        if stamp == self._stamp:
            return False
        self._stamp = stamp
        return True


def _hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class TokenEntry(TypedDict):
    """One join token in tokens.json, under its SHA-256."""

    uses_left: int  # joins of new keys it still admits
    expires: float  # unix time
    keys: list[str]  # the keys that redeemed it (each may re-join with it)
    note: str


class TokenStore:
    """Join tokens: random, stored only as SHA-256, with a use count and an expiry; a key that
    redeemed a token may re-join with it (a restart must not burn another use)."""

    def __init__(self, path: Path, clock: Callable[[], float] = time.time):
        self.path = Path(path)
        self.clock = clock
        self._watch = _Watched(self.path)
        self.tokens: dict[str, TokenEntry] = {}
        self.reload()

    def reload(self) -> bool:
        if not self._watch.changed():
            return False
        try:
            self.tokens = json.loads(self.path.read_text())["tokens"]
        except FileNotFoundError:
            self.tokens = {}
        except (ValueError, KeyError, TypeError) as exc:
            raise SecurityError(f"{self.path} is corrupt ({exc}): fix or delete it") from None
        return True

    def _save(self) -> None:
        atomic_write(self.path, json.dumps({"tokens": self.tokens}, indent=1), mode=0o600)
        self._watch.changed()

    def token_of(self, key: str) -> str | None:
        """The stored hash of the token ``key`` joined with (its keys share it), or None."""
        return next((h for h, e in self.tokens.items() if key in e["keys"]), None)

    def create(self, uses: int, ttl_s: float, note: str = "") -> str:
        if uses < 1 or ttl_s <= 0:
            raise SecurityError("a token needs --uses >= 1 and a positive --expires")
        token = "echo_" + secrets.token_urlsafe(24)
        with locked(self.path):
            self._watch._stamp = None
            self.reload()
            self.tokens[_hash_token(token)] = {
                "uses_left": uses,
                "expires": self.clock() + ttl_s,
                "keys": [],
                "note": note,
            }
            self._save()
        return token

    def _entry(self, digest: str) -> TokenEntry | None:
        return next((e for h, e in self.tokens.items() if hmac.compare_digest(h, digest)), None)

    def _reread(self) -> bool:
        try:
            return self.reload()
        except SecurityError:  # a corrupt file keeps the last good contents (Gate.reload says so)
            return False

    def redeem(self, token: str, key: str) -> str:
        """ "" when ``key`` may join with ``token``, else the refusal reason."""
        digest = _hash_token(token)
        entry = self._entry(digest)
        if entry is None and self._reread():  # created since the last poll: a token handed
            entry = self._entry(digest)  # out at once must not be refused (a stat, no more)
        if entry is None:
            return "bad_token"
        if key in entry["keys"]:
            return ""
        if entry["expires"] < self.clock():
            return "token_expired"
        if entry["uses_left"] < 1:
            return "token_used"
        with locked(self.path):
            entry["uses_left"] -= 1
            entry["keys"].append(key)
            self._save()
        return ""


class KeyList:
    """A set of public keys in a text file, one per line, optionally followed by a note
    (bans, allow-list); a line whose first word is not a 40-character key is a comment."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._watch = _Watched(self.path)
        self.keys: set[str] = set()
        self.notes: dict[str, str] = {}
        self.reload()

    def reload(self) -> bool:
        if not self._watch.changed():
            return False
        try:
            lines = self.path.read_text().splitlines()
        except FileNotFoundError:
            lines = []
        # The key is a line's first word when it is 40 characters (Z85 has no spaces, but it
        # does have '#', so a key may start with one); other lines are comments.
        parts = (ln.split(None, 1) for ln in lines if ln.strip())
        self.notes = {
            p[0]: (p[1].strip().removeprefix("#").strip() if len(p) > 1 else "")
            for p in parts
            if len(p[0]) == 40
        }
        self.keys = set(self.notes)
        return True

    def note(self, key: str) -> str:
        """The note written beside ``key`` (why it was banned), "" if none."""
        return self.notes.get(key, "")

    def add(self, key: str, note: str = "") -> None:
        if len(key) != 40:
            raise SecurityError(
                f"{key!r} is not a public key (40 Z85 characters, as shown by "
                f"the dashboard and the learner's log)"
            )
        with locked(self.path):
            with self.path.open("a") as f:
                f.write(f"{key}  # {note}\n" if note else f"{key}\n")
        self.reload()

    def __contains__(self, key: object) -> bool:
        return key in self.keys


# ----------------------------------------------------------------------------- rate limits


class PeerLimits:
    """One bucket per peer, for at most ``max_peers`` peers (least recently seen evicted: an
    evicted peer starts again with a full bucket, which costs at most one burst)."""

    def __init__(
        self,
        rate: float,
        burst: float,
        max_peers: int = 65536,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.rate, self.burst, self.max_peers, self.clock = rate, burst, max_peers, clock
        self._buckets: OrderedDict[str, TokenBucket] = OrderedDict()

    def take(self, peer: str, n: float = 1.0) -> bool:
        b = self._buckets.pop(peer, None) or TokenBucket(self.rate, self.burst, self.clock)
        self._buckets[peer] = b
        if len(self._buckets) > self.max_peers:
            self._buckets.popitem(last=False)
        return b.take(n)


class LogThrottle:
    """At most one log line per peer per ``period_s`` (a flood must not become a flood of log
    lines: 100,000 refusals once wrote 23 MB of learner.log). The counters still count all."""

    def __init__(
        self,
        period_s: float = 10.0,
        max_peers: int = 4096,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.period_s, self.max_peers, self.clock = period_s, max_peers, clock
        self._last: OrderedDict[str, float] = OrderedDict()
        self.suppressed = 0

    def ok(self, peer: str) -> bool:
        now = self.clock()
        last = self._last.get(peer)
        if last is not None and now - last < self.period_s:
            self.suppressed += 1
            return False
        self._last.pop(peer, None)
        self._last[peer] = now
        if len(self._last) > self.max_peers:
            self._last.popitem(last=False)
        return True


# ----------------------------------------------------------------------------- sockets


_T = TypeVar("_T")  # what a socket's recv gives (zmq.Socket's own parameter)


def curve_server(sock: zmq.Socket[_T], keys: KeyPair, zap_domain: bytes = ZAP_DOMAIN) -> None:
    """Make ``sock`` a CURVE server; bind a ``ZapHandler`` on its context first. libzmq 4.3
    by default admits a CURVE client when no ZAP handler is bound (and, with
    ZAP_ENFORCE_DOMAIN, skips ZAP on an empty domain): either way a peer with no ``User-Id``,
    no identity. A domain *and* ZAP_ENFORCE_DOMAIN make every handshake need the handler."""
    sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
    sock.zap_domain = zap_domain
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_server = True


def curve_client(sock: zmq.Socket[_T], keys: KeyPair, server_key: bytes) -> None:
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_serverkey = server_key


def peer_key(frame: zmq.Frame) -> str:
    """The authenticated public key of the peer that sent ``frame`` ("" on a plaintext socket)."""
    try:
        return str(frame.get("User-Id"))
    except zmq.ZMQError:
        return ""


def sender_key(frames: list[zmq.Frame]) -> str:
    """The sender's key from the frames of one message ("" when none carries it: a plaintext
    socket, or a CURVE socket whose handshake skipped ZAP, which ``curve_server`` prevents)."""
    for frame in reversed(frames):
        key = peer_key(frame)
        if key:
            return key
    return ""


Decide = Callable[[str, str], str]  # (address, public key) -> "" to accept, else the reason


class ZapHandler:
    """The ZAP handler for every CURVE server socket of ``ctx`` (RFC 27). libzmq has already
    proven the client holds the secret of the key it presents; ``decide`` says whether that key
    may connect. The reply's user id is the key, so every message carries it as ``User-Id``.

    It binds when constructed: build it before binding any CURVE server socket of ``ctx``, so no
    handshake can come before it (``curve_server`` makes such a handshake fail, not pass)."""

    def __init__(
        self, ctx: zmq.asyncio.Context, decide: Decide, domains: dict[bytes, Decide] | None = None
    ):
        self.decide = decide
        self.domains = domains or {}  # a socket with a ZAP domain may have a stricter rule
        self.sock = ctx.socket(zmq.REP)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(ZAP_ENDPOINT)

    async def serve(self) -> None:
        try:
            while True:
                frames = await self.sock.recv_multipart()
                req_id = frames[1] if len(frames) > 1 else b""
                reason, key = self._judge(frames)
                # 300 is a temporary refusal (the client may retry), 400 a final one.
                status = b"200" if not reason else b"300" if reason == "rate_limited" else b"400"
                await self.sock.send_multipart(
                    [
                        b"1.0",
                        req_id,
                        status,
                        (reason or "OK").encode(),
                        b"" if reason else key.encode(),
                        b"",
                    ]
                )
        finally:
            self.close()

    def _judge(self, frames: list[bytes]) -> tuple[str, str]:
        if len(frames) != 7 or frames[5] != b"CURVE" or len(frames[6]) != 32:
            return "malformed", ""
        key = z85.encode(frames[6]).decode()
        rule = self.domains.get(frames[2], self.decide)
        return rule(frames[3].decode("ascii", "replace"), key), key

    def close(self) -> None:
        self.sock.close(linger=0)
