"""The worker's base model in a LoRA run: from its cache, else fetched from the learner or a peer.

The learner of a LoRA run on a model folder sends the base model's signed manifest with the
join_ack (``echo_rl.broadcast.basemodel``). Before loading the model, the worker finds the folder:

  1. the cache (``$ECHO_HOME/base/<hash>/``, default ``~/.cache/echo/base``), when its files
     match every chunk hash of the manifest: nothing is fetched;
  2. else ``model.name``, when that folder exists on this machine (the volunteer put the model
     there): loaded as before, its content hash checked; not served to peers (its files may be
     other bytes than the learner's, though the weights hash alike);
  3. else a fetch: the learner names a source (a peer that holds the base, else itself;
     ``source_request`` with form "base"), every chunk is checked against the signed hashes
     (a corrupt chunk fails that source, is reported and the learner names another), the
     folder is written to the cache atomically.

In cases 1 and 3 the relay then serves the base to peers (``Relay.hold_base``) and the
heartbeats say so. After the load, the model's content hash must equal the manifest's
``base_model`` (``mismatch``); a cached folder that loads to another hash is removed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from echo_rl.broadcast.base_manifest import BaseManifest
from echo_rl.broadcast.basemodel import BaseCache
from echo_rl.broadcast.fetch import SourceFailed
from echo_rl.broadcast.relay import Relay
from echo_rl.broadcast.tickets import Source

log = logging.getLogger("echo.worker")

# (version, bad source, reason, failed chunk, form) -> a new source from the learner
AskSource = Callable[[int, str, str, int, str], Awaitable[Source]]


@dataclass
class BaseResult:
    folder: Path | None  # the folder to load; None: model.name, as the view says
    origin: str  # "cache", "fetched" or "model.name"
    fetched_bytes: int = 0  # base bytes received over the network (0 on a cache hit)
    chunks: int = 0
    sources: list[str] = field(default_factory=list)
    failures: list[tuple[str, str]] = field(default_factory=list)  # (source, reason)

    def line(self, manifest: BaseManifest) -> str:
        what = f"base model {manifest.base_model[:16]}..."
        if self.origin == "cache":
            return f"{what} found in the cache at {self.folder}: 0 bytes fetched"
        if self.origin == "model.name":
            return f"{what}: loading model.name from this machine, 0 bytes fetched"
        failed = f" ({len(self.failures)} sources failed: {self.failures})" if self.failures else ""
        return (
            f"{what} fetched: {self.fetched_bytes} bytes in {self.chunks} chunks from "
            f"{' then '.join(self.sources)}{failed}, cached at {self.folder}"
        )


async def obtain_base(
    manifest: BaseManifest,
    *,
    model_name: str,
    relay: Relay,
    ask: AskSource,
    cache: BaseCache | None = None,
) -> BaseResult:
    """Where the base model of a verified ``manifest`` (``verify_base_manifest``) is on this
    machine, fetching it if it is nowhere (module docstring); raises SnapshotError when it
    cannot be had."""
    cache = cache or BaseCache()
    hit = await asyncio.to_thread(cache.lookup, manifest)
    if hit is not None:
        relay.hold_base(manifest, hit[1])
        return BaseResult(hit[0], "cache")
    if Path(model_name).expanduser().is_dir():
        return BaseResult(None, "model.name")
    cache.room(manifest)

    async def reattach(bad: Source, fail: SourceFailed) -> Source:
        log.warning(
            "base model source %s failed (%s); asking the learner for another",
            bad.endpoint,
            fail.reason,
        )
        return await ask(manifest.version, bad.endpoint, fail.reason, fail.index, "base")

    first = await ask(manifest.version, "", "no_base", -1, "base")
    payload, stats = await relay.receive_base(manifest, first, reattach)
    folder = await asyncio.to_thread(cache.write, manifest, payload)
    relay.hold_base(manifest, payload)
    return BaseResult(folder, "fetched", stats.bytes, stats.chunks, stats.sources, stats.failures)


def mismatch(
    manifest: BaseManifest, held: str | None, result: BaseResult, cache: BaseCache | None = None
) -> str | None:
    """Why the loaded base cannot be used (None: it can): its content hash is not the
    manifest's. A folder from the cache or a fetch is removed (the next start fetches it)."""
    want = manifest.base_model
    if held == want:
        return None
    where = result.folder if result.folder is not None else "model.name"
    if result.origin != "model.name":
        (cache or BaseCache()).remove(manifest)
    return (
        f"the base model loaded from {where} hashes to {str(held)[:16]}..., the run's base "
        f"manifest says {want[:16]}... (signed by the learner): "
        + (
            "the folder was removed; start the worker again to fetch it"
            if result.origin != "model.name"
            else "model.name on this machine is another model; move it away so the worker "
            "fetches the learner's"
        )
    )


def refuse(err: Exception) -> str:
    return f"cannot get the run's base model: {err}"
