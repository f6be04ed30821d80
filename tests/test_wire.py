import lz4.frame
import msgpack
import pytest

from echo_rl.core import wire


def test_round_trip_every_request():
    msgs = [
        wire.Join(worker_id="w1", price=0.35),
        wire.Heartbeat(worker_id="w1", version=3),
        wire.WorkRequest(worker_id="w1", max_groups=2),
        wire.Trajectories(worker_id="w1", batch_id="b", count=0, payload=wire.pack_records([])),
        wire.Leave(worker_id="w1"),
        wire.ChunkRequest(version=1, index=0, rid=7),
    ]
    for m in msgs:
        back = wire.decode(wire.encode(m), 1 << 20)
        assert type(back) is type(m) and back == m


@pytest.mark.parametrize(
    "frame,reason",
    [
        (b"\xc1\xff junk", "malformed"),
        (msgpack.packb([1, 2, 3]), "malformed"),
        (msgpack.packb({"v": 99, "type": "join", "worker_id": "w"}), "wrong_version"),
        (msgpack.packb({"v": wire.WIRE_VERSION, "type": "nope"}), "unknown_type"),
        (msgpack.packb({"v": wire.WIRE_VERSION, "type": "join"}), "invalid_fields"),
        (
            msgpack.packb({"v": wire.WIRE_VERSION, "type": "join", "worker_id": "w", "extra": 1}),
            "invalid_fields",
        ),
        (
            msgpack.packb(
                {"v": wire.WIRE_VERSION, "type": "work_request", "worker_id": "w", "max_groups": 0}
            ),
            "invalid_fields",
        ),
        # Found by fuzzing (docs/fuzzing.md): each of these raised something else, or passed.
        (msgpack.packb({"v": 1, "type": ["x"]}), "unknown_type"),  # 13 bytes that killed a relay
        (msgpack.packb({"v": 1, "type": {"a": 1}}), "unknown_type"),
        (msgpack.packb({"v": True, "type": "leave", "worker_id": "w"}), "wrong_version"),
        (msgpack.packb({"v": 1.0, "type": "leave", "worker_id": "w"}), "wrong_version"),
        (
            msgpack.packb({"v": 1, "type": "heartbeat", "worker_id": "w", "version": True}),
            "invalid_fields",
        ),
        (
            msgpack.packb({"v": 1, "type": "chunk_request", "version": 1, "index": False}),
            "invalid_fields",
        ),
        (
            msgpack.packb({"v": 1, "type": "join", "worker_id": "w", "can_relay": 1}),
            "invalid_fields",
        ),
        (
            msgpack.packb({"v": 1, "type": "join", "worker_id": "w", "price": float("nan")}),
            "invalid_fields",
        ),
        (
            msgpack.packb(
                {
                    "v": 1,
                    "type": "heartbeat",
                    "worker_id": "w",
                    "version": 1,
                    "throughput": float("inf"),
                }
            ),
            "invalid_fields",
        ),
        (
            msgpack.packb(
                {"v": 1, "type": "installed", "worker_id": "w", "version": 1, "digest": "x"}
            ),
            "invalid_fields",
        ),
        (msgpack.packb({"v": 1, "type": "join", b"worker_id": "w"}), "invalid_fields"),
        (
            msgpack.packb({"v": 1, "type": "shutdown", "reason": msgpack.Timestamp(1, 0)}),
            "malformed",
        ),
        (
            msgpack.packb({"v": 1, "type": "shutdown", "reason": msgpack.ExtType(5, b"")}),
            "malformed",
        ),
        (msgpack.packb({1: 1}), "malformed"),  # strict_map_key
        (b"\xdd\xff\xff\xff\xff", "malformed"),  # an array header claiming 4 G items
        (b"\x91" * 2000 + b"\xc0", "malformed"),  # nested past msgpack's stack
        (msgpack.packb({"v": 1, "type": "leave", "worker_id": "w"}) + b"\x00", "malformed"),
        (b"", "malformed"),
    ],
)
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


@pytest.mark.parametrize(
    "payload,reason",
    [
        (b"", "malformed"),  # was counted as oversize
        (b"junk", "malformed"),
        (wire.pack_records([{"a": 1}])[:-3], "malformed"),  # truncated
        (wire.pack_records([{"a": 1}]) + b"x", "malformed"),  # trailing bytes
        (wire.pack_records({"a": 1}), "malformed"),  # not a list
        (lz4.frame.compress(b"\xc1"), "malformed"),  # lz4 but not msgpack
        (lz4.frame.compress(msgpack.packb([msgpack.Timestamp(1, 0)])), "malformed"),
        (lz4.frame.compress(b"\x91" * 2000 + b"\xc0"), "malformed"),
        (wire.pack_records([b"\0" * 5000]), "oversize"),
    ],
)
def test_records_payload_reasons(payload, reason):
    with pytest.raises(wire.WireError) as e:
        wire.unpack_records(payload, 4096)
    assert e.value.reason == reason


def test_records_payload_at_exactly_the_limit_passes():
    payload = wire.pack_records([b"\0" * 990])
    size = len(msgpack.packb([b"\0" * 990]))
    assert wire.unpack_records(payload, size) == [b"\0" * 990]
    with pytest.raises(wire.WireError, match="oversize"):
        wire.unpack_records(payload, size - 1)


def test_non_finite_float_refused_when_built_too():
    with pytest.raises(ValueError, match="finite"):
        wire.Heartbeat(worker_id="w", version=1, throughput=float("nan"))


def test_error_detail_is_bounded_for_junk_of_any_size():
    with pytest.raises(wire.WireError) as e:
        wire.decode(msgpack.packb({"v": "x" * 100_000}), 1 << 20)
    assert e.value.reason == "wrong_version" and len(str(e.value)) < 200
