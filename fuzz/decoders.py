"""Every decoder that reads a peer's bytes, as a fuzz target: seeds, target, invariants.

A target takes bytes and returns normally when the decoder either refused them with its
documented error (``WireError``, ``SnapshotError``, ``SourceFailed``, ``RecordError``) or
accepted them and what it returned keeps its invariants. Anything else (another exception, an
``AssertionError`` from a broken invariant) propagates: that is a finding. Used by
``benchmarks/fuzz_decoders.py`` (atheris) and ``tests/test_wire_props.py`` (hypothesis).
"""

from __future__ import annotations

import math
import types
import typing
from collections.abc import Callable
from typing import Any

import annotated_types as at
import lz4.frame
import msgpack
from pydantic import BaseModel

from echo_rl.broadcast.fetch import SourceFailed, check_reply
from echo_rl.broadcast.manifest import Manifest, signed_bytes
from echo_rl.broadcast.snapshot import (
    DTYPE_BYTES,
    RunKey,
    SnapshotError,
    build_manifest,
    verify_manifest,
)
from echo_rl.core import wire
from echo_rl.data.records import Limits, RecordError, parse_record

MAX_BYTES = 1 << 16  # a frame limit small enough that oversize is reachable by mutation
KEY = RunKey.from_bytes(bytes(range(32)))  # fixed: the seeds are the same on every run
LIMITS = Limits(vocab_size=1000, max_new_tokens=32, group_size=8)
PENDING = {7: 2}  # the chunk reply target waits for chunk 2 of version 4 under request id 7

RECORD = {
    "group_id": "g1",
    "sample_idx": 1,
    "prompt_ids": [1, 2, 3],
    "completion_ids": [4, 5],
    "logprobs": [-0.5, -1.25],
    "reward": 1.0,
    "version": 4,
    "worker_id": "w1",
    "gen_s": 0.5,
}
ACCOUNT = wire.Account(
    state="active",
    version=4,
    install_s=0.8,
    granted=12,
    accepted=40,
    duplicates=2,
    rejected={"reward_mismatch": 4},
    checks=3,
    check_failures=1,
    throughput=1.5,
    down_mbit=90.0,
    up_mbit=20.0,
    nat="punchable",
    price=0.35,
    active_s=120.0,
    earned_usd=0.0117,
    message="activate: capacity short",
    message_age_s=3.0,
)


def manifest(version: int = 4, **over: Any) -> dict[str, Any]:
    """The wire map of a signed manifest of a small two-tensor payload; ``over`` replaces keys
    before signing (a seed the fuzzer mutates: hostile maps on purpose)."""
    payload = bytes(range(256)) * 3
    tensors = [
        {"name": "w", "dtype": "float32", "shape": [8, 16], "offset": 0, "nbytes": 512},
        {"name": "b", "dtype": "bfloat16", "shape": [128], "offset": 512, "nbytes": 256},
    ]
    m = build_manifest(
        run_id="fuzz",
        version=version,
        tensors=tensors,
        payload=payload,
        chunk_size=100,
        dtype="float32",
        key=KEY,
    ).to_wire()
    if over:
        m.update(over)
        m["signature"] = resign(m)
    return m


def resign(m: dict[str, Any]) -> bytes:
    return KEY.sign(signed_bytes(m))


