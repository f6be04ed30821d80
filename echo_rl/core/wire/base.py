"""What every wire message shares: the schema version, the counted error, the base model."""

from __future__ import annotations

from typing import ClassVar

from pydantic import BaseModel, ConfigDict, model_validator

from echo_rl.core.errors import ReasonError

WIRE_VERSION = 1


class WireError(ReasonError, ValueError):
    """A message refused at the wire (counted by ``reason``)."""


class Message(BaseModel):
    # allow_inf_nan=False: a NaN or infinite rate or price is refused when the message is built
    # and when it is received, so it never reaches the learner's arithmetic.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    TYPE: ClassVar[str] = ""
    v: int = WIRE_VERSION
    type: str = ""
    rid: int = 0  # request id, echoed in the reply so late replies can be told apart

    # A before-validator, not an ``__init__``: pydantic routes ``model_validate`` through a
    # custom ``__init__``, which would validate received frames in lax mode (``True`` as 1).
    @model_validator(mode="before")
    @classmethod
    def _default_type(cls, data: object) -> object:
        if isinstance(data, dict) and "type" not in data:
            data = {**data, "type": cls.TYPE}
        return data
