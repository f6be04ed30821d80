"""``docs/config.md``, generated from the typed config (``echo_rl/core/config.py``).

    .venv/bin/python -m echo_rl.core.config_doc > docs/config.md      # regenerate
    .venv/bin/python -m echo_rl.core.config_doc --check docs/config.md

Every key of every section, with its type, default, bounds and the explanation written beside
it in ``echo_rl/core/config.py`` and the section modules it assembles (``echo_rl/core/config_sections.py``,
``echo_rl/core/config_learner.py``, ``echo_rl/core/config_security.py``): the comment on the field's line and the
comment lines just above it.
``tests/test_config.py`` fails when the committed page differs from what this prints, so the
reference cannot drift from the code.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import io
import sys
import tokenize
import types
import typing
from collections.abc import Callable
from pathlib import Path

from pydantic import BaseModel
from pydantic.fields import FieldInfo

HEADER = """# Configuration reference

Generated from `echo_rl/core/config.py` by `python -m echo_rl.core.config_doc`; `tests/test_config.py` checks
that this page matches the code. One TOML file configures every process: the learner reads it,
workers receive the part they need when they join (`EchoConfig.worker_view`). Any key can be
overridden on the command line with `--set section.key=value` (values in TOML syntax, strings
quoted: `--set 'adapter.name="math"'`). A bad key or value stops at load with the key, the value
and the fix. Example files: `examples/quickstart.toml`, `examples/math.toml`, `examples/poker.toml`,
`examples/public.toml` (a real run of hours, README "Running for real").

Units are in the key's name, one convention for each kind: sizes of data in MiB (`_mib`, 2^20
bytes), memory budgets in GiB (`_gb`, 2^30 bytes, as docs/memory.md prints them), rates in
decimal Mbit/s (`_mbit`), durations in seconds (`_s`). A key renamed to this convention is
refused with its new name and the converted value: `broadcast.chunk_kib = 256` became
`broadcast.chunk_mib = 0.25` (KiB / 1024).

