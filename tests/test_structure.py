"""The shape issue 34 set for the runtime packages, checked on every run: no module over 500
lines, no class over 300 (compose small parts instead), and the simulator (echo_rl/provisioning/sim/)
used by no runtime module outside it but the CLI's entry. Layering is tests/test_layers.py."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUNTIME = ("echo_rl",)
ENTRY = ("echo_rl/cli/",)
MODULE_LINES, CLASS_LINES = 500, 300

pytestmark = pytest.mark.timeout(60)


def runtime_files() -> list[Path]:
    return sorted(f for p in RUNTIME for f in (ROOT / p).rglob("*.py"))


def oversize(path: Path, src: str) -> list[str]:
    name = path.relative_to(ROOT).as_posix()
    out = []
    if src.count("\n") > MODULE_LINES:
        out.append(f"{name}: {src.count(chr(10))} lines (limit {MODULE_LINES})")
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
            n = node.end_lineno - node.lineno + 1
            if n > CLASS_LINES:
                out.append(f"{name}: class {node.name} is {n} lines (limit {CLASS_LINES})")
    return out


def test_no_runtime_module_or_class_is_oversize() -> None:
    big = [line for f in runtime_files() for line in oversize(f, f.read_text())]
    assert not big, "split these into composed parts:\n" + "\n".join(big)


def test_the_size_check_sees_an_oversize_class_and_module(tmp_path: Path) -> None:
    src = "class Big:\n" + "    x = 1\n" * (MODULE_LINES + 1)
    found = oversize(ROOT / "echo_rl" / "core" / "big.py", src)
    assert len(found) == 2 and "class Big" in found[1]


def test_only_the_simulator_and_the_entry_use_the_simulator() -> None:
    users = []
    for f in runtime_files():
        name = f.relative_to(ROOT).as_posix()
        if name.startswith(("echo_rl/provisioning/sim/", *ENTRY)):
            continue
        for node in ast.walk(ast.parse(f.read_text())):
            mod = node.module if isinstance(node, ast.ImportFrom) and node.level == 0 else None
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [mod or ""]
            users += [
                f"{name} imports {m}" for m in names if m.startswith("echo_rl.provisioning.sim")
            ]
    assert not users, "the simulator uses the runtime, never the other way round:\n" + "\n".join(
        users
    )
