import blake3
import msgpack
import pytest

from echo_rl.broadcast.base_manifest import parse_base_manifest
from echo_rl.broadcast.manifest import Manifest, parse_manifest
from echo_rl.broadcast.snapshot import (
    RunKey,
    Snapshot,
    SnapshotError,
    build_manifest,
    verify_manifest,
)


def make(payload=bytes(range(256)) * 40, chunk=1000, key=None):
    key = key or RunKey.generate()
    m = build_manifest(
        run_id="r",
        version=3,
        tensors=[],
        payload=payload,
        chunk_size=chunk,
        dtype="float32",
        key=key,
    )
    return key, m, payload


def test_manifest_verifies_and_chunks_match():
    key, m, payload = make()
    assert verify_manifest(m.to_wire(), key.public_bytes) == m
    snap = Snapshot(m, payload)
    assert m.layout.num_chunks == 11  # 10240 bytes in 1000-byte chunks
    for i in range(11):
        m.layout.verify_chunk(i, snap.chunk(i))
    assert bytes(snap.chunk(10)) == payload[10000:]


def test_wrong_key_or_tampered_manifest_refused():
    key, m, _ = make()
    with pytest.raises(SnapshotError, match="signature"):
        verify_manifest(m.to_wire(), RunKey.generate().public_bytes)
    m2 = dict(m.to_wire(), version=4)  # tampered on purpose
    with pytest.raises(SnapshotError, match="signature"):
        verify_manifest(m2, key.public_bytes)


def test_corrupt_or_short_chunk_refused():
    key, m, payload = make()
    bad = bytearray(payload[:1000])
    bad[17] ^= 1
    with pytest.raises(SnapshotError, match="BLAKE3"):
        m.layout.verify_chunk(0, bytes(bad))
    with pytest.raises(SnapshotError, match="bytes"):
        m.layout.verify_chunk(0, payload[:999])


def test_key_round_trip():
    key = RunKey.generate()
    assert RunKey.from_bytes(key.private_bytes()).public_bytes == key.public_bytes


def test_relay_store_reuses_the_buffer_of_the_version_it_evicts():
    """A relay keeps two versions; the third's chunks go into the first's buffer, not into a
    fresh allocation (16 relays faulting in 64 MiB each cost 1 s of T_bcast on 2 cores)."""
    from echo_rl.broadcast.store import SnapshotBuffer, SnapshotStore

    key = RunKey.generate()
    m = [
        build_manifest(
            run_id="t",
            version=v,
            tensors=[],
            payload=bytes([v]) * 4096,
            chunk_size=1024,
            dtype="uint8",
            key=key,
        )
        for v in (1, 2, 3)
    ]
    store = SnapshotStore(keep=2)
    bufs = [store.add(SnapshotBuffer(x, storage=store.storage_for(x.layout))) for x in m[:2]]
    storage = store.storage_for(m[2].layout)
    assert storage is bufs[0].payload  # v1's buffer, evicted first
    store.add(SnapshotBuffer(m[2], storage=storage))
    assert store.get(1) is None and store.get(2) is bufs[1]
    assert store.storage_for(m[1].layout) is None and store.get(2) is bufs[1]  # held: no eviction
    store.reserve(4096, 2)
    assert store.storage_for(m[0].layout) is not None and len(store._free) == 1


# BLAKE3 of the msgpack of each signed wire map below, as the learner at d69496e (before the
# manifest was a declared type) built them: the one serialiser must keep these bytes, so old and
# new learners and workers verify each other's manifests.
PINNED = {
    "full": "397e477354e67158d9ed283b06adb3b2cec4645340e0df619615d193e1e2c260",
    "lora": "832111a1a969a79853c9f0d6fb3762afb27056261bfd21bb83b57f0c877fbddc",
    "delta": "fe49a208cad74cd0099f7c990e97d8136e6ae9b605bb5e15fc506f1b179b4442",
    "base": "b29e0dbb68a88b68218933c5ca0371186cbe8e3e3ebf7c8d2524d12fde7ebaa8",
}


def _pinned_manifests(tmp_path):
    from echo_rl.broadcast.basemodel import build_base_manifest

    key = RunKey.from_bytes(bytes(range(32)))  # Ed25519 signs deterministically
    payload = bytes(range(256)) * 4
    tensors = [
        {"name": "w", "dtype": "float32", "shape": [8, 16], "offset": 0, "nbytes": 512},
        {"name": "b", "dtype": "bfloat16", "shape": [256], "offset": 512, "nbytes": 512},
    ]
    entries = [
        {**tensors[0], "enc": "xor_lz4", "doff": 0, "dlen": 100},
        {**tensors[1], "enc": "sparse", "doff": 100, "dlen": 20},
    ]
    common = {"run_id": "pin", "dtype": "bfloat16", "key": key}
    (tmp_path / "config.json").write_text('{"a": 1}')
    (tmp_path / "model.safetensors").write_bytes(bytes(range(200)))
    return key, {
        "full": build_manifest(
            version=3, tensors=tensors, payload=payload, chunk_size=300, **common
        ),
        "lora": build_manifest(
            version=4,
            tensors=tensors,
            payload=payload,
            chunk_size=300,
            base_model="ab" * 32,
            **common,
        ),
        "delta": build_manifest(
            version=5,
            tensors=entries,
            payload=payload[:120],
            chunk_size=64,
            base_version=4,
            result=payload,
            **common,
        ),
        "base": build_base_manifest(
            run_id="pin", base_model="cd" * 32, folder=tmp_path, chunk_size=64, key=key
        )[0],
    }


def test_signed_bytes_of_fixed_manifests_are_pinned(tmp_path):
    """The wire map (signature included) of a fixed manifest of each kind is byte for byte
    what the learner sent before the declared type, and parses back to the same object."""
    key, built = _pinned_manifests(tmp_path)
    for name, m in built.items():
        wire = m.to_wire()
        assert blake3.blake3(msgpack.packb(wire, use_bin_type=True)).hexdigest() == PINNED[name]
        received = msgpack.unpackb(msgpack.packb(wire, use_bin_type=True), raw=False)
        parse = parse_base_manifest if name == "base" else parse_manifest
        assert parse(received) == m
        assert m.signed_bytes() == msgpack.packb(
            {k: v for k, v in received.items() if k != "signature"}, use_bin_type=True
        )
    assert isinstance(built["delta"], Manifest) and built["delta"].tensors[1].enc == "sparse"


def test_manifest_in_another_key_order_verifies_as_signed():
    """The signature is checked over the map as it arrived: a learner that wrote the keys in
    another order (signing that order) is still verified, and the fields read the same."""
    key = RunKey.generate()
    m = build_manifest(
        run_id="r", version=1, tensors=[], payload=b"x" * 10, chunk_size=4, dtype="uint8", key=key
    )
    reordered = dict(reversed(list(m.to_wire().items())))
    del reordered["signature"]
    reordered["signature"] = key.sign(msgpack.packb(reordered, use_bin_type=True))
    got = verify_manifest(reordered, key.public_bytes)
    assert (got.version, got.chunk_hashes, got.payload_size) == (1, m.chunk_hashes, 10)
