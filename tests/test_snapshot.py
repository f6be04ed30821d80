import pytest

from broadcast.snapshot import (RunKey, Snapshot, SnapshotError, build_manifest, verify_chunk,
                                verify_manifest)


def make(payload=bytes(range(256)) * 40, chunk=1000, key=None):
    key = key or RunKey.generate()
    m = build_manifest(run_id="r", version=3, tensors=[], payload=payload, chunk_size=chunk,
                       dtype="float32", key=key)
    return key, m, payload


def test_manifest_verifies_and_chunks_match():
    key, m, payload = make()
    verify_manifest(m, key.public_bytes)
    snap = Snapshot(m, payload)
    assert len(m["chunk_hashes"]) == 11  # 10240 bytes in 1000-byte chunks
    for i in range(11):
        verify_chunk(m, i, snap.chunk(i))
    assert bytes(snap.chunk(10)) == payload[10000:]


def test_wrong_key_or_tampered_manifest_refused():
    key, m, _ = make()
    with pytest.raises(SnapshotError, match="signature"):
        verify_manifest(m, RunKey.generate().public_bytes)
    m2 = dict(m, version=4)
    with pytest.raises(SnapshotError, match="signature"):
        verify_manifest(m2, key.public_bytes)


def test_corrupt_or_short_chunk_refused():
    key, m, payload = make()
    bad = bytearray(payload[:1000])
    bad[17] ^= 1
    with pytest.raises(SnapshotError, match="BLAKE3"):
        verify_chunk(m, 0, bytes(bad))
    with pytest.raises(SnapshotError, match="bytes"):
        verify_chunk(m, 0, payload[:999])


def test_key_round_trip():
    key = RunKey.generate()
    assert RunKey.from_bytes(key.private_bytes()).public_bytes == key.public_bytes


def test_relay_store_reuses_the_buffer_of_the_version_it_evicts():
    """A relay keeps two versions; the third's chunks go into the first's buffer, not into a
    fresh allocation (16 relays faulting in 64 MiB each cost 1 s of T_bcast on 2 cores)."""
    from broadcast.store import SnapshotBuffer, SnapshotStore

    key = RunKey.generate()
    m = [build_manifest(run_id="t", version=v, tensors=[], payload=bytes([v]) * 4096,
                        chunk_size=1024, dtype="uint8", key=key) for v in (1, 2, 3)]
    store = SnapshotStore(keep=2)
    bufs = [store.add(SnapshotBuffer(x, storage=store.storage_for(x))) for x in m[:2]]
    storage = store.storage_for(m[2])
    assert storage is bufs[0].payload  # v1's buffer, evicted first
    store.add(SnapshotBuffer(m[2], storage=storage))
    assert store.get(1) is None and store.get(2) is bufs[1]
    assert store.storage_for(m[1]) is None and store.get(2) is bufs[1]  # held: nothing evicted
    store.reserve(4096, 2)
    assert store.storage_for(m[0]) is not None and len(store._free) == 1
