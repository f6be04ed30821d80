"""The base model of a LoRA run travels once (issue 32, item 3): a signed, chunked snapshot of
its own kind (echo_rl.broadcast.basemodel), fetched from a peer or the learner over the chunk servers,
every chunk checked, cached on disk by content hash (echo_rl.worker.base)."""

from __future__ import annotations

import asyncio
import os
from dataclasses import replace
from pathlib import Path

import pytest
import zmq.asyncio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_security import zctx  # noqa: F401  (a fixture)

from echo_rl.broadcast.basemodel import (
    BaseCache,
    build_base_manifest,
    check_base_manifest,
    verify_base_manifest,
)
from echo_rl.broadcast.coordinator import Coordinator
from echo_rl.broadcast.manifest import signed_bytes
from echo_rl.broadcast.relay import Relay, RelayConfig
from echo_rl.broadcast.snapshot import (
    RunKey,
    Snapshot,
    SnapshotError,
    build_manifest,
    verify_manifest,
)
from echo_rl.broadcast.tickets import Source
from echo_rl.broadcast.topology import make_topology
from echo_rl.worker.base import BaseResult, mismatch, obtain_base
from labs.doubles import CorruptingRelay

pytestmark = pytest.mark.timeout(60)

HASH = "ab" * 32
CHUNK = 4096


def model_folder(root: Path, size: int = 50_000) -> Path:
    folder = root / "smol"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text('{"model_type": "qwen3"}')
    (folder / "tokenizer.json").write_text('{"version": "1.0"}')
    (folder / "model.safetensors").write_bytes(os.urandom(size))
    (folder / "notes.py").write_text("print('not part of a model')")  # not a model file
    (folder / "sub").mkdir()  # subfolders do not travel
    return folder


@pytest.fixture
def base(tmp_path):
    key = RunKey.generate()
    manifest, payload = build_base_manifest(
        run_id="r1", base_model=HASH, folder=model_folder(tmp_path), chunk_size=CHUNK, key=key
    )
    return key, manifest, payload


