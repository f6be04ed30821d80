"""Frames <-> messages: ``decode`` maps any bytes to a message or a ``WireError``, never another
exception (docs/fuzzing.md); trajectory payloads are inflated and unpacked with every limit set."""

from __future__ import annotations

import reprlib
from collections.abc import Mapping, Sequence
from typing import NoReturn

import lz4.frame
import msgpack
from pydantic import ValidationError

from echo_rl.core.wire.base import WIRE_VERSION, Message, WireError
from echo_rl.core.wire.session import (
    Doctor,
    DoctorAck,
    Error,
    Farewell,
    Heartbeat,
    HeartbeatAck,
    Join,
    JoinAck,
    Leave,
    NatReport,
    NatStatus,
    Punch,
    Shutdown,
)
from echo_rl.core.wire.snapshot import (
    Chunk,
    ChunkRequest,
    Installed,
    SnapshotNotice,
    SourceGrant,
    SourceRequest,
)
from echo_rl.core.wire.work import Ack, Handback, HandbackAck, Trajectories, WorkGrant, WorkRequest

MESSAGES: dict[str, type[Message]] = {
    m.TYPE: m
    for m in (
        Join,
        JoinAck,
        Heartbeat,
        HeartbeatAck,
        WorkRequest,
        WorkGrant,
        Trajectories,
        Ack,
        Leave,
        SnapshotNotice,
        Shutdown,
        ChunkRequest,
        Chunk,
        Error,
        SourceRequest,
        SourceGrant,
        Installed,
        NatReport,
        NatStatus,
        Punch,
        Farewell,
        Handback,
        HandbackAck,
        Doctor,
        DoctorAck,
    )
}


def encode(msg: Message) -> bytes:
    frame: bytes = msgpack.packb(msg.model_dump(), use_bin_type=True)
    return frame


def _reject_ext(code: int, data: bytes) -> NoReturn:
    raise ValueError(f"msgpack extension type {code} is not part of the wire schema")


def unpack(buf: bytes) -> object:
    """msgpack -> Python objects with every limit set (``decode``, records, fuzzing): what
    came is unchecked (JSON's values and bytes), for the caller to narrow or validate.

    No string, byte string, array or map may claim more items than ``buf`` has bytes (a 5-byte
    array header cannot make the unpacker reserve 4 G slots), map keys are str or bytes (no
    unhashable key reaches a dict), extension types are refused (``max_ext_len=0`` also stops
    msgpack's built-in timestamp, which bypasses ``ext_hook``), and nesting is bounded by
    msgpack itself (``StackError`` past 1024 levels). Raises whatever msgpack raises.
    """
    n = len(buf)
    obj: object = msgpack.unpackb(
        buf,
        raw=False,
        strict_map_key=True,
        ext_hook=_reject_ext,
        max_ext_len=0,
        max_str_len=n,
        max_bin_len=n,
        max_array_len=n,
        max_map_len=n // 2,
    )
    return obj


def _short_repr() -> reprlib.Repr:
    r = reprlib.Repr()  # bounded in depth and length: a sender's junk goes into our logs
    # bytes have no limit of their own in reprlib: maxother cuts them (Repr has no maxbytes)
    r.maxlevel, r.maxstring, r.maxother, r.maxlist, r.maxdict = 2, 40, 40, 4, 4
    return r


_show = _short_repr().repr


def decode(frame: bytes, max_bytes: int) -> Message:
    """Parse and validate one frame; raise WireError naming what is wrong (and nothing else)."""
    if len(frame) > max_bytes:
        raise WireError(
            "oversize",
            f"{len(frame)} bytes > limit {max_bytes} "
            f"(raise transport.max_message_mib or send smaller batches)",
        )
    try:
        obj = unpack(frame)
    except Exception as exc:  # msgpack raises several unrelated types on junk
        raise WireError(
            "malformed", f"not a msgpack message ({type(exc).__name__}: {_show(str(exc))})"
        ) from None
    if not isinstance(obj, dict):
        raise WireError("malformed", f"message is a {type(obj).__name__}, expected a map")
    v = obj.get("v")
    if type(v) is not int or v != WIRE_VERSION:  # type(): True == 1 but is no version
        raise WireError(
            "wrong_version",
            f"wire version {_show(v)}, this learner speaks "
            f"{WIRE_VERSION}: upgrade echo-rl on the worker",
        )
    t = obj.get("type")
    cls = MESSAGES.get(t) if isinstance(t, str) else None  # a list is unhashable
    if cls is None:
        raise WireError("unknown_type", f"unknown message type {_show(t)}")
    try:
        # strict: the wire carries exact types, so nothing is coerced (bool->int, int->bool,
        # str->bytes); a message that validates here re-encodes to the same frame.
        return cls.model_validate(obj, strict=True)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(_show(p) if not isinstance(p, str) else p[:40] for p in first["loc"])
        raise WireError("invalid_fields", f"{cls.TYPE}.{loc}: {first['msg']}") from None


def pack_records(records: Sequence[Mapping[str, object]]) -> bytes:
    payload: bytes = lz4.frame.compress(msgpack.packb(records, use_bin_type=True))
    return payload


def _inflate(payload: bytes, max_bytes: int) -> bytes:
    """lz4 frame -> bytes, refusing to inflate past ``max_bytes`` (lz4 bombs)."""
    d = lz4.frame.LZ4FrameDecompressor()
    try:
        raw: bytes = d.decompress(payload, max_length=max_bytes)
    except Exception as exc:  # lz4 raises RuntimeError for anything that is not a frame
        raise WireError(
            "malformed",
            f"trajectory payload is not an lz4 frame ({type(exc).__name__}: {_show(str(exc))})",
        ) from None
    if d.eof:
        if d.unused_data:
            raise WireError(
                "malformed", f"{len(d.unused_data)} bytes after the trajectory payload's lz4 frame"
            )
        return raw
    if not d.needs_input:  # stopped by max_length with input left: really over the limit
        raise WireError(
            "oversize",
            f"trajectory payload inflates past {max_bytes} bytes "
            f"(raise transport.max_message_mib or send smaller batches)",
        )
    raise WireError(
        "malformed", f"trajectory payload is an empty or truncated lz4 frame ({len(payload)} bytes)"
    )


def unpack_records(payload: bytes, max_bytes: int) -> list[object]:
    """Decompress and unpack a trajectory payload: a list, each record still to be checked by
    ``echo_rl.data.records.parse_record``. Raises WireError and nothing else."""
    raw = _inflate(payload, max_bytes)
    try:
        obj = unpack(raw)
    except Exception as exc:  # msgpack raises several unrelated types on junk
        raise WireError(
            "malformed",
            f"trajectory payload is lz4 but not msgpack ({type(exc).__name__}: {_show(str(exc))})",
        ) from None
    if not isinstance(obj, list):
        raise WireError(
            "malformed", f"trajectory payload is a {type(obj).__name__}, expected a list of records"
        )
    return obj
