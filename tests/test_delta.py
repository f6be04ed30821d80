"""Delta snapshots: encodings, the signed result, keyframes, and peers that lie about them."""

import asyncio
from dataclasses import replace

import numpy as np
import pytest
import zmq
import zmq.asyncio

from echo_rl.broadcast.delta import DeltaError, decode, encode
from echo_rl.broadcast.fetch import SourceFailed
from echo_rl.broadcast.relay import Relay, RelayConfig
from echo_rl.broadcast.snapshot import (
    RunKey,
    SnapshotError,
    build_manifest,
    check_manifest,
    verify_manifest,
)
from echo_rl.broadcast.store import SnapshotBuffer
from echo_rl.broadcast.tickets import Source
from echo_rl.broadcast.versions import BaseMissing, VersionEncoder, rebuild
from labs.doubles import CorruptingRelay

CHUNK = 4096


def layout(*sizes, dtype="bfloat16", width=2):
    tensors, off = [], 0
    for i, n in enumerate(sizes):
        tensors.append(
            {"name": f"t{i}", "dtype": dtype, "shape": [n], "offset": off, "nbytes": n * width}
        )
        off += n * width
    return tensors, off


def perturb(base: bytes, fraction: float, seed: int, width: int = 2) -> bytes:
    """Flip the low bit of a ``fraction`` of the elements (a small RL step in bf16)."""
    rng = np.random.default_rng(seed)
    a = np.frombuffer(base, dtype={2: np.uint16, 4: np.uint32}[width]).copy()
    idx = rng.choice(a.size, int(a.size * fraction), replace=False)
    a[idx] ^= 1
    return a.tobytes()


def test_each_encoding_is_chosen_where_it_is_smallest_and_every_rebuild_is_bit_exact():
    tensors, size = layout(5000, 5000, 5000, 5000)
    rng = np.random.default_rng(0)
    base = rng.bytes(size)
    new = bytearray(base)
    q = size // 4
    # t0 unchanged; t1 a few elements; t2 most low bytes of every element; t3 all random
    new[q + 10 : q + 12] = b"\x01\x02"
    for i in range(2 * q, 3 * q, 2):
        new[i] ^= 0x01
    new[3 * q :] = rng.bytes(q)
    entries, payload, stats = encode(tensors, bytes(new), base)
    assert [e.enc for e in entries] == ["sparse", "sparse", "xor_lz4", "full"]
    assert entries[0].dlen == 0 and entries[1].dlen == 4 + 2
    assert bytes(decode(entries, payload, base, size)) == bytes(new)
    assert stats.changed == 1 + 5000 + int(
        np.count_nonzero(
            np.frombuffer(bytes(new[3 * q :]), np.uint16) != np.frombuffer(base[3 * q :], np.uint16)
        )
    )
    assert stats.payload_bytes == len(payload) < size


@pytest.mark.parametrize("threads", [2, 3, 7, 50])
def test_an_encode_on_several_threads_is_the_same_bytes_and_counts(threads):
    """The tensors split into runs encoded at once (issue 50: the publication's build on the
    host's cores); nothing in the result depends on how many."""
    tensors, size = layout(5000, 17, 9000, 1, 3000, 5000, 12)
    rng = np.random.default_rng(1)
    base = rng.bytes(size)
    new = bytearray(perturb(base, 0.01, 2))
    new[: 5000 * 2] = rng.bytes(5000 * 2)  # one tensor all new: full
    one = encode(tensors, bytes(new), base)
    many = encode(tensors, bytes(new), base, threads)
    assert many[0] == one[0] and many[1] == one[1]  # entries (enc, doff, dlen) and payload
    for k in ("elements", "changed", "full_bytes", "sizes", "chosen", "payload_bytes"):
        assert getattr(many[2], k) == getattr(one[2], k), k
    assert bytes(decode(many[0], many[1], base, size)) == bytes(new)


