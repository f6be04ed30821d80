"""One error base for the whole project: every error Echo raises on purpose is an ``EchoError``
carrying a short, stable ``reason`` code (a metrics label, a word to grep the log for, what the
commands print in brackets) beside the human message that names the problem and the fix.

A class says its code once (``default_reason``); an instance may carry a finer one
(``ReasonError``: failures a peer can cause, such as a wire message or a delivered record, where
the code is per instance and metrics count it). Each subclass keeps the standard-library base it
had (``ValueError``, ``RuntimeError``, ``KeyError``, ``TimeoutError``), so ``except ValueError``
still catches a bad config; ``except EchoError`` catches every one of them and nothing else.
tests/test_errors.py checks that every exception class in ``echo_rl`` derives from it."""

from __future__ import annotations

from typing import ClassVar


class EchoError(Exception):
    """``reason``: the instance's code (``reason=`` given, else the class's ``default_reason``).
    Pickling restores the attributes instead of calling ``__init__`` again, so a process pool
    or a test harness carries any subclass across a process boundary, whatever its
    constructor takes."""

    default_reason: ClassVar[str] = "error"

    def __init__(self, *args: object, reason: str | None = None) -> None:
        super().__init__(*args)
        self.reason: str = reason if reason is not None else type(self).default_reason

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild, (type(self), self.args, dict(self.__dict__)))


class ReasonError(EchoError):
    """A failure a peer can cause, with its code per instance: ``str(e)`` is
    ``"reason: detail"``; ``detail`` alone is what goes back to the peer."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}", reason=reason)
        self.detail = detail


def _rebuild(cls: type[EchoError], args: tuple[object, ...], state: dict[str, object]) -> EchoError:
    err = cls.__new__(cls)
    err.args = args
    err.__dict__.update(state)
    return err


def describe(err: EchoError) -> str:
    """One line for a command's stderr: the message, then the code in brackets (what the log
    and metrics call it)."""
    text = str(err).strip() or type(err).__name__
    return text if text.startswith(f"{err.reason}:") else f"{text} [{err.reason}]"