`[adapter.presets.NAME]` tables hold options for the adapter called NAME, so one file can carry
settings for several tasks and switching task stays the one line `[adapter] name = ...`: the
options used are the preset of the chosen adapter, overridden by `[adapter.options]`.
"""


def _comments(source: str) -> dict[int, str]:
    """Line number -> comment text on that line."""
    out = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            out[tok.start[0]] = tok.string.lstrip("#").strip()
    return out


def field_notes(cls: type) -> dict[str, str]:
    """Field name -> the comments written above and beside it in the class body."""
    source = inspect.getsource(cls)
    comments = _comments(source)
    lines = source.splitlines()
    tree = ast.parse(source)
    notes: dict[str, str] = {}
    cls_def = tree.body[0]
    if not isinstance(cls_def, ast.ClassDef):
        raise TypeError(f"{cls.__name__}: its source does not start with a class")
    body = cls_def.body
    for node in body:
        if not isinstance(node, ast.AnnAssign) or not isinstance(node.target, ast.Name):
            continue
        above: list[str] = []
        i = node.lineno - 1
        # comment lines above, at the field's own indentation: a deeper one continues the
        # comment beside the previous field (audit_queue's), not this field's
        while (
            i >= 1
            and lines[i - 1].strip().startswith("#")
            and lines[i - 1].index("#") <= node.col_offset
        ):
            above.insert(0, comments.get(i, ""))
            i -= 1
        beside = [
            comments[n]
            for n in range(node.lineno, (node.end_lineno or node.lineno) + 1)
            if n in comments
        ]
        # a comment continued on the lines after the field (indented like the comment itself)
        n = (node.end_lineno or node.lineno) + 1
        while (
            beside
            and n <= len(lines)
            and lines[n - 1].strip().startswith("#")
            and n not in _starts_of(body)
        ):
            if lines[n - 1].index("#") > lines[node.lineno - 1].index(":"):
                beside.append(comments.get(n, ""))
                n += 1
            else:
                break
        text = " ".join(x for x in above + beside if x and not x.startswith("---"))
        notes[node.target.id] = text.replace("|", "\\|")
    return notes


def _starts_of(body: list[ast.stmt]) -> set[int]:
    return {n.lineno for n in body}


def _type(ann: object) -> str:
    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if type(None) in args:  # X | None: a key that may stay unset
        rest = [a for a in args if a is not type(None)]
        return (
            _type(rest[0]) if len(rest) == 1 else " \\| ".join(_type(a) for a in rest)
        ) + ", optional"
    if origin in (typing.Union, types.UnionType):  # X | Y, e.g. a name or a list of names
        return " \\| ".join(_type(a) for a in args)
    if origin is typing.Literal:
        return " \\| ".join(f'`"{a}"`' if isinstance(a, str) else f"`{a}`" for a in args)
    if origin in (list, dict):
        return f"`{getattr(ann, '__name__', str(ann))}[{', '.join(_plain(a) for a in args)}]`"
    return f"`{_plain(ann)}`"


def _plain(ann: object) -> str:
    return ann.__name__ if isinstance(ann, type) else str(ann).replace("typing.", "")


def _default(info: FieldInfo) -> str:
    value = info.get_default(call_default_factory=True)  # our factories take no arguments
    if isinstance(value, str):
        return f'`"{value}"`'
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if value is None:
        return "unset"
    return f"`{value}`"


def _bounds(info: FieldInfo) -> str:
    out = []
    for m in info.metadata:
        for attr, sym in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")):
            v = getattr(m, attr, None)
            if v is not None:
                out.append(f"{sym} {v}")
    return ", ".join(out)


def section(name: str, cls: type[BaseModel]) -> str:
    notes: dict[str, str] = {}
    for klass in reversed(cls.__mro__):  # base classes first, the section's own comments win
        if klass.__module__ == cls.__module__ and "__annotations__" in klass.__dict__:
            try:
                notes.update(field_notes(klass))
            except (OSError, TypeError, IndexError):
                pass
    doc = (cls.__doc__ or "").strip()
    rows = [f"## `[{name}]`" if name else "## Top level", ""]
    if doc and not doc.startswith("Usage docs"):
        rows += [" ".join(doc.split()), ""]
    rows += ["| key | type | default | allowed | meaning |", "|---|---|---|---|---|"]
    for key, info in cls.model_fields.items():
        if isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel):
            continue
        rows.append(
            f"| `{key}` | {_type(info.annotation)} | {_default(info)} | {_bounds(info)} "
            f"| {notes.get(key, '')} |"
        )
    return "\n".join(rows) + "\n"


def render() -> str:
    from echo_rl.core.config import EchoConfig

    return "\n".join([HEADER, *_sections("", EchoConfig)])


def _sections(name: str, cls: type[BaseModel]) -> list[str]:
    """The section's table, then each of its subsections' ([learner.lora] after [learner])."""
    parts = [section(name, cls)]
    for key, info in cls.model_fields.items():
        ann = info.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            parts += _sections(f"{name}.{key}" if name else key, ann)
    return parts


def page_cli(
    argv: list[str] | None, render: Callable[[], str], description: str, module: str
) -> int:
    """A generated page's command line: print it, or ``--check FILE`` against it (exit 1 and
    the command that regenerates it when they differ). Shared by every generated page."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument(
        "--check",
        type=Path,
        default=None,
        metavar="FILE",
        help="exit 1 if FILE differs from what would be generated",
    )
    args = p.parse_args(argv)
    text = render()
    if args.check is not None:
        if args.check.read_text() != text:
            print(
                f"{args.check} is out of date: run python -m {module} > {args.check}",
                file=sys.stderr,
            )
            return 1
        return 0
    sys.stdout.write(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    return page_cli(
        argv, render, "Print docs/config.md from echo_rl/core/config.py.", "echo_rl.core.config_doc"
    )


if __name__ == "__main__":
    sys.exit(main())