def test_bits_not_values_nan_and_negative_zero_round_trip():
    tensors, size = layout(4, dtype="float32", width=4)
    base = np.array([0.0, 1.0, np.nan, 2.0], dtype=np.float32).tobytes()
    new = np.array([-0.0, 1.0, np.float32("nan"), 2.0], dtype=np.float32)
    new_bytes = bytearray(new.tobytes())
    new_bytes[8] ^= 0x01  # another NaN payload: unequal bits, "equal" as NaNs
    entries, payload, stats = encode(tensors, bytes(new_bytes), base)
    assert stats.changed == 2  # -0.0 vs 0.0, and the NaN's payload
    assert bytes(decode(entries, payload, base, size)) == bytes(new_bytes)


@pytest.mark.parametrize(
    "damage, match",
    [
        (lambda e, p: (replace(e, doff=len(p) + 10), p), "outside"),
        (lambda e, p: (replace(e, dlen=e.dlen - 1), p), "whole number"),
        (lambda e, p: (e, b"\xff" * 4 + p[4:]), "beyond"),
    ],
)
def test_a_hostile_sparse_slice_is_refused_not_written_outside(damage, match):
    tensors, size = layout(100)
    base = bytes(size)
    new = bytearray(base)
    new[6] = 7
    entries, payload, _ = encode(tensors, bytes(new), base)
    assert entries[0].enc == "sparse"
    entry, payload = damage(entries[0], payload)
    with pytest.raises(DeltaError, match=match):
        decode([entry], payload, base, size)


def test_a_corrupt_lz4_block_is_a_delta_error():
    tensors, size = layout(4000)
    base = bytes(size)
    new = perturb(base, 0.3, 1)
    entries, payload, _ = encode(tensors, new, base)
    assert entries[0].enc == "xor_lz4"
    with pytest.raises(DeltaError, match="LZ4"):
        decode(entries, b"\x00" * len(payload), base, size)


def test_a_delta_manifest_signs_the_result_and_names_its_base():
    key = RunKey.generate()
    tensors, size = layout(3000, 3000)
    enc = VersionEncoder(run_id="r", key=key, chunk_size=CHUNK, dtype="bfloat16")
    base = np.random.default_rng(2).bytes(size)
    first = enc.build(0, tensors, base)
    pub = enc.build(1, tensors, perturb(base, 0.01, 3))
    m = pub.manifest
    assert first.manifest.encoding == "full" and m.encoding == "delta"
    assert m.base_version == 0 and m.result_size == size
    assert verify_manifest(m.to_wire(), key.public_bytes) == m
    raw = m.to_wire()  # forged and malformed maps below, on purpose
    forged = dict(raw, result_hashes=list(reversed(m.result_hashes)))
    with pytest.raises(SnapshotError, match="signature"):
        verify_manifest(forged, key.public_bytes)
    t0 = m.tensors[0].to_wire()
    for bad, match in [
        (dict(raw, base_version=1), "base_version"),
        (dict(first.manifest.to_wire(), base_version=0), "base_version"),
        (dict(raw, tensors=[dict(t0, enc="zstd")]), "encoding"),
        (dict(raw, tensors=[dict(t0, doff=m.payload_size)]), "dlen"),
    ]:
        with pytest.raises(SnapshotError, match=match):
            check_manifest(bad)


def test_keyframes_every_k_and_when_a_delta_would_not_save():
    key = RunKey.generate()
    tensors, size = layout(2000)
    enc = VersionEncoder(
        run_id="r", key=key, chunk_size=CHUNK, dtype="bfloat16", keyframe_every=3, max_ratio=0.5
    )
    payloads = [np.random.default_rng(9).bytes(size)]
    for v in range(1, 7):
        payloads.append(perturb(payloads[-1], 0.01, v))
    kinds = [enc.build(v, tensors, p).manifest.encoding for v, p in enumerate(payloads)]
    assert kinds == ["full", "delta", "delta", "full", "delta", "delta", "full"]
    noisy = np.random.default_rng(10).bytes(size)  # every element changes: a keyframe
    assert enc.build(7, tensors, noisy).manifest.encoding == "full"
    off = VersionEncoder(run_id="r", key=key, chunk_size=CHUNK, dtype="bfloat16", delta=False)
    assert {off.build(v, tensors, p).manifest.encoding for v, p in enumerate(payloads)} == {"full"}