def examples() -> list[wire.Message]:
    """At least one valid message of every type in ``wire.MESSAGES`` (the seeds)."""
    m = manifest()
    return [
        wire.Join(
            worker_id="w1",
            price=0.35,
            relay_endpoint="tcp://10.0.0.2:5000",
            down_mbit=100.0,
            up_mbit=20.0,
        ),
        wire.Join(worker_id="w" * 128, can_relay=False, backend="vllm", rid=3),
        wire.JoinAck(
            run_id="r",
            instance_id="i",
            public_key=KEY.public_bytes,
            version=4,
            manifest=m,
            config={"worker": {"groups_per_request": 2}},
            snapshot_endpoint="tcp://10.0.0.1:5001",
        ),
        wire.JoinAck(
            run_id="r",
            instance_id="i",
            public_key=KEY.public_bytes,
            version=-1,
            config={},
            snapshot_endpoint="tcp://10.0.0.1:5001",
        ),
        wire.JoinAck(
            run_id="r",
            instance_id="i",
            public_key=KEY.public_bytes,
            version=-1,
            config={},
            snapshot_endpoint="tcp://10.0.0.1:5001",
            reflectors=["10.0.0.1:5002", "10.0.0.1:5003"],
        ),
        wire.Heartbeat(
            worker_id="w1",
            version=4,
            throughput=1.5,
            busy_s=10.0,
            busy_samples=12,
            state="generating",
        ),
        wire.HeartbeatAck(instance_id="i", version=4, manifest=m, source="tcp://10.0.0.3:1"),
        wire.HeartbeatAck(instance_id="i", version=4, known=False),
        wire.HeartbeatAck(instance_id="i", version=4, account=ACCOUNT),
        wire.WorkRequest(worker_id="w1", max_groups=4, holding=["g1", "g2"]),
        wire.WorkGrant(
            groups=[
                wire.Group(
                    group_id="g1",
                    prompt_ids=[1, 2, 3],
                    n=4,
                    seed=7,
                    task={"answer": "42", "k": [1, 2.5]},
                )
            ]
        ),
        wire.WorkGrant(groups=[], retry_after_s=0.5),
        wire.Trajectories(
            worker_id="w1",
            batch_id="b1",
            count=2,
            payload=wire.pack_records([RECORD, {**RECORD, "sample_idx": 2}]),
        ),
        wire.Ack(
            batch_id="b1", accepted=1, duplicates=0, rejected={"out_of_vocab": 1}, rejected_idx=[1]
        ),
        wire.Leave(worker_id="w1"),
        wire.Heartbeat(worker_id="w1", version=4, state="yielded"),
        wire.WorkGrant(
            groups=[
                wire.Group(
                    group_id="g2",
                    prompt_ids=[1, 2],
                    n=2,
                    seed=9,
                    prefixes=[
                        wire.Prefix(
                            sample_idx=1,
                            ids=[5, 6],
                            logprobs=[-0.5, -1.0],
                            versions=[[3, 1], [4, 1]],
                        )
                    ],
                )
            ]
        ),
        wire.Handback(
            worker_id="w1",
            reason="preempted",
            groups=["g1", "g2"],
            prefixes={
                "g1": [wire.Prefix(sample_idx=0, ids=[7], logprobs=[-0.1], versions=[[4, 1]])]
            },
        ),
        wire.Handback(worker_id="w1", reason="yielded", groups=[]),
        wire.HandbackAck(groups=2, prefixes=1, refused={"stale": 1}),
        wire.SnapshotNotice(version=4, manifest=m, source="tcp://10.0.0.3:1"),
        wire.Shutdown(reason="run finished"),
        wire.Shutdown(reason="run finished", account=ACCOUNT),
        wire.Farewell(account=ACCOUNT.model_copy(update={"state": "left"})),
        wire.ChunkRequest(version=4, index=2, rid=7),
        wire.Chunk(version=4, index=2, rid=7),
        wire.Error(reason="oversize", detail="too big", ref="b1"),
        wire.SourceRequest(worker_id="w1", version=4, bad_source="tcp://x:1", reason="timeout"),
        wire.SourceGrant(version=4, source="tcp://10.0.0.1:5001"),
        wire.Installed(worker_id="w1", version=4, digest=bytes(32)),
        wire.NatReport(worker_id="w1", nonces=[b"a" * 16, b"b" * 16]),
        wire.NatStatus(nat="punchable", address="203.0.113.2:40001"),
        wire.Punch(
            punch_id=b"p" * 16,
            role="child",
            address="203.0.113.3:40002",
            endpoint="tcp://10.0.0.3:5000",
            timeout_s=10,
        ),
        wire.Doctor(rid=5),
        wire.DoctorAck(
            run_id="r",
            instance_id="i",
            snapshot_endpoint="tcp://10.0.0.1:5556",
            reflectors=["10.0.0.1:5557", "10.0.0.1:5558"],
            join="token",
            version=3,
        ),
    ]


# ------------------------------------------------------------------ invariants


def _bounds_hold(value: Any, metadata: list[Any]) -> bool:
    for c in metadata:
        ok = {
            at.Ge: lambda: value >= c.ge,  # noqa: B023
            at.Gt: lambda: value > c.gt,  # noqa: B023
            at.Le: lambda: value <= c.le,  # noqa: B023
            at.Lt: lambda: value < c.lt,  # noqa: B023
            at.MinLen: lambda: len(value) >= c.min_length,  # noqa: B023
            at.MaxLen: lambda: len(value) <= c.max_length,  # noqa: B023
        }.get(type(c), lambda: True)()
        if not ok:
            return False
    return True


