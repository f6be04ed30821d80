"""Every file, test and symbol the README and docs/ cite by its repository path exists: a claim
names the test or command that checks it, and a renamed test or a result never written must not
leave a doc pointing at nothing (issue 34)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOP = (
    "benchmarks/",
    "tests/",
    "docs/",
    "echo_rl/",
    "examples/",
    ".ci/",
    "labs/",
)
CITE = re.compile(r"`([\w./-]+)((?:::[\w\[\]., -]+)?)`")
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

pytestmark = pytest.mark.timeout(60)


def problems(doc: Path) -> list[str]:
    out = []
    for m in CITE.finditer(doc.read_text()):
        path, test = m.group(1), m.group(2)
        if not path.startswith(TOP):
            continue  # a run directory's file, a bare name whose folder the text gives
        target = ROOT / path.rstrip("/")
        if not target.exists():
            module, _, symbol = path.partition(".")  # module/path.symbol
            source = ROOT / f"{module}.py"
            if symbol and source.exists():
                if not re.search(
                    rf"^\s*(def|class|async def) {re.escape(symbol.split('.')[0])}\b"
                    rf"|^{re.escape(symbol)}\s*[:=]",
                    source.read_text(),
                    re.M,
                ):
                    out.append(f"{path}: no {symbol} in {module}.py")
                continue
            out.append(f"{path}: no such file")
            continue
        if test and target.suffix == ".py":
            name = test[2:].split("::")[-1].split("[")[0]
            if not re.search(rf"(def|class) {re.escape(name)}\b", target.read_text()):
                out.append(f"{path}{test}: no such test")
    return out


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.name)
def test_what_a_doc_cites_exists(doc):
    assert problems(doc) == []


def test_the_checker_finds_a_missing_file_and_a_renamed_test(tmp_path):
    doc = tmp_path / "d.md"
    doc.write_text(
        "see `tests/test_docs_cite.py::test_what_a_doc_cites_exists`, "
        "`tests/test_docs_cite.py::test_gone`, `benchmarks/results/none.json`, "
        "`echo_rl/learner/trainer.token_logprobs` and `echo_rl/learner/trainer.nothing_here`"
    )
    assert problems(doc) == [
        "tests/test_docs_cite.py::test_gone: no such test",
        "benchmarks/results/none.json: no such file",
        "echo_rl/learner/trainer.nothing_here: no nothing_here in echo_rl/learner/trainer.py",
    ]
