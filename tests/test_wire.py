import lz4.frame
import msgpack
import pytest

from echo import wire


def test_round_trip_every_request():
    msgs = [wire.Join(worker_id="w1", price=0.35), wire.Heartbeat(worker_id="w1", version=3),
            wire.WorkRequest(worker_id="w1", max_groups=2),
            wire.Trajectories(worker_id="w1", batch_id="b", count=0, payload=wire.pack_records([])),
            wire.Leave(worker_id="w1"), wire.ChunkRequest(version=1, index=0, rid=7)]
    for m in msgs:
        back = wire.decode(wire.encode(m), 1 << 20)
        assert type(back) is type(m) and back == m


@pytest.mark.parametrize("frame,reason", [
    (b"\xc1\xff junk", "malformed"),
    (msgpack.packb([1, 2, 3]), "malformed"),
    (msgpack.packb({"v": 99, "type": "join", "worker_id": "w"}), "wrong_version"),
    (msgpack.packb({"v": wire.WIRE_VERSION, "type": "nope"}), "unknown_type"),
    (msgpack.packb({"v": wire.WIRE_VERSION, "type": "join"}), "invalid_fields"),
    (msgpack.packb({"v": wire.WIRE_VERSION, "type": "join", "worker_id": "w", "extra": 1}), "invalid_fields"),
    (msgpack.packb({"v": wire.WIRE_VERSION, "type": "work_request", "worker_id": "w", "max_groups": 0}), "invalid_fields"),
])
def test_decode_rejects_with_reason(frame, reason):
    with pytest.raises(wire.WireError) as e:
        wire.decode(frame, 1 << 20)
    assert e.value.reason == reason


def test_oversize_frame_rejected_before_parsing():
    frame = wire.encode(wire.Join(worker_id="w" * 100))
    with pytest.raises(wire.WireError) as e:
        wire.decode(frame, 10)
    assert e.value.reason == "oversize" and "max_message_mib" in e.value.detail


def test_records_payload_limits_inflation():
    bomb = lz4.frame.compress(msgpack.packb([b"\0" * 100_000]))
    with pytest.raises(wire.WireError) as e:
        wire.unpack_records(bomb, 1000)
    assert e.value.reason == "oversize"
    with pytest.raises(wire.WireError) as e:
        wire.unpack_records(b"not lz4", 1000)
    assert e.value.reason == "malformed"
    assert wire.unpack_records(wire.pack_records([{"a": 1}]), 1000) == [{"a": 1}]