def test_rebuild_needs_the_very_base_and_proves_the_result():
    key = RunKey.generate()
    tensors, size = layout(5000)
    enc = VersionEncoder(run_id="r", key=key, chunk_size=CHUNK, dtype="bfloat16")
    v0 = np.random.default_rng(4).bytes(size)
    v1 = perturb(v0, 0.02, 5)
    enc.build(0, tensors, v0)
    pub = enc.build(1, tensors, v1)
    assert bytes(rebuild(pub.manifest, pub.payload, v0)) == v1
    with pytest.raises(BaseMissing):
        rebuild(pub.manifest, pub.payload, None)
    other_base = perturb(v0, 0.01, 6)  # not the learner's v0: the signed result hashes say so
    with pytest.raises(SnapshotError, match="differs from the learner's"):
        rebuild(pub.manifest, pub.payload, other_base)


async def _run(body, timeout=30):
    ctx = zmq.asyncio.Context()
    try:
        return await asyncio.wait_for(body(ctx), timeout)
    finally:
        ctx.destroy(linger=0)


def _relay(ctx, corrupt=False, **kw):
    kind = CorruptingRelay if corrupt else Relay
    return kind(ctx, RelayConfig(window=3, timeout_s=5.0, chunk_bytes=CHUNK, **kw))


