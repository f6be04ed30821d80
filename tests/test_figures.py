"""docs/results.md's "Measured" table and ``benchmarks/figures.py`` (``make figures``) cannot
drift apart (issue 54, item 2): one registry entry per table row, every stated figure verbatim in
its row, a reason wherever a row is not re-run, and every extraction run on the committed
result it names (nothing is re-run here) and within tolerance of the stated figure, unless the
registry marks the drift with its reason."""

from __future__ import annotations

import json
import re

import pytest

from benchmarks import figures as F
from benchmarks.figures import ROOT, ROWS

pytestmark = pytest.mark.timeout(60)

TABLE_ROWS = F.table_rows()


def test_every_readme_row_has_exactly_one_entry():
    assert len(TABLE_ROWS) >= 25  # the table was found and read
    for what, _, _ in TABLE_ROWS:
        hits = [r.id for r in ROWS if what.startswith(r.what)]
        assert len(hits) == 1, f"results row {what!r}: entries {hits}"
    assert len(ROWS) == len(TABLE_ROWS)
    assert len({r.id for r in ROWS}) == len(ROWS)


@pytest.mark.parametrize("row", ROWS, ids=lambda r: r.id)
def test_stated_figures_are_verbatim_in_the_row(row):
    _, figure, _ = F.row_of(row, TABLE_ROWS)
    for c in row.checks:
        assert c.stated in figure, f"{row.id}: {c.stated!r} is not in docs/results.md's {figure!r}"


@pytest.mark.parametrize("row", ROWS, ids=lambda r: r.id)
def test_a_row_says_why_it_is_not_rerun_and_a_rerun_writes_only_to_scratch(row):
    never = bool(row.why_not) or all(r.skip for r in row.runs)
    assert row.checks or never, f"{row.id}: nothing to compare and no reason given"
    assert not row.why_not or row.why_not.strip()
    assert set(row.needs) <= set(F.NEEDS)
    for c in row.checks:
        assert 0 <= c.run < len(row.runs) and 0 <= c.tol < 1, (row.id, c.figure)
    if never:
        return
    rerun = [r for r in row.runs if not r.skip]
    assert 0 < sum(r.minutes for r in rerun) * 60 <= F.LIMIT_S, row.id
    for r in rerun:
        # every output goes under the scratch folder: a re-run never touches benchmarks/results
        assert any("{out}" in a for a in r.argv), f"{row.id}: {r.argv}"
        assert all("benchmarks/results" not in a for a in r.argv), f"{row.id}: {r.argv}"
    for c in row.checks:
        run = row.runs[c.run]
        assert run.skip or run.output, f"{row.id}: {c.figure} reads no output"


CASES = [(row, c) for row in ROWS for c in row.checks if row.runs[c.run].committed]


@pytest.mark.parametrize(("row", "check"), CASES, ids=[f"{r.id}: {c.figure}" for r, c in CASES])
def test_each_extraction_reads_the_committed_result_and_holds(row, check):
    path = ROOT / row.runs[check.run].committed
    assert path.exists(), f"{row.id}: no {path}"
    measured = check.extract(path)
    verdict = F.compare(check, measured)
    if check.drift:
        assert verdict == "drifted", (
            f"{row.id}: {check.figure} reads {measured:.4g} and holds {check.stated!r} again: "
            "drop its drift mark"
        )
    else:
        assert verdict == "holds", (
            f"{row.id} drifted: {check.figure} reads {measured:.4g} in {path.name} against "
            f"{check.stated!r} ({check.value:.4g} within {check.tol:.0%}); restate docs/results.md "
            "or mark the check's drift with its reason"
        )


def test_most_rows_are_checked_against_a_committed_result():
    assert len({r.id for r, _ in CASES}) >= 20


def test_the_broadcast_commands_are_the_suites_cases():
    from benchmarks import broadcast_suite

    by_id = {r.id: r for r in ROWS}
    for row_id, case in (
        ("broadcast-16", "n16-chains-vs-star"),
        ("corrupt-relay", "n16-chains-corrupt1"),
        ("netns-shaping", "netns-n8-chains"),
    ):
        argv = list(by_id[row_id].runs[0].argv)
        assert argv[:2] == ["-m", "labs.broadcast_bench"]
        assert argv[2:-2] == broadcast_suite.CASES[case], row_id
        assert argv[-2:] == ["--json", "{out}/r.json"]


def test_compare_is_relative_and_exact_at_zero_tolerance():
    check = F.Check("f", "1.00 x", 1.0, 0.05, lambda p: 0.0)
    assert F.compare(check, 1.049) == "holds" and F.compare(check, 0.94) == "drifted"
    zero = F.Check("f", "0 lost", 0, 0, lambda p: 0.0)
    assert F.compare(zero, 0.0) == "holds" and F.compare(zero, 1.0) == "drifted"


def test_a_run_of_rows_not_rerunnable_here_writes_the_table_and_json(tmp_path, capsys):
    out = tmp_path / "figures.json"
    assert F.main(["--only", "sim-10k", "staleness", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["machine"]["cpu_count"] and doc["counts"]["holds"] == 0
    assert [r["id"] for r in doc["rows"]] == ["sim-10k", "staleness"]
    assert all(
        c["verdict"] == "not re-runnable here" and c["why"]
        for r in doc["rows"]
        for c in r["checks"]
    )
    assert "not re-runnable here" in capsys.readouterr().out
    assert F.main(["--only", "no-such-row", "--json", str(out)]) == 2


# ------------------------------------------------------------------ the README's short table

NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?")


def readme_results() -> list[tuple[str, str, str]]:
    """(what, figure, details) for each row of the README's "Results" table."""
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Results\n", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        if line.startswith("| ") and not line.startswith(("| what |", "|---")):
            what, figure, details = (c.strip() for c in line.strip().strip("|").split("|"))
            rows.append((what, figure, details))
    return rows


def test_the_readme_s_figures_are_the_cited_page_s():
    """Each figure of the README's short table is stated, number for number, on the page its
    row cites (docs/results.md, or the page that measured it): the README restates, the page
    holds the command and the run; a figure changed on one side only fails here."""
    rows = readme_results()
    assert len(rows) >= 6
    for what, figure, details in rows:
        (page,) = re.findall(r"`(docs/[\w-]+\.md)`", details)
        text = (ROOT / page).read_text()
        for number in NUMBER.findall(figure):
            assert re.search(rf"(?<![\d.]){re.escape(number)}(?![\d]|\.\d)", text), (
                f"README Results row {what!r}: {number} is not in {page}"
            )