def check_value(ann: Any, metadata: list[Any], value: Any, where: str) -> None:
    """``value`` has exactly the type ``ann`` says (no bool for an int, no NaN for a float)."""
    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if ann is Any:
        return
    if origin is typing.Annotated:  # the inner type, with its own bounds
        inner = [m for a in args[1:] for m in (getattr(a, "metadata", None) or [a])]
        return check_value(args[0], inner, value, where)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return
        ann = next(a for a in args if a is not type(None))
        return check_value(ann, metadata, value, where)
    if origin is typing.Literal:
        assert value in args, f"{where}: {value!r} not in {args}"
    elif isinstance(ann, type) and issubclass(ann, BaseModel):
        assert type(value) is ann, f"{where}: {type(value).__name__} is not {ann.__name__}"
        check_model(value, where)
    elif origin is list:
        assert type(value) is list, f"{where}: {type(value).__name__} is not a list"
        for i, x in enumerate(value):
            check_value(args[0], [], x, f"{where}[{i}]")
    elif origin is dict:
        assert type(value) is dict, f"{where}: {type(value).__name__} is not a dict"
        for k, x in value.items():
            check_value(args[0], [], k, f"{where} key")
            check_value(args[1], [], x, f"{where}[{k!r}]")
    else:
        assert type(value) is ann, f"{where}: {type(value).__name__} is not {ann.__name__}"
        assert ann is not float or math.isfinite(value), f"{where}: {value} is not finite"
    assert _bounds_hold(value, metadata), f"{where}: {value!r} outside {metadata}"


def check_model(obj: BaseModel, where: str) -> None:
    for name, info in type(obj).model_fields.items():
        check_value(info.annotation, info.metadata, getattr(obj, name), f"{where}.{name}")


def same(decoded: Any, sent: Any) -> bool:
    """``decoded`` is ``sent`` without coercion (an int for a float field is the one allowed)."""
    if type(decoded) is float and type(sent) is int:
        return decoded == float(sent)
    if type(decoded) is not type(sent):
        return False
    if type(sent) is dict:
        return decoded.keys() == sent.keys() and all(same(decoded[k], sent[k]) for k in sent)
    if type(sent) is list:
        return len(decoded) == len(sent) and all(map(same, decoded, sent))
    if type(sent) is float and math.isnan(sent):
        return math.isnan(decoded)
    return decoded == sent


def check_message(msg: wire.Message, sent: dict[str, Any] | None = None) -> None:
    """What ``wire.decode`` promises about a message it returned (from the map ``sent``)."""
    assert type(msg) is wire.MESSAGES[msg.type], f"{msg.type} decoded as {type(msg).__name__}"
    assert type(msg.v) is int and msg.v == wire.WIRE_VERSION
    check_model(msg, msg.type)
    if sent is not None:  # every value sent was kept as it was: nothing coerced (True as 1)
        dump = msg.model_dump()
        for k, v in sent.items():
            assert same(dump[k], v), f"{msg.type}.{k}: sent {v!r}, decoded {dump[k]!r}"
    # What was accepted re-encodes to a frame that decodes to the same message (compared as
    # bytes: a NaN inside a free-form map, e.g. a group's task, is kept but unequal to itself).
    frame = wire.encode(msg)
    assert wire.encode(wire.decode(frame, 1 << 30)) == frame, f"{msg.type} changed on a round trip"


TENSOR_KEYS = ("name", "dtype", "shape", "offset", "nbytes", "enc", "doff", "dlen")


