"""The one error shape for failures a peer can cause: a short machine ``reason`` that metrics
count, plus a human ``detail`` for the log (wire messages, chunk fetches, delivered records)."""

from __future__ import annotations

from typing import Any


class ReasonError(Exception):
    """``str(e)`` is ``"reason: detail"``. Subclasses may take other arguments: pickling
    restores the attributes instead of calling ``__init__`` again, so a process pool or a
    test harness can carry any of them across a process boundary."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), self.args, dict(self.__dict__)))


def _rebuild(cls: type[ReasonError], args: tuple[Any, ...], state: dict[str, Any]) -> ReasonError:
    err = cls.__new__(cls)
    err.args = args
    err.__dict__.update(state)
    return err
