"""The answer table that opens REPORT.md reads at a glance, on the committed results.

Each cell is short (the per-setting detail lives in the section a question links
to), a question names the situation rather than a source post's number, and a
row that rests on the DataParallel emulation alone says so.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pandas as pd
import pytest

from harness.report import REPORT_NAME, write_report
from harness.report.findings import emulation_only

ROOT = Path(__file__).resolve().parent.parent
#: The longest an answer-table cell may be, link markup included.
CELL_LIMIT = 200


def answer_rows(report: str) -> list[list[str]]:
    """The answer table's body rows, as cells."""
    table = report.split("## Answers", 1)[1].split("\n\n", 2)[2].split("\n\n")[0]
    return [[cell.strip() for cell in line.strip().strip("|").split(" | ")]
            for line in table.splitlines()[2:]]


@pytest.fixture(scope="module", params=["results", "results/frameworks"])
def rendered(request, tmp_path_factory) -> str:
    """The report of a committed results folder, rendered afresh from its CSVs."""
    folder = Path(shutil.copytree(ROOT / request.param, tmp_path_factory.mktemp("r") / "run",
                                  ignore=shutil.ignore_patterns("frameworks")))
    write_report(folder)
    return (folder / REPORT_NAME).read_text()


def test_every_answer_cell_fits_at_a_glance(rendered):
    rows = answer_rows(rendered)
    assert rows
    long = {row[0][:60]: max(len(cell) for cell in row) for row in rows
            if max(len(cell) for cell in row) > CELL_LIMIT}
    assert long == {}


def test_questions_name_the_situation_not_a_source_post(rendered):
    questions = [row[0].split("](")[0] for row in answer_rows(rendered)]
    assert not [q for q in questions if "seed 0" in q.lower()]


def test_the_dataparallel_rows_say_they_rest_on_the_emulation():
    report = (ROOT / "results" / REPORT_NAME).read_text()
    frame = pd.read_csv(ROOT / "results" / "reduction.csv")
    real = frame[frame["strategy"] == "dp"]
    row = next(r for r in answer_rows(report) if r[0].startswith("[DataParallel (CPU emulation)"))
    if (real["status"] == "ok").any():
        assert "emulation only" not in row[1]
    else:
        assert f"CPU emulation only; the {len(real)} real DataParallel cases skipped" in row[1]


def test_emulation_only_is_said_only_where_the_real_strategy_was_not_measured():
    skipped = pd.DataFrame({"strategy": ["dp", "dp", "ddp"],
                            "status": ["skipped: no GPU", "skipped: no GPU", "ok"]})
    assert emulation_only(skipped) == "CPU emulation only; the 2 real DataParallel cases skipped"
    assert emulation_only(skipped, {"strategy": "ddp"}) == ""
    measured = skipped.assign(status="ok")
    assert emulation_only(measured) == ""


def test_the_committed_reports_are_what_their_csvs_render(rendered, request):
    folder = ROOT / request.node.callspec.params["rendered"]
    assert (folder / REPORT_NAME).read_text() == rendered