def check_accepted_manifest(m: Manifest, raw: dict[str, Any]) -> None:
    """What a worker reads from a manifest ``verify_manifest`` accepted, and that its one
    serialiser gives back the signed map it came from."""
    size, chunk, hashes = m.payload_size, m.chunk_size, m.chunk_hashes
    for k in ("version", "base_version", "payload_size", "chunk_size", "schema", "result_size"):
        value = getattr(m, k)
        assert type(value) is int, f"manifest {k} is a {type(value).__name__}"
    assert 0 <= size and chunk >= 1 and len(hashes) == -(-size // chunk)
    assert len(m.result_hashes) == -(-m.result_size // chunk)
    assert m.encoding == "delta" or m.base_version == -1
    for i in range(len(hashes)):
        start, end = m.layout.chunk_range(i)
        assert 0 <= start < end <= size and isinstance(hashes[i], bytes)
    for t in m.tensors:
        assert t.dtype in DTYPE_BYTES
        assert 0 <= t.offset <= t.offset + t.nbytes <= m.result_size
        assert 0 <= t.doff <= t.doff + t.dlen <= size
        assert all(type(d) is int and d >= 0 for d in t.shape)
    # The one serialiser gives back the signed map, less keys it does not declare (a newer
    # learner's: signed, so accepted, but not read).
    wire_map = m.to_wire()
    declared = {k: v for k, v in raw.items() if k in wire_map}
    declared["tensors"] = [{k: v for k, v in t.items() if k in TENSOR_KEYS} for t in raw["tensors"]]
    assert signed_bytes(wire_map) == signed_bytes(declared), "the serialiser changed the map"


def check_record(obj: Any) -> None:
    """``parse_record`` refuses a record with a RecordError or returns one that holds."""
    try:
        r = parse_record(obj, LIMITS)
    except RecordError:
        return
    assert all(
        type(t) is int and 0 <= t < LIMITS.vocab_size for t in r.prompt_ids + r.completion_ids
    )
    assert 1 <= len(r.completion_ids) <= LIMITS.max_new_tokens
    assert len(r.logprobs) == len(r.completion_ids)
    assert all(type(x) is float and math.isfinite(x) for x in r.logprobs)
    assert type(r.reward) is float and math.isfinite(r.reward)
    assert 0 <= r.sample_idx < LIMITS.group_size and type(r.sample_idx) is int


# ------------------------------------------------------------------ targets


def decode_message(data: bytes) -> None:
    try:
        msg = wire.decode(data, MAX_BYTES)
    except wire.WireError as err:
        assert err.reason in (
            "oversize",
            "malformed",
            "wrong_version",
            "unknown_type",
            "invalid_fields",
        ), err.reason
        return
    check_message(msg, wire.unpack(data))
    if isinstance(msg, wire.Trajectories):
        records(msg.payload)


def records(payload: bytes) -> None:
    try:
        objs = wire.unpack_records(payload, MAX_BYTES)
    except wire.WireError as err:
        assert err.reason in ("oversize", "malformed"), err.reason
        return
    assert type(objs) is list
    for obj in objs:
        check_record(obj)


def records_msgpack(data: bytes) -> None:
    """The records inside a valid lz4 frame: mutations reach msgpack and ``parse_record``."""
    records(lz4.frame.compress(data))


def manifest_map(data: bytes) -> None:
    """A manifest as it arrives inside a message: any msgpack map."""
    try:
        obj = wire.unpack(data)
    except Exception:  # not a manifest's way in: decode refuses it as malformed
        return
    try:
        accepted = verify_manifest(obj, KEY.public_bytes)
    except SnapshotError:
        return
    check_accepted_manifest(accepted, obj)


def chunk_reply(data: bytes) -> None:
    for more in (True, False):
        pending = dict(PENDING)
        try:
            index = check_reply(data, more, pending, 4, MAX_BYTES)
        except SourceFailed as fail:
            assert fail.reason in ("corrupt", "refused"), fail.reason
            continue
        assert index is None or (index == 2 and more and not pending)


def _frames(types_: tuple[str, ...]) -> list[bytes]:
    return [wire.encode(m) for m in examples() if m.type in types_]


Target = tuple[Callable[[bytes], None], Callable[[], list[bytes]]]


def targets() -> dict[str, Target]:
    """name -> (target, seed corpus). One decode target per message type: the same decoder,
    seeded with that type's frames, so mutation explores each type's fields."""
    out: dict[str, Target] = {t: (decode_message, lambda t=t: _frames((t,))) for t in wire.MESSAGES}
    out["records"] = (
        records,
        lambda: [m.payload for m in examples() if isinstance(m, wire.Trajectories)],
    )
    out["records_msgpack"] = (
        records_msgpack,
        lambda: [msgpack.packb([RECORD]), msgpack.packb([RECORD, RECORD])],
    )
    out["manifest"] = (manifest_map, lambda: [msgpack.packb(manifest(), use_bin_type=True)])
    out["chunk_reply"] = (chunk_reply, lambda: _frames(("chunk", "error")))
    return out