def test_base_manifest_signed_and_cached_whole_by_hash(base, tmp_path):
    key, manifest, payload = base
    assert verify_base_manifest(manifest.to_wire(), key.public_bytes, "r1") == manifest
    assert [f.name for f in manifest.files] == [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
    ]
    assert len(manifest.chunk_hashes) == -(-len(payload) // CHUNK)
    cache = BaseCache(tmp_path / "cache")
    assert cache.lookup(manifest) is None  # a miss
    folder = cache.write(manifest, payload)
    assert folder == tmp_path / "cache" / HASH
    assert sorted(p.name for p in folder.iterdir()) == [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
    ]
    hit = cache.lookup(manifest)
    assert hit is not None and hit[0] == folder and bytes(hit[1]) == payload
    # a new run on the same base (another key, run id and chunk size) finds it too
    again, _ = build_base_manifest(
        run_id="r2",
        base_model=HASH,
        folder=tmp_path / "smol",
        chunk_size=CHUNK * 3,
        key=RunKey.generate(),
    )
    assert cache.lookup(again)[0] == folder
    # A damaged cache is no hit: it is removed, and the worker fetches again.
    blob = folder / "model.safetensors"
    data = bytearray(blob.read_bytes())
    data[100] ^= 1
    blob.write_bytes(bytes(data))
    assert cache.lookup(manifest) is None and not folder.exists()


def test_forged_or_hostile_base_manifests_are_refused(base):
    key, typed, _ = base
    raw = typed.to_wire()  # altered below into hostile maps on purpose
    # another base hash than the learner signed: the signature fails
    with pytest.raises(SnapshotError, match="Ed25519"):
        verify_base_manifest({**raw, "base_model": "cd" * 32}, key.public_bytes)
    with pytest.raises(SnapshotError, match="Ed25519"):
        verify_base_manifest(raw, RunKey.generate().public_bytes)
    with pytest.raises(SnapshotError, match="of run"):
        verify_base_manifest(raw, key.public_bytes, "another-run")

    def signed(**changes):
        m = {k: v for k, v in raw.items() if k != "signature"} | changes
        return {**m, "signature": key.sign(signed_bytes(m))}

    files = raw["files"]
    # even signed: no file name that leaves the cache folder, files that tile the payload
    for bad in ("../evil.json", "a/b.json", ".hidden", ""):
        with pytest.raises(SnapshotError, match="plain file"):
            check_base_manifest(signed(files=[{**files[0], "name": bad}, *files[1:]]))
    with pytest.raises(SnapshotError, match="cover"):
        check_base_manifest(signed(files=files[:-1]))
    with pytest.raises(SnapshotError, match="twice"):
        check_base_manifest(
            signed(files=[files[0], {**files[1], "name": files[0]["name"]}, files[2]])
        )
    # neither kind verifies as the other
    with pytest.raises(SnapshotError):
        verify_manifest(raw, key.public_bytes)
    with pytest.raises(SnapshotError, match="kind"):
        check_base_manifest({k: v for k, v in raw.items() if k != "kind"})


async def _serve(relays):
    return [asyncio.create_task(r.serve_forever()) for r in relays]


def test_base_fetched_from_peers_corrupt_relay_routed_around_then_cached(base, tmp_path):
    """Worker 1 is sent to a relay that alters every chunk: the hash catches it, the source is
    reported corrupt with the chunk, and the learner's next source (an honest peer) serves it.
    Worker 2 on the same cache fetches nothing; worker 3 (empty cache) fetches from worker 1."""
    key, manifest, payload = base

    async def run():
        ctx = zmq.asyncio.Context()
        honest, corrupt = Relay(ctx, RelayConfig()), CorruptingRelay(ctx, RelayConfig())
        honest.hold_base(manifest, payload)
        corrupt.hold_base(manifest, payload)
        workers = [Relay(ctx, RelayConfig()) for _ in range(3)]
        tasks = await _serve([honest, corrupt, *workers])
        asks = []

        def asker(plan):
            async def ask(version, bad, reason, chunk, form):
                asks.append((bad, reason, chunk, form))
                return Source(plan.pop(0))

            return ask

        try:
            cache1 = BaseCache(tmp_path / "home1")
            r1 = await obtain_base(
                manifest,
                model_name=str(tmp_path / "absent"),
                relay=workers[0],
                ask=asker([corrupt.endpoint, honest.endpoint]),
                cache=cache1,
            )
            assert r1.origin == "fetched" and r1.fetched_bytes == len(payload)
            assert r1.failures == [(corrupt.endpoint, "corrupt")]
            assert asks[0] == ("", "no_base", -1, "base")
            assert asks[1][:2] == (corrupt.endpoint, "corrupt") and asks[1][2] >= 0
            assert (r1.folder / "model.safetensors").read_bytes() == payload[
                manifest.files[1].offset :
            ][: manifest.files[1].nbytes]
            assert workers[0].holds_base
            asks.clear()
            r2 = await obtain_base(
                manifest, model_name="absent", relay=workers[1], ask=asker([]), cache=cache1
            )
            assert (r2.origin, r2.fetched_bytes, asks) == ("cache", 0, [])
            assert workers[1].holds_base  # a cache hit serves peers too
            r3 = await obtain_base(
                manifest,
                model_name="absent",
                relay=workers[2],
                ask=asker([workers[0].endpoint]),
                cache=BaseCache(tmp_path / "home3"),
            )
            assert r3.sources == [workers[0].endpoint] and r3.fetched_bytes == len(payload)
            assert workers[0].server.rejected == {}
        finally:
            for t in tasks:
                t.cancel()
            for r in (honest, corrupt, *workers):
                r.close()
            ctx.term()

    asyncio.run(asyncio.wait_for(run(), 30))


def test_a_worker_holding_model_name_fetches_nothing_and_serves_nothing(base, tmp_path):
    key, manifest, _ = base

    async def run():
        ctx = zmq.asyncio.Context()
        relay = Relay(ctx, RelayConfig(serve=False))

        async def ask(*_):
            raise AssertionError("no fetch")

        try:
            r = await obtain_base(
                manifest,
                model_name=str(tmp_path / "smol"),
                relay=relay,
                ask=ask,
                cache=BaseCache(tmp_path / "empty"),
            )
            assert (r.origin, r.folder, r.fetched_bytes, relay.holds_base) == (
                "model.name",
                None,
                0,
                False,
            )
        finally:
            relay.close()
            ctx.term()

    asyncio.run(asyncio.wait_for(run(), 10))


def test_a_loaded_base_of_another_hash_is_refused_and_uncached(base, tmp_path):
    _, manifest, payload = base
    cache = BaseCache(tmp_path / "c")
    folder = cache.write(manifest, payload)
    assert mismatch(manifest, HASH, BaseResult(folder, "cache"), cache) is None
    problem = mismatch(manifest, "ef" * 32, BaseResult(folder, "cache"), cache)
    assert "hashes to efefefef" in problem and "removed" in problem and not folder.exists()
    problem = mismatch(manifest, "ef" * 32, BaseResult(None, "model.name"), cache)
    assert "another model" in problem


def test_free_disk_bounds_a_fetch(base, tmp_path):
    _, manifest, _ = base
    with pytest.raises(SnapshotError, match="GiB"):
        BaseCache(tmp_path).room(replace(manifest, payload_size=1 << 60))


def test_base_source_is_a_holding_peer_else_the_learner():
    coord = Coordinator(make_topology("chains"), "tcp://learner:1")
    for w in ("a", "b", "c"):
        coord.join(w, f"tcp://{w}:1")
    assert coord.base_source("c") == "tcp://learner:1"  # nobody holds it yet
    coord.holds_base("a", True)
    coord.holds_base("b", True)
    first = coord.base_source("c")
    assert first in ("tcp://a:1", "tcp://b:1")
    assert coord.base_source("c") != first  # spread over the holders
    assert coord.base_source("a") == "tcp://b:1"  # never itself
    assert coord.base_source("c", bad_source="tcp://b:1") == "tcp://a:1"  # not the failed one
    coord.holds_base("a", False)
    assert coord.base_source("c") == "tcp://learner:1"


def test_the_learner_hands_out_the_base_and_its_sources_and_bans_a_corrupt_relay(
    small_cfg, tokenizer, tmp_path, zctx
):  # noqa: F811
    """join_ack carries the signed base manifest; source requests of form "base" go to the
    learner until a peer says (heartbeat) it holds the base, then to that peer. The peer's
    relay alters every chunk: the child reports the chunk that failed its hash, is sent
    elsewhere, and the learner's own probe of that chunk (form "base") convicts and bans it."""
    import contextlib
    import threading

    from test_security import _plane, ask, eventually, peer

    from echo_rl.core import wire
    from echo_rl.core.security import KeyPair

    small_cfg.broadcast.nat_traversal = False  # relay endpoints are trusted: "reachable"
    plane = _plane(small_cfg, tokenizer, tmp_path / "run")
    manifest, payload = build_base_manifest(
        run_id="t", base_model=HASH, folder=model_folder(tmp_path), chunk_size=CHUNK, key=plane.key
    )
    plane.hold_base(manifest, payload)
    plane.start()
    keys = KeyPair.generate()
    loop = asyncio.new_event_loop()
    actx = zmq.asyncio.Context()
    liar = CorruptingRelay(actx, RelayConfig(), keys=keys, run_key=lambda: plane.key.public_bytes)
    liar.hold_base(manifest, payload)

    async def serve():
        with contextlib.suppress(asyncio.CancelledError):
            await liar.serve_forever()

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    try:
        holder, late = peer(plane, zctx, keys=keys), peer(plane, zctx)
        ack = ask(holder, wire.Join(worker_id="a", relay_endpoint=liar.endpoint))
        assert isinstance(ack, wire.JoinAck) and ack.base_manifest == manifest.to_wire()
        assert verify_base_manifest(ack.base_manifest, ack.public_key, ack.run_id) == manifest
        grant = ask(
            holder,
            wire.SourceRequest(
                worker_id="a", version=0, bad_source="", reason="no_base", form="base"
            ),
        )
        assert grant.source == plane.snapshot_endpoint  # nobody else holds it yet
        # a member (it installed a version), holding the base
        policy = build_manifest(
            run_id="t",
            version=0,
            tensors=[],
            payload=b"x" * 64,
            chunk_size=64,
            dtype="uint8",
            key=plane.key,
        )
        plane.publish(Snapshot(policy, b"x" * 64))
        holder.send(wire.encode(wire.Installed(worker_id="a", version=0)))
        ask(holder, wire.Heartbeat(worker_id="a", version=0, base=True))

        ask(late, wire.Join(worker_id="b", can_relay=False))
        grant = ask(
            late,
            wire.SourceRequest(
                worker_id="b", version=0, bad_source="", reason="no_base", form="base"
            ),
        )
        assert grant.source == liar.endpoint  # the peer, not the learner
        grant = ask(
            late,
            wire.SourceRequest(
                worker_id="b",
                version=0,
                reason="corrupt",
                chunk=3,
                bad_source=liar.endpoint,
                form="base",
            ),
        )
        assert grant.source == plane.snapshot_endpoint  # not the accused again
        assert eventually(lambda: plane.rejected["relay_corrupt"] == 1, 20)  # probed, banned
        assert plane.rejected["unfounded_report"] == 0
    finally:
        plane.shutdown("test over")
        loop.call_soon_threadsafe(lambda: [t.cancel() for t in asyncio.all_tasks(loop)])
        thread.join(5)
        loop.close()
        liar.close()
        actx.destroy(linger=0)


def test_a_run_without_a_base_refuses_base_sources(small_cfg, tokenizer, tmp_path, zctx):  # noqa: F811
    from test_security import _plane, ask, peer

    from echo_rl.core import wire

    plane = _plane(small_cfg, tokenizer, tmp_path / "run")
    plane.start()
    try:
        w = peer(plane, zctx)
        assert ask(w, wire.Join(worker_id="a")).base_manifest is None
        reply = ask(
            w,
            wire.SourceRequest(
                worker_id="a", version=0, bad_source="", reason="no_base", form="base"
            ),
        )
        assert isinstance(reply, wire.Error) and reply.reason == "no_base"
    finally:
        plane.shutdown("test over")


_ANY = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(),
    st.text(max_size=8),
    st.binary(max_size=40),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)