def _two_versions():
    key = RunKey.generate()
    tensors, size = layout(40 * CHUNK // 2 + 77)
    enc = VersionEncoder(run_id="r", key=key, chunk_size=CHUNK, dtype="bfloat16")
    v0 = np.random.default_rng(7).bytes(size)
    v1 = perturb(v0, 0.01, 8)
    enc.build(0, tensors, v0)
    return key, enc.build(1, tensors, v1)


def test_a_worker_without_the_base_gets_a_keyframe_from_a_peer_and_a_lying_peer_is_caught():
    key, pub = _two_versions()

    async def body(ctx):
        holder, liar, late = _relay(ctx), _relay(ctx, corrupt=True), _relay(ctx)
        for r in (holder, liar):
            r.hold_result(pub.manifest, pub.result)  # both installed v1
        asked = []

        async def reattach(bad: Source, fail: SourceFailed) -> Source:
            asked.append((bad.endpoint, fail.reason))
            return Source(holder.endpoint)

        async with asyncio.TaskGroup() as tg:
            servers = [tg.create_task(r.serve_forever()) for r in (holder, liar)]
            result, stats = await late.receive_keyframe(
                pub.manifest, Source(liar.endpoint), reattach
            )
            for t in servers:
                t.cancel()
        return result, stats, asked, liar.server.rejected

    result, stats, asked, _ = asyncio.run(_run(body))
    assert bytes(result) == pub.result  # bit-exact, from the honest peer
    assert asked == [(asked[0][0], "corrupt")] and stats.sources[-1] != stats.sources[0]


def test_a_keyframe_request_for_a_version_not_held_is_refused_with_its_reason():
    key, pub = _two_versions()

    async def body(ctx):
        empty, late = _relay(ctx), _relay(ctx)
        async with asyncio.TaskGroup() as tg:
            server = tg.create_task(empty.serve_forever())
            with pytest.raises(SnapshotError, match="unknown_version"):
                await late.receive_keyframe(pub.manifest, Source(empty.endpoint), None)
            server.cancel()
        return empty.server.rejected

    rejected = asyncio.run(_run(body))
    assert rejected["unknown_version"] >= 1 and set(rejected) == {"unknown_version"}


def test_a_full_payload_held_as_a_keyframe_is_never_recycled_under_it():
    """The relay's receive buffers are recycled for later versions: the installed version's
    full payload must be a buffer of its own, or a later receive would overwrite a keyframe."""
    key = RunKey.generate()
    tensors, size = layout(3 * CHUNK)

    async def body(ctx):
        r = _relay(ctx)
        m = build_manifest(
            run_id="r",
            version=0,
            tensors=tensors,
            payload=bytes(size),
            chunk_size=CHUNK,
            dtype="bfloat16",
            key=key,
        )
        buf = r.store.add(SnapshotBuffer(m, storage=bytearray(size)))
        r.hold_result(m, buf.payload)
        held = r.results.get(0)
        return (
            held.payload is not buf.payload and r.base_for(replace(m, base_version=0)) is not None
        )

    assert asyncio.run(_run(body))


def test_keyframes_come_from_peers_that_installed_the_version_spread_and_never_twice_from_a_failure():
    from echo_rl.broadcast.coordinator import Coordinator
    from echo_rl.broadcast.topology import make_topology

    coord = Coordinator(make_topology("chains"), "tcp://learner")
    for w in ("a", "b", "c", "late"):
        coord.join(w, f"tcp://{w}" if w != "c" else "")  # c is behind NAT: serves nobody
    coord.publish(5, now=0.0)
    for w in ("a", "b", "c"):
        coord.installed(w, 5, now=1.0)
    first, second = coord.keyframe_source("late", 5), coord.keyframe_source("late", 5)
    assert {first, second} == {"tcp://a", "tcp://b"}  # spread over the holders that serve
    # a holder that failed to serve it (lied about its install, or left) is not asked again
    assert coord.keyframe_source("late", 5, bad_source="tcp://a") == "tcp://b"
    assert coord.keyframe_source("late", 5, bad_source="tcp://b") == "tcp://learner"
    assert coord.keyframe_source("late", 4) == "tcp://learner"  # nobody installed v4


@pytest.mark.parametrize(
    "fields",
    [
        {"type": "chunk_request", "version": 1, "index": 0, "form": "evil"},
        {"type": "chunk_request", "version": 1, "index": 0, "form": 7},
        {
            "type": "source_request",
            "worker_id": "w",
            "version": 1,
            "bad_source": "",
            "reason": "x",
            "form": "keyframe-please",
        },
        {"type": "installed", "worker_id": "w", "version": 1, "decode_s": -1.0},
        {"type": "installed", "worker_id": "w", "version": 1, "decode_s": 1e12},
        {"type": "installed", "worker_id": "w", "version": 1, "keyframe": "yes"},
    ],
)
def test_junk_in_the_delta_fields_is_a_counted_wire_error(fields):
    import msgpack

    from echo_rl.core import wire

    frame = msgpack.packb({"v": wire.WIRE_VERSION, "rid": 1, **fields}, use_bin_type=True)
    with pytest.raises(wire.WireError) as err:
        wire.decode(frame, 1 << 20)
    assert err.value.reason in ("invalid_fields", "malformed")


def test_a_spilling_relay_serves_a_full_version_from_its_spilled_copy_and_frees_the_buffer(
    tmp_path,
):
    """With a spill directory the installed version's full payload goes to a file (its map is
    read-only), and the snapshot store serves that version's chunks from the same map: the
    receive buffer is no longer held (docs/memory.md)."""
    import mmap

    key = RunKey.generate()
    tensors, size = layout(3 * CHUNK)
    data = np.random.default_rng(3).bytes(size)

    async def body(ctx):
        r = _relay(ctx, spill_dir=str(tmp_path))
        m = build_manifest(
            run_id="r",
            version=0,
            tensors=tensors,
            payload=data,
            chunk_size=CHUNK,
            dtype="bfloat16",
            key=key,
        )
        buf = r.store.add(SnapshotBuffer(m, storage=bytearray(data)))
        for i in range(buf.total):
            buf.mark(i)
        received = buf.payload
        r.hold_result(m, received)
        held = r.results.get(0).payload
        served = r.store.get(0)
        return (
            isinstance(held, mmap.mmap),
            served.payload is held,
            bytes(served.chunk(1)),
            r.store.holds(received),
        )

    spilled, shared, chunk, still_held = asyncio.run(_run(body))
    assert spilled and shared and not still_held
    assert chunk == data[CHUNK : 2 * CHUNK]
