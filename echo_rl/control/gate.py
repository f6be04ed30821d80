"""The learner's door: who may connect, who may join, and what one key may cost.

Three checks, each returning "" to let through or the reason that is counted and answered:
  * ``handshake(address, key)`` runs in the ZAP handler for every new encrypted connection:
    bans, the allow-list, and new connections per second (all peers, and per IP address);
  * ``newcomer(address)`` for a key that has no session yet: the admission budget of its IP
    prefix (``security.newcomers_per_s_per_prefix``), so one host cannot bring keys faster;
  * ``join(key, token, sessions)`` when a key asks to join: bans, allow-list or token, joins per
    second and the number of sessions;
  * ``message(key, nbytes)`` for every control message: bans (so a ban ends a live session at
    its next message: CurveZMQ does not close existing connections) and the key's message and
    byte rates.
The token, ban and allow-list files live in ``<run>/security/`` and are re-read when they change
(``reload``), so ``echo-rl token create`` and ``echo-rl worker ban`` act on a running learner.
"""

from __future__ import annotations

import ipaddress
import logging
from collections import Counter
from pathlib import Path

from echo_rl.broadcast.reports import NO_WITNESS
from echo_rl.core.config import SecurityConfig
from echo_rl.core.rates import TokenBucket
from echo_rl.core.security import KeyList, KeyPair, PeerLimits, TokenStore

log = logging.getLogger("echo.gate")

MIB = 2**20


def security_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "security"


class Gate:
    def __init__(self, cfg: SecurityConfig, run_dir: Path):
        self.cfg = cfg
        d = security_dir(run_dir)
        self.keys = KeyPair.load_or_create(d / "learner.key") if cfg.curve else None
        self.tokens = TokenStore(d / "tokens.json")
        self.bans = KeyList(d / "bans.txt")
        self.allow = KeyList(
            Path(cfg.allowlist_file) if cfg.allowlist_file else d / "allowlist.txt"
        )
        self.refused: Counter[str] = Counter()  # joins and connections refused, by reason
        self.limited: Counter[str] = Counter()  # messages refused for rate, by reason
        self._handshakes = TokenBucket(cfg.handshakes_per_s, 2 * cfg.handshakes_per_s)
        self._per_ip = PeerLimits(cfg.handshakes_per_s_per_ip, 2 * cfg.handshakes_per_s_per_ip)
        self._joins = TokenBucket(cfg.joins_per_s, 2 * cfg.joins_per_s)
        self._newcomers = PeerLimits(cfg.newcomers_per_s_per_prefix, cfg.newcomer_burst)
        self._msgs = PeerLimits(cfg.peer_msgs_per_s, 2 * cfg.peer_msgs_per_s)
        self._bytes = PeerLimits(cfg.peer_mib_per_s * MIB, 2 * cfg.peer_mib_per_s * MIB)

    def witness(self, key: str) -> str:
        """Whose word a relay report from ``key`` is (docs/security.md, "Relay reports"): the
        token it joined with (its sibling keys are the same witness), an allow-listed key on its
        own, or nobody independent (``NO_WITNESS``) in open mode, where keys are free."""
        if self.cfg.join == "allowlist":
            return "key:" + key
        if self.cfg.join == "token":
            token = self.tokens.token_of(key)
            return NO_WITNESS if token is None else "token:" + token[:16]
        return NO_WITNESS

    def reload(self) -> None:
        for name, f in (("tokens", self.tokens), ("bans", self.bans), ("allow-list", self.allow)):
            try:
                if f.reload():
                    log.info("re-read the %s file %s", name, f.path)
            except ValueError as exc:  # a corrupt file keeps the last good contents
                log.error("%s", exc)

    def _who(self, key: str) -> str:
        if key in self.bans:
            return "banned"
        if self.cfg.join == "allowlist" and key not in self.allow:
            return "not_allowlisted"
        return ""

    def handshake(self, address: str, key: str) -> str:
        reason = self._who(key)
        if not reason and not (self._per_ip.take(address) and self._handshakes.take()):
            reason = "rate_limited"
        if reason:
            self.refused[reason] += 1
        return reason

    def prefix(self, address: str) -> str:
        """The source an address belongs to: its /24 (IPv4) or /48 (IPv6) network; an
        address that is no IP (a unix socket) is its own source."""
        try:
            ip = ipaddress.ip_address(address)
        except ValueError:
            return address
        bits = self.cfg.prefix_v4 if ip.version == 4 else self.cfg.prefix_v6
        return str(ipaddress.ip_network(f"{ip}/{bits}", strict=False))

    def newcomer(self, address: str) -> str:
        """A key without a session connects: "" while its prefix has budget, else
        ``rate_limited`` (counted as ``newcomer_limited``; ZAP answers 300, try later)."""
        if self._newcomers.take(self.prefix(address)):
            return ""
        self.refused["newcomer_limited"] += 1
        return "rate_limited"

    def join(self, key: str, token: str, sessions: int, known: bool) -> str:
        """``known``: this key already has a session (a re-join costs no slot or token use)."""
        reason = self._who(key)
        if not reason and not known:
            if not self._joins.take():
                reason = "rate_limited"
            elif sessions >= self.cfg.max_workers:
                reason = "learner_full"
        if not reason and self.cfg.join == "token":
            reason = self.tokens.redeem(token, key) if token else "token_required"
        if reason:
            self.refused[reason] += 1
        return reason

    def message(self, key: str, nbytes: int) -> str:
        if key in self.bans:
            self.limited["banned"] += 1
            return "banned"
        if not self._msgs.take(key) or not self._bytes.take(key, nbytes):
            self.limited["rate_limited"] += 1
            return "rate_limited"
        return ""

    def ban(self, key: str, why: str) -> None:
        if key and key not in self.bans:
            log.warning("banning key %s: %s", key, why)
            self.bans.add(key, why)
