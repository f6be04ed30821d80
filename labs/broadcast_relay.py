"""One relay process of the broadcast benchmark: what a worker runs (``Relay``: download and
upload shaped at b), joined to the benchmark's root (``labs.broadcast_root``).

    python -m labs.broadcast_relay --root EP --id r00 [--down-mbit B --up-mbit B ...]

``labs.broadcast_bench`` starts N of these; each reports its installs, answers the root's audit
with the digest of what it rebuilt, and optionally writes a per-version trace.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import blake3
import zmq
import zmq.asyncio

from echo_rl.broadcast.nat.links import Tunnels
from echo_rl.broadcast.nat.reflect import pick_punch_port, probe_all
from echo_rl.broadcast.relay import Relay, RelayConfig
from echo_rl.broadcast.snapshot import SnapshotError, verify_manifest
from echo_rl.broadcast.store import SnapshotBuffer
from echo_rl.broadcast.tickets import Source
from echo_rl.broadcast.versions import rebuild
from echo_rl.core import wire
from echo_rl.core.client import Client
from echo_rl.core.security import KeyPair, key_from_hex
from labs.doubles import CorruptingRelay

MAX_BYTES = 64 * 2**20


async def relay_process(args: argparse.Namespace) -> int:
    ctx = zmq.asyncio.Context()
    # With --root-key: the relay a worker runs, CURVE and pull tickets (docs/security.md).
    server_key = key_from_hex(args.root_key) if args.root_key else None
    keys = KeyPair.generate() if server_key else None
    run_key = b""
    cfg = RelayConfig(
        bind_host=args.bind_host,
        serve=not args.no_serve,
        window=args.window,
        timeout_s=args.timeout,
        down_mbit=args.down_mbit,
        up_mbit=args.real_up_mbit or args.up_mbit,
        shape=not args.kernel_shaped,
        chunk_bytes=args.chunk_kib * 1024,
    )
    kind = CorruptingRelay if args.corrupt else Relay  # --corrupt: alters every chunk it serves
    relay = kind(ctx, cfg, keys=keys, run_key=lambda: run_key)
    if args.reserve_mib:
        relay.store.reserve(int(args.reserve_mib * 2**20), args.reserve_count)
    tunnels = Tunnels(args.bind_host, pick_punch_port(args.bind_host), endpoint=relay.endpoint)
    relay.resolve = tunnels.resolve
    client = Client(ctx, args.root, MAX_BYTES, keys=keys, server_key=server_key)
    join = wire.Join(
        worker_id=args.id,
        relay_endpoint=relay.endpoint,
        down_mbit=args.down_mbit,
        up_mbit=args.up_mbit,
        can_relay=not args.no_serve,
    )
    async with asyncio.TaskGroup() as tg:
        inbox: asyncio.Queue[wire.Message] = asyncio.Queue()
        tasks = [
            tg.create_task(client.receive_forever()),
            tg.create_task(relay.serve_forever()),
            tg.create_task(tunnels.serve_forever()),
            tg.create_task(_punches_first(client, tunnels, inbox)),
        ]
        ack = await client.request(join, 60)
        assert isinstance(ack, wire.JoinAck)
        run_key = ack.public_key
        if ack.reflectors:  # the root classifies our NAT (docs/nat.md)
            port = int(relay.endpoint.rpartition(":")[2]) if relay.endpoint else 0
            nonces = await probe_all(ack.reflectors, tunnels.host, tunnels.port, port)
            status = await client.request(wire.NatReport(worker_id=args.id, nonces=nonces), 30)
            assert isinstance(status, wire.NatStatus), status
        held, base = None, None
        trace: dict[str, Any] = {
            "id": args.id,
            "endpoint": relay.endpoint,
            "joined": time.time(),
            "versions": [],
        }
        while True:
            msg = await inbox.get()
            if isinstance(msg, wire.Shutdown) and msg.reason == "audit" and held is not None:
                base = await _audit(client, args.id, held, base)
                continue
            if isinstance(msg, wire.Shutdown):
                break
            assert isinstance(msg, wire.SnapshotNotice)
            entry: dict[str, Any] = {
                "version": msg.version,
                "noticed": time.time(),
                "source": msg.source,
                "reattaches": [],
            }
            trace["versions"].append(entry)

            async def reattach(
                bad: Source, fail: Any, version: int = msg.version, entry: dict[str, Any] = entry
            ) -> Source:
                grant = await client.request(
                    wire.SourceRequest(
                        worker_id=args.id,
                        version=version,
                        bad_source=bad.endpoint,
                        reason=fail.reason,
                    ),
                    30,
                )
                assert isinstance(grant, wire.SourceGrant)
                entry["reattaches"].append(
                    {
                        "at": time.time(),
                        "bad": bad.endpoint,
                        "reason": fail.reason,
                        "detail": fail.detail[:200],
                        "granted": grant.source,
                    }
                )
                return Source(grant.source, grant.source_key, grant.ticket)

            manifest = verify_manifest(msg.manifest, ack.public_key)
            held, stats = await relay.receive(
                manifest, Source(msg.source, msg.source_key, msg.ticket), reattach
            )
            entry.update(installed=time.time(), attempts=stats.attempts)
            if args.trace:
                Path(args.trace).write_text(json.dumps(trace, indent=1))
            # Installed the moment the last chunk verified against the signed manifest: that is
            # what a worker relies on before it installs.
            await client.send(
                wire.Installed(
                    worker_id=args.id, version=held.version, **relay.measured(held.version, stats)
                )
            )
        for t in tasks:
            t.cancel()
    relay.close()
    client.close(linger_ms=5000)  # let the audit digest leave before the socket closes
    ctx.term()
    return 0


async def _punches_first(client: Client, tunnels: Tunnels, inbox: asyncio.Queue) -> None:
    """A punch is acted on the moment it arrives, even while this relay is fetching (its
    peer is punching now); everything else waits its turn in ``inbox``."""
    while True:
        msg = await client.notices.get()
        if isinstance(msg, wire.Punch):
            tunnels.open(msg)
        else:
            inbox.put_nowait(msg)


async def _audit(client: Client, wid: str, held: SnapshotBuffer, base: Any) -> Any:
    """The audit of one publication, when the root asks (after every relay installed it, so its
    CPU slows no hop still relaying): rebuild the version as a worker does (a delta applied to
    the previous version's full payload) and send the BLAKE3 of the whole result, which the
    root compares with the learner's full payload: every install checked bit for bit,
    independently of the per-chunk checks. Returns the result: the next delta's base."""
    try:
        result = await asyncio.to_thread(rebuild, held.manifest, held.payload, base)
        digest = await asyncio.to_thread(
            lambda: blake3.blake3(result, max_threads=blake3.blake3.AUTO).digest()
        )
    except SnapshotError:
        result, digest = None, bytes(32)  # counted as a corrupt install
    await client.send(wire.Installed(worker_id=wid, version=held.version, digest=digest))
    return result


def relay_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m labs.broadcast_relay")
    ap.add_argument("--root", required=True)
    ap.add_argument("--id", required=True)
    ap.add_argument("--down-mbit", type=float, default=0.0)
    ap.add_argument("--up-mbit", type=float, default=0.0)
    ap.add_argument("--chunk-kib", type=int, default=1024)
    ap.add_argument("--window", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=10.0)
    ap.add_argument("--corrupt", action="store_true")
    ap.add_argument("--no-serve", action="store_true")
    ap.add_argument("--bind-host", default="127.0.0.1")
    ap.add_argument(
        "--kernel-shaped", action="store_true", help="links are shaped by tc: no app shaping"
    )
    ap.add_argument("--reserve-mib", type=float, default=0.0, help="pre-allocate a receive buffer")
    ap.add_argument(
        "--reserve-count",
        type=int,
        default=1,
        help="that many (2 = the steady state of a relay keeping two versions)",
    )
    ap.add_argument("--root-key", default="", help="root's CURVE key (hex): encrypt, with tickets")
    ap.add_argument("--trace", default="", help="write this relay's per-version trace here (JSON)")
    ap.add_argument(
        "--real-up-mbit",
        type=float,
        default=0.0,
        help="shape the uplink at this rate, whatever --up-mbit declares (a liar)",
    )
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = relay_parser().parse_args(argv)
    import logging  # relays log warnings (a failed punch, a lost link) to stderr

    logging.basicConfig(
        level=os.environ.get("ECHO_BENCH_LOG", "WARNING"),
        format=f"%(asctime)s {args.id} %(name)s: %(message)s",
    )
    return asyncio.run(relay_process(args))


if __name__ == "__main__":
    sys.exit(main())
