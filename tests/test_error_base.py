"""One project error base (issue 53): every exception class in ``echo_rl`` derives from
``echo_rl.core.errors.EchoError`` and carries a reason code; the standard-library bases stay, so
``except ValueError`` around a config still works; the commands print any unhandled one as one
line with its code, never a traceback."""

from __future__ import annotations

import ast
import builtins
import pickle
from pathlib import Path

import pytest

from echo_rl.core.errors import EchoError, ReasonError, describe

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

PACKAGE = Path(__file__).resolve().parents[1] / "echo_rl"
BUILTIN = {
    name
    for name, obj in vars(builtins).items()
    if isinstance(obj, type) and issubclass(obj, Exception)
}  # a stop (a KeyboardInterrupt subclass, echo_rl/core/stopping.py) is no error: not here


def exception_classes(sources: dict[str, str]) -> dict[str, tuple[str, list[str]]]:
    """Every class, by name, whose bases reach a built-in exception: (where, base names)."""
    bases: dict[str, tuple[str, list[str]]] = {}
    for where, src in sources.items():
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.ClassDef):
                names = [ast.unparse(b).split(".")[-1] for b in node.bases]
                bases[node.name] = (f"{where}:{node.lineno}", names)

    def is_exception(name: str, seen: frozenset[str] = frozenset()) -> bool:
        if name in BUILTIN:
            return True
        if name not in bases or name in seen:
            return False
        return any(is_exception(b, seen | {name}) for b in bases[name][1])

    return {n: v for n, v in bases.items() if n not in BUILTIN and is_exception(n)}


def outside_the_base(sources: dict[str, str]) -> list[str]:
    found = exception_classes(sources)

    def reaches(name: str, seen: frozenset[str] = frozenset()) -> bool:
        if name == "EchoError":
            return True
        if name not in found or name in seen:
            return False
        return any(reaches(b, seen | {name}) for b in found[name][1])

    # Private classes (a leading underscore) are control flow inside one module: never raised
    # out of it, so they carry no code.
    return sorted(
        f"{where} {name}{tuple(b)}"
        for name, (where, b) in found.items()
        if not name.startswith("_") and not reaches(name)
    )


def test_every_exception_class_derives_from_the_project_base() -> None:
    sources = {
        p.relative_to(PACKAGE.parent).as_posix(): p.read_text() for p in PACKAGE.rglob("*.py")
    }
    assert len(exception_classes(sources)) > 30  # the walk found them
    bad = outside_the_base(sources)
    assert not bad, "derive these from echo_rl.core.errors.EchoError:\n" + "\n".join(bad)


def test_the_check_sees_a_class_outside_the_base() -> None:
    src = (
        "class EchoError(Exception): pass\n"
        "class Good(EchoError, ValueError): pass\n"
        "class Bad(ValueError): pass\n"
        "class AlsoBad(Bad): pass\n"
        "class _Private(Exception): pass\n"
    )
    bad = outside_the_base({"m.py": src})
    assert [b.split()[1].split("(")[0] for b in bad] == ["Bad", "AlsoBad"]


def test_every_public_class_says_its_own_code() -> None:
    """A class's code names it (``default_reason`` in its own body), so a metric or a log line
    tells a bad snapshot from a bad config; codes of different classes differ."""
    from echo_rl.broadcast.manifest import SnapshotError
    from echo_rl.broadcast.versions import BaseMissing
    from echo_rl.core.client import ConnectionLost, HandshakeFailed, RequestTimeout
    from echo_rl.core.config import ConfigError
    from echo_rl.core.security import SecurityError
    from echo_rl.data.adapter import AdapterError

    classes = [
        SnapshotError,
        BaseMissing,
        RequestTimeout,
        ConnectionLost,
        HandshakeFailed,
        ConfigError,
        SecurityError,
        AdapterError,
    ]
    codes = [c.default_reason for c in classes]
    assert all("default_reason" in vars(c) for c in classes)
    assert len(set(codes)) == len(codes), codes
    assert BaseMissing("x").reason == "base_missing" and isinstance(BaseMissing("x"), ValueError)


def test_the_standard_library_bases_still_catch() -> None:
    from echo_rl.core.client import RequestTimeout
    from echo_rl.core.config import ConfigError
    from echo_rl.provisioning.registry import UnknownWorker

    with pytest.raises(ValueError):
        raise ConfigError("learner.lr: must be > 0")
    with pytest.raises(TimeoutError):
        raise RequestTimeout("no reply in 5 s")
    with pytest.raises(KeyError):
        raise UnknownWorker("w-1")
    with pytest.raises(EchoError) as got:
        raise ConfigError("learner.lr: must be > 0")
    assert got.value.reason == "config"


def test_a_code_travels_through_pickling_whatever_the_constructor() -> None:
    from echo_rl.broadcast.fetch import NotYet

    err = NotYet("version 3 not held yet", chunk=7)
    back = pickle.loads(pickle.dumps(err))
    assert (type(back), back.reason, back.detail, back.chunk) == (NotYet, "refused", err.detail, 7)
    assert str(back) == str(err)
    per_instance = ReasonError("oversize", "frame of 9 MiB over 8 MiB")
    assert pickle.loads(pickle.dumps(per_instance)).reason == "oversize"


def test_describe_is_one_line_with_the_code() -> None:
    from echo_rl.provisioning.capacity import Infeasible

    assert describe(Infeasible("no throughput fits")) == "no throughput fits [infeasible]"
    # a per-instance code already leads the message: not said twice
    assert describe(ReasonError("oversize", "too big")) == "oversize: too big"
    assert describe(EchoError()) == "EchoError [error]"


def test_the_commands_print_an_unhandled_echo_error_as_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from echo_rl.cli import rl
    from echo_rl.provisioning.capacity import Infeasible

    def fails(argv: list[str] | None) -> int:
        raise Infeasible("no throughput satisfies the overlap condition; lower learner.batch")

    monkeypatch.setattr(rl, "_main", fails)
    assert rl.main(["learn"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("echo-rl: no throughput") and err.rstrip().endswith("[infeasible]")
