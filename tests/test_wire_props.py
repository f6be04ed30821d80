"""Property tests of every decoder that reads a peer's bytes (docs/fuzzing.md).

For every message type in ``wire.MESSAGES``, the trajectory payload, the manifest and the chunk
reply: valid values round-trip; random bytes give only the documented error; one value of a
valid frame replaced by any msgpack value (a bool where an int belongs, NaN, inf, 2**64-1,
nested lists and maps, a wrong type) gives that error or a result whose invariants hold (the
targets and invariants are ``fuzz.decoders``'s, shared with the atheris fuzzer).

CI runs hypothesis's default example count; ``ECHO_FUZZ_EXAMPLES=100000`` runs that many per
test (add ``--timeout 0``).
"""

from __future__ import annotations

import math
import os
import types
import typing
from typing import Any

import annotated_types as at
import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from echo_rl.broadcast.snapshot import SnapshotError, build_manifest, verify_manifest
from echo_rl.core import wire
from fuzz import decoders  # not an installed package: pytest's pythonpath finds it

_N = int(os.environ.get("ECHO_FUZZ_EXAMPLES", "0"))
FUZZ = settings(
    deadline=None,
    database=None,
    max_examples=_N or settings.default.max_examples,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

INT64 = st.integers(-(2**63), 2**63 - 1)
EDGE_INTS = st.sampled_from([0, 1, -1, 2**31, 2**53 + 1, 2**63 - 1, -(2**63), 2**64 - 1])
EDGE_FLOATS = st.sampled_from([math.nan, math.inf, -math.inf, -0.0, 1e308, 5e-324])
_scalars = st.one_of(
    st.none(),
    st.booleans(),
    INT64,
    EDGE_INTS,
    st.floats(),
    EDGE_FLOATS,
    st.text(max_size=20),
    st.binary(max_size=40),
)
# Any value msgpack can carry: scalars of every type, lists and str-keyed maps nested in any way.
ANY = st.recursive(
    _scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
_finite_scalars = st.one_of(
    st.none(),
    st.booleans(),
    INT64,
    st.floats(allow_nan=False),
    st.text(max_size=20),
    st.binary(max_size=40),
)
PLAIN = st.recursive(
    _finite_scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=8,
)


# ------------------------------------------------------------------ valid values, from the schema


def _bound(metadata: list[Any], kind: type, attr: str, default: Any) -> Any:
    return next((getattr(c, attr) for c in metadata if isinstance(c, kind)), default)


def valid(ann: Any, metadata: list[Any] = ()) -> st.SearchStrategy:
    """A strategy for valid values of a field, read from its annotation and constraints."""
    metadata = list(metadata)
    origin, args = typing.get_origin(ann), typing.get_args(ann)
    lo, hi = _bound(metadata, at.Ge, "ge", None), _bound(metadata, at.Le, "le", None)
    above = _bound(metadata, at.Gt, "gt", None)  # strict lower bound (a timeout > 0)
    short = _bound(metadata, at.MinLen, "min_length", 0)
    long = _bound(metadata, at.MaxLen, "max_length", None)
    if ann is Any:
        return PLAIN
    if origin is typing.Annotated:  # list[Annotated[list[int], Field(...)]]: the inner bounds
        return valid(args[0], [m for a in args[1:] for m in (getattr(a, "metadata", None) or [a])])
    if origin in (typing.Union, types.UnionType):
        return st.one_of(*(st.none() if a is type(None) else valid(a, metadata) for a in args))
    if origin is typing.Literal:
        return st.sampled_from(args)
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return model(ann)
    if origin is list:
        return st.lists(valid(args[0]), min_size=short, max_size=min(long or 5, 5))
    if origin is dict:
        return st.dictionaries(valid(args[0]), valid(args[1]), max_size=4)
    return {
        int: st.integers(-(2**63) if lo is None else lo, 2**63 - 1 if hi is None else hi),
        float: st.floats(
            min_value=above if above is not None else lo,
            max_value=hi,
            exclude_min=above is not None,
            allow_nan=False,
            allow_infinity=False,
        ),
        bool: st.booleans(),
        str: st.text(min_size=short, max_size=min(long or 30, 30)),
        bytes: st.binary(min_size=short, max_size=min(long or 64, 64)),
    }[ann]


def model(cls: type[BaseModel]) -> st.SearchStrategy:
    fields = {
        n: valid(f.annotation, f.metadata)
        for n, f in cls.model_fields.items()
        if n not in ("v", "type")
    }
    return st.fixed_dictionaries(fields).map(lambda kw: cls(**kw))


MESSAGES = st.sampled_from(sorted(wire.MESSAGES)).flatmap(lambda t: model(wire.MESSAGES[t]))


def mutated(data: st.DataObject, obj: Any) -> Any:
    """``obj`` (fresh from msgpack) with one value somewhere in it replaced, or a key added."""
    node = obj
    while True:
        keys = list(node) if isinstance(node, dict) else list(range(len(node)))
        if isinstance(node, dict) and (not keys or data.draw(st.integers(0, 9)) == 0):
            node[data.draw(st.text(max_size=12))] = data.draw(ANY)
            return obj
        if not keys:
            node.append(data.draw(ANY))
            return obj
        k = data.draw(st.sampled_from(keys))
        if isinstance(node[k], (dict, list)) and data.draw(st.booleans()):
            node = node[k]
            continue
        node[k] = data.draw(ANY)
        return obj


def unpacked(frame: bytes) -> Any:
    return msgpack.unpackb(frame, raw=False, strict_map_key=False)


# ------------------------------------------------------------------ messages


def test_every_message_type_has_a_seed():
    assert {m.type for m in decoders.examples()} == set(wire.MESSAGES)


@FUZZ
@given(MESSAGES)
def test_valid_messages_round_trip(msg):
    back = wire.decode(wire.encode(msg), 1 << 24)
    assert type(back) is type(msg) and back == msg
    decoders.check_message(back)


@FUZZ
@given(st.binary(max_size=512))
def test_random_bytes_give_only_wire_errors(frame):
    decoders.decode_message(frame)


@FUZZ
@given(
    st.sampled_from(sorted(wire.MESSAGES)), st.dictionaries(st.text(max_size=12), ANY, max_size=8)
)
def test_random_maps_of_a_known_type_give_only_wire_errors(type_, fields):
    decoders.decode_message(msgpack.packb({**fields, "v": 1, "type": type_}))


@FUZZ
@given(st.one_of(MESSAGES, st.sampled_from(decoders.examples())), st.data())
def test_one_value_mutated_gives_a_wire_error_or_a_sound_message(msg, data):
    obj = mutated(data, unpacked(wire.encode(msg)))
    decoders.decode_message(msgpack.packb(obj, use_bin_type=True))


@pytest.mark.parametrize(
    "field,bad",
    [
        ("version", True),
        ("version", False),
        ("v", True),
        ("index", -1),
        ("index", 1.0),
        ("rid", None),
    ],
)
def test_bool_or_float_where_an_int_belongs_is_refused(field, bad):
    obj = unpacked(wire.encode(wire.ChunkRequest(version=1, index=0)))
    obj[field] = bad
    with pytest.raises(wire.WireError):
        wire.decode(msgpack.packb(obj), 1 << 16)


# ------------------------------------------------------------------ trajectory payload

RECORDS = st.lists(
    st.fixed_dictionaries(
        {
            **{k: st.just(v) for k, v in decoders.RECORD.items()},
            "reward": st.floats(-10, 10),
            "sample_idx": st.integers(0, 7),
        }
    ),
    max_size=4,
)


@FUZZ
@given(RECORDS)
def test_records_round_trip(records):
    assert wire.unpack_records(wire.pack_records(records), 1 << 20) == records
    decoders.records(wire.pack_records(records))


@FUZZ
@given(st.binary(max_size=512))
def test_random_payloads_give_only_wire_errors(payload):
    decoders.records(payload)
    decoders.records_msgpack(payload)


@FUZZ
@given(RECORDS.filter(bool), st.data())
def test_one_record_value_mutated_gives_an_error_or_a_sound_record(records, data):
    fresh = unpacked(msgpack.packb(records))  # the drawn lists are shared: mutate a copy
    decoders.records(wire.pack_records(mutated(data, fresh)))


# ------------------------------------------------------------------ manifest

TENSOR = st.tuples(
    st.text(min_size=1, max_size=8),
    st.sampled_from(["float32", "bfloat16", "int8"]),
    st.lists(st.integers(0, 6), max_size=3),
)


@st.composite
def manifests(draw):
    tensors, offset = [], 0
    for i, (name, dtype, shape) in enumerate(draw(st.lists(TENSOR, max_size=4))):
        nbytes = math.prod(shape) * {"float32": 4, "bfloat16": 2, "int8": 1}[dtype]
        tensors.append(
            {
                "name": f"{name}{i}",
                "dtype": dtype,
                "shape": shape,
                "offset": offset,
                "nbytes": nbytes,
            }
        )
        offset += nbytes
    payload = draw(st.binary(min_size=offset, max_size=offset + 64))
    return build_manifest(
        run_id=draw(st.text(max_size=8)),
        version=draw(st.integers(0, 2**40)),
        tensors=tensors,
        payload=payload,
        chunk_size=draw(st.integers(1, 300)),
        dtype="float32",
        key=decoders.KEY,
    )


@FUZZ
@given(manifests())
def test_valid_manifests_verify_after_a_wire_round_trip(m):
    back = wire.decode(
        wire.encode(
            wire.SnapshotNotice(version=m.version, manifest=m.to_wire(), source="tcp://h:1")
        ),
        1 << 24,
    ).manifest
    assert verify_manifest(back, decoders.KEY.public_bytes) == m
    decoders.check_accepted_manifest(m, back)


@FUZZ
@given(st.one_of(manifests(), st.just(decoders.manifest())), st.data())
def test_one_manifest_value_mutated_and_resigned_gives_snapshot_error_or_a_sound_manifest(m, data):
    # Re-signed, so what is checked is the shape check, not the signature: even a learner that
    # signs nonsense cannot make a worker raise anything but SnapshotError.
    wire_map = m if isinstance(m, dict) else m.to_wire()
    obj = mutated(data, unpacked(msgpack.packb(wire_map, use_bin_type=True)))
    if isinstance(obj, dict):
        try:
            obj["signature"] = decoders.resign(obj)
        except (ValueError, TypeError):  # a map msgpack cannot pack back: nothing to sign
            pass
    decoders.manifest_map(msgpack.packb(obj, use_bin_type=True))


@FUZZ
@given(ANY)
def test_manifest_of_any_shape_is_a_snapshot_error(obj):
    with pytest.raises(SnapshotError):
        verify_manifest(obj, decoders.KEY.public_bytes)


# ------------------------------------------------------------------ chunk reply


@FUZZ
@given(st.binary(max_size=256))
def test_random_chunk_reply_fails_the_source(frame):
    decoders.chunk_reply(frame)


@FUZZ
@given(st.sampled_from(decoders.targets()["chunk_reply"][1]()), st.data())
def test_chunk_reply_with_one_value_mutated_fails_the_source_or_names_the_chunk(frame, data):
    decoders.chunk_reply(frame)
    decoders.chunk_reply(msgpack.packb(mutated(data, unpacked(frame)), use_bin_type=True))
