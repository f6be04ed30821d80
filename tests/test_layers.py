"""Imports go down the layers only: echo 0; broadcast, dataplane 1; adapters, provisioning 2;
learner, worker 3. The entry modules (echo/cli.py, echo/commands/, worker/cli.py) may import
any plane; runtime packages never import labs/, benchmarks/ or tests/."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAYER = {
    "echo": 0,
    "broadcast": 1,
    "dataplane": 1,
    "adapters": 2,
    "provisioning": 2,
    "learner": 3,
    "worker": 3,
}
NEVER = {"labs", "benchmarks", "tests"}
ENTRY = ("echo/cli.py", "echo/commands/", "worker/cli.py")


def imported(path: Path) -> set[str]:
    """Top-level packages a module imports, at any depth of the file (lazy imports count)."""
    tops = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            tops |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            tops.add(node.module.split(".")[0])
    return tops


def modules():
    for package in LAYER:
        for path in sorted((ROOT / package).rglob("*.py")):
            yield package, path.relative_to(ROOT).as_posix()


@pytest.mark.parametrize("package, rel", list(modules()))
def test_imports_go_down_the_layers(package, rel):
    tops = imported(ROOT / rel)
    assert not tops & NEVER, f"{rel} imports {sorted(tops & NEVER)}"
    if rel.startswith(ENTRY):
        return
    up = sorted(t for t in tops if LAYER.get(t, -1) > LAYER[package])
    assert not up, f"{rel} (layer {LAYER[package]}) imports {up} from a higher layer"