_FILE = st.fixed_dictionaries(
    {
        "name": st.one_of(st.text(max_size=12), _ANY),
        "offset": st.one_of(st.integers(-5, 60_000), _ANY),
        "nbytes": st.one_of(st.integers(-5, 60_000), _ANY),
    }
)


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    over=st.dictionaries(
        st.sampled_from(
            [
                "schema",
                "kind",
                "run_id",
                "version",
                "base_model",
                "files",
                "payload_size",
                "chunk_size",
                "chunk_hashes",
                "form",
                "signature",
            ]
        ),
        st.one_of(_ANY, st.lists(_FILE, max_size=4)),
        max_size=3,
    )
)
def test_any_base_manifest_is_refused_or_keeps_its_files_inside_the_payload(base, over):
    """A manifest of any shape is refused with a SnapshotError, or every file it lists is a
    plain name inside the payload (the cache writes nothing outside its folder)."""
    _, manifest, _ = base
    m = {**manifest.to_wire(), **over}  # hostile on purpose
    try:
        got = check_base_manifest(m)
    except SnapshotError:
        return
    at = 0
    for f in got.files:
        assert "/" not in f.name and not f.name.startswith(".") and f.offset == at
        at += f.nbytes
    assert at == got.payload_size and len(got.chunk_hashes) == -(-at // got.chunk_size)
