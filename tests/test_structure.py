"""The runtime package's shape, checked on every run (issue 53: these replace the line counts
issue 34 set, which invited squeezing a class under 300 lines instead of composing it):

* parts are built complete: no hand-written ``__init__`` takes more than eight parameters
  (group what travels together into a declared record, or pass the config section);
* no attribute is first set outside ``__init__`` (or the class body, for dataclasses), so
  reading a constructor tells everything an object holds;
* no part gets a callback after construction: a collaborator goes into the constructor (a
  narrow Protocol where one part needs another), never ``part.on_x = other.method`` later;
* the simulator (echo_rl/provisioning/sim/) is used by no runtime module outside it but the
  CLI. Layering is tests/test_layers.py.

Each check has a test that shows it catches what it forbids."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUNTIME = ("echo_rl",)
ENTRY = ("echo_rl/cli/",)
MAX_PARAMS = 8
INIT_LIKE = ("__init__", "__post_init__", "__new__", "__setstate__")

pytestmark = pytest.mark.timeout(60)


def runtime_sources() -> dict[str, str]:
    return {
        f.relative_to(ROOT).as_posix(): f.read_text()
        for p in RUNTIME
        for f in sorted((ROOT / p).rglob("*.py"))
    }


def _classes(sources: dict[str, str]) -> list[tuple[str, ast.ClassDef]]:
    return [
        (name, node)
        for name, src in sources.items()
        for node in ast.walk(ast.parse(src))
        if isinstance(node, ast.ClassDef)
    ]


def _methods(cls: ast.ClassDef) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    return [f for f in cls.body if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)]


def wide_constructors(sources: dict[str, str]) -> list[str]:
    out = []
    for name, cls in _classes(sources):
        for f in _methods(cls):
            if f.name == "__init__":
                a = f.args
                n = len(a.posonlyargs + a.args + a.kwonlyargs) - 1 + bool(a.vararg) + bool(a.kwarg)
                if n > MAX_PARAMS:
                    out.append(f"{name}:{f.lineno} {cls.name}.__init__ takes {n} parameters")
    return out


def _self_stores(fn: ast.AST) -> list[ast.Attribute]:
    return [
        n
        for n in ast.walk(fn)
        if isinstance(n, ast.Attribute)
        and isinstance(n.ctx, ast.Store)
        and isinstance(n.value, ast.Name)
        and n.value.id == "self"
    ]


def late_attributes(sources: dict[str, str]) -> list[str]:
    classes = _classes(sources)
    declared: dict[str, set[str]] = {}
    bases: dict[str, list[str]] = {}
    for _, cls in classes:
        names = declared.setdefault(cls.name, set())
        bases[cls.name] = [ast.unparse(b).split(".")[-1].split("[")[0] for b in cls.bases]
        for s in cls.body:
            if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name):
                names.add(s.target.id)
            elif isinstance(s, ast.Assign):
                names |= {t.id for t in s.targets if isinstance(t, ast.Name)}
            elif isinstance(s, ast.FunctionDef) and s.name in INIT_LIKE:
                names |= {a.attr for a in _self_stores(s)}
            elif isinstance(s, ast.FunctionDef) and any(
                isinstance(d, ast.Name) and d.id == "property" for d in s.decorator_list
            ):
                names.add(s.name)  # a property's setter stores through it

    def known(cls: str, attr: str, seen: frozenset[str] = frozenset()) -> bool:
        if attr in declared.get(cls, set()):
            return True
        return any(known(b, attr, seen | {cls}) for b in bases.get(cls, []) if b not in seen)

    out = []
    for name, cls in classes:
        for f in _methods(cls):
            if f.name in INIT_LIKE:
                continue
            for a in _self_stores(f):
                if not known(cls.name, a.attr):
                    out.append(f"{name}:{a.lineno} {cls.name}.{a.attr} first set in {f.name}")
    return sorted(set(out))


def late_callbacks(sources: dict[str, str]) -> list[str]:
    """``x.attr = <callable>`` on an object other than ``self``: a lambda, a method of the
    package (named, not called), or any ``on_*`` hook."""
    trees = {name: ast.parse(src) for name, src in sources.items()}
    methods = {
        f.name
        for tree in trees.values()
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef)
        for f in _methods(node)
        if not f.decorator_list
    }
    out = []
    for name, tree in trees.items():
        for node in ast.walk(tree):
            if not isinstance(node, ast.Assign):
                continue
            for target in node.targets:
                if not isinstance(target, ast.Attribute):
                    continue
                if isinstance(target.value, ast.Name) and target.value.id in ("self", "cls"):
                    continue
                v = node.value
                method = isinstance(v, ast.Attribute) and v.attr in methods
                if isinstance(v, ast.Lambda) or method or target.attr.startswith("on_"):
                    out.append(f"{name}:{node.lineno} {ast.unparse(target)} = {ast.unparse(v)}")
    return out


def test_constructors_take_at_most_eight_parameters() -> None:
    wide = wide_constructors(runtime_sources())
    assert not wide, "group what travels together into a declared record:\n" + "\n".join(wide)


def test_no_attribute_is_first_set_outside_init() -> None:
    late = late_attributes(runtime_sources())
    assert not late, "declare these in __init__ (or the class body):\n" + "\n".join(late)


def test_no_part_gets_a_callback_after_construction() -> None:
    late = late_callbacks(runtime_sources())
    assert not late, "pass these into the constructor instead:\n" + "\n".join(late)


def test_the_checks_see_what_they_forbid() -> None:
    src = (
        "class Wide:\n"
        "    def __init__(self, a, b, c, d, e, f, g, h, i):\n"
        "        self.a = a\n"
        "    def later(self):\n"
        "        self.b = 1\n"
        "        self.a = 2\n"
        "class Part:\n"
        "    def fire(self): pass\n"
        "class Base:\n"
        "    def __init__(self): self.x = 0\n"
        "class Child(Base):\n"
        "    def bump(self): self.x += 1\n"
        "def build(p, q):\n"
        "    p.on_done = q.fire\n"
        "    p.hook = q.fire\n"
        "    p.count = 3\n"
        "    p.cb = lambda: None\n"
    )
    sources = {"m.py": src}
    assert wide_constructors(sources) == ["m.py:2 Wide.__init__ takes 9 parameters"]
    assert late_attributes(sources) == ["m.py:5 Wide.b first set in later"]
    assert [line.split()[1] for line in late_callbacks(sources)] == ["p.on_done", "p.hook", "p.cb"]


def test_only_the_simulator_and_the_entry_use_the_simulator() -> None:
    users = []
    for name, src in runtime_sources().items():
        if name.startswith(("echo_rl/provisioning/sim/", *ENTRY)):
            continue
        for node in ast.walk(ast.parse(src)):
            mod = node.module if isinstance(node, ast.ImportFrom) and node.level == 0 else None
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [mod or ""]
            users += [
                f"{name} imports {m}" for m in names if m.startswith("echo_rl.provisioning.sim")
            ]
    assert not users, "the simulator uses the runtime, never the other way round:\n" + "\n".join(
        users
    )
