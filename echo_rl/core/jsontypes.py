"""What JSON and msgpack carry, as types: a value read from a file or a peer is a ``JsonValue``
until a declared record (a TypedDict, a dataclass, a pydantic model) has checked it. Code that
reads one narrows it (``isinstance``) or validates it; nothing is taken on trust as ``Any``."""

from __future__ import annotations

from typing import TypeAlias

JsonScalar: TypeAlias = None | bool | int | float | str
JsonValue: TypeAlias = JsonScalar | list["JsonValue"] | dict[str, "JsonValue"]
JsonObject: TypeAlias = dict[str, JsonValue]
