"""Imports go down the layers only, with no exception: within the one package ``echo_rl``,
``core`` is layer 0; ``broadcast`` and ``data`` 1; ``adapters`` and ``provisioning`` 2;
``control`` (the server) and ``worker`` 3; ``learner`` (the process that builds the server beside
its trainer) 4; ``cli`` (the two commands) 5, at the top, imported by nothing but
``echo_rl/__main__.py``. Runtime modules never import labs/, benchmarks/ or tests/, and nothing
imports the old top-level names (issue 53: one import name)."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "echo_rl"
LAYER = {
    "core": 0,
    "broadcast": 1,
    "data": 1,
    "adapters": 2,
    "provisioning": 2,
    "control": 3,
    "worker": 3,
    "learner": 4,
    "cli": 5,
}
OLD_NAMES = {"echo", "learner", "worker", "broadcast", "dataplane", "adapters", "provisioning"}
NEVER = {"labs", "benchmarks", "tests"} | OLD_NAMES

pytestmark = pytest.mark.timeout(60)


def imported(path: Path) -> tuple[set[str], set[str]]:
    """(top-level names, echo_rl subpackages) a module imports, at any depth of the file (lazy
    imports count); a relative import counts as its own subpackage."""
    tops: set[str] = set()
    subs: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
            if node.module == "echo_rl":
                subs |= {a.name for a in node.names}
        for name in names:
            parts = name.split(".")
            tops.add(parts[0])
            if parts[0] == "echo_rl" and len(parts) > 1:
                subs.add(parts[1])
    return tops, subs


def modules() -> list[tuple[str, str]]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if len(rel.parts) > 1:
            out.append((rel.parts[0], path.relative_to(ROOT).as_posix()))
    return out


def test_every_module_is_in_a_layered_subpackage():
    assert {sub for sub, _ in modules()} == set(LAYER)
    loose = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert loose == ["__init__.py", "__main__.py"], loose
    assert len(modules()) > 200  # the package was found


@pytest.mark.parametrize("package, rel", modules())
def test_imports_go_down_the_layers(package, rel):
    tops, subs = imported(ROOT / rel)
    assert not tops & NEVER, f"{rel} imports {sorted(tops & NEVER)}"
    up = sorted(s for s in subs if LAYER.get(s, 99) > LAYER[package])
    assert not up, f"{rel} (layer {LAYER[package]}, {package}) imports {up} from a higher layer"


def test_the_layer_test_catches_an_upward_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from echo_rl.learner.trainer import Trainer\n")
    _, subs = imported(bad)
    assert subs == {"learner"} and LAYER["learner"] > LAYER["core"]
    bad.write_text("from echo_rl import cli\nimport echo.config\n")
    tops, subs = imported(bad)
    assert "cli" in subs and "echo" in tops & NEVER
