"""The answer table that opens REPORT.md reads at a glance, on the committed results.

Each cell is short (the per-setting detail lives in the section a question links
to), a question names the situation rather than a source post's number, and a
row that rests on the DataParallel emulation alone says so.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from harness.report import REPORT_NAME
from harness.report.findings import emulation_only
from harness.report.text import number, small
from tests.reports import committed_report
from tests.scheduling import launching

ROOT = Path(__file__).resolve().parent.parent
#: The longest an answer-table cell may be, link markup included.
CELL_LIMIT = 200


def answer_rows(report: str) -> list[list[str]]:
    """The answer table's body rows, as cells."""
    table = report.split("## Answers", 1)[1].split("\n\n", 2)[2].split("\n\n")[0]
    return [[cell.strip() for cell in line.strip().strip("|").split(" | ")]
            for line in table.splitlines()[2:]]


@pytest.fixture(scope="module", params=["results", "results/frameworks"])
@launching(seconds=5)
def rendered(request, tmp_path_factory) -> str:
    """The report of a committed results folder, rendered afresh from its CSVs."""
    return (committed_report(tmp_path_factory, request.param).folder / REPORT_NAME).read_text()


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


# ------------------------------------------------- answers against their rows
def row_of(report: str, question_start: str) -> list[str]:
    found = [r for r in answer_rows(report) if r[0].startswith(f"[{question_start}")]
    assert found, f"no answer row asks {question_start!r}"
    return found[0]


def between(values: pd.Series) -> str:
    low, high = small(values.min()), small(values.max())
    return low if low == high else f"{low} to {high}"


def test_the_printed_values_answer_counts_the_reproduced_ones():
    rows = pd.read_csv(ROOT / "results" / "seed001.csv")
    printed = rows[(rows["status"] == "ok") & rows["seed_printed"].notna()]
    same = int((printed["matches_seed"].astype(str) == "True").sum())
    _, answer, evidence, _ = row_of((ROOT / "results" / REPORT_NAME).read_text(),
                                    "DataParallel, mean loss: the source post printed")
    assert evidence.startswith(f"{same} of {len(printed)} printed values reproduced")
    off = printed[printed["matches_seed"].astype(str) == "False"].iloc[0]
    assert answer.startswith(f"{number(off['seed_printed'])} = {number(off['printed_ratio'])} × "
                             f"{number(off['measured_grad'])}: ")


def test_the_scale_answers_give_the_worst_residual_of_the_fitting_cases():
    rows = pd.read_csv(ROOT / "results" / "reduction.csv").query(
        "status == 'ok' and devices_used >= 2 and loss_reduction == 'mean'")
    fits = rows[rows["full_batch_verdict"] != "differs"]
    misfits = rows[rows["full_batch_verdict"] == "differs"]
    _, answer, evidence, _ = row_of((ROOT / "results" / REPORT_NAME).read_text(),
                                    "Training on N devices with a mean loss")
    assert evidence == (f"{len(rows)} cases, worst residual "
                        f"{small(fits['full_batch_residual'].max())} (BatchNorm: ≥ "
                        f"{small(misfits['full_batch_residual'].min())})")
    assert answer.endswith(f"no multiple for {', '.join(misfits['model'].unique())}")


def test_each_accumulation_fix_names_the_setting_it_goes_with():
    _, answer, _, fix = row_of((ROOT / "results" / REPORT_NAME).read_text(),
                               "Accumulating with zero_grad once per window")
    causes = answer.split("; ")
    fixes = fix.split("; ")
    assert len(causes) == len(fixes)
    for cause, fixed in zip(causes, fixes, strict=True):
        assert fixed.startswith(cause.split(" with ")[0] + ": ")
    # Each fix turns the failing settings into ones the rows show matching at every k.
    rows = pd.read_csv(ROOT / "results" / "accumulation.csv").query(
        "status == 'ok' and zero_grad == 'every-step' and norm == 'groupnorm' and shards == "
        "'even' and loss_normalization == 'micro-batch-mean' and loss_scaling == '1/k'")
    assert "norm = groupnorm" in fixes[0] and set(rows["verdict"]) == {"matches"}


def test_the_frameworks_answers_quote_their_default_and_the_misses():
    rows = pd.read_csv(ROOT / "results" / "frameworks" / "frameworks.csv").query(
        "status == 'ok' and point == 'grad'")
    report = (ROOT / "results" / "frameworks" / REPORT_NAME).read_text()
    for framework, group in rows.groupby("framework", sort=False):
        _, answer, evidence, _ = row_of(report, f"{framework} ")
        clips = group["recipe"].iloc[0] != "none"
        assert answer.startswith("`default` (clips to 1): " if clips else "`default`: ")
        matches = group[group["verdict"] == "matches"]
        assert evidence == (f"{len(group)} cases, worst residual of a match "
                            f"{small(matches['residual'].max())}")
        # The largest miss with equal lengths even under the framework's recipe is named.
        off = group[(group["loss"] == "mean") & (group["recipe_verdict"] == "scaled")]
        if not off.empty:
            row = off.loc[(off["recipe_scale"] - 1).abs().idxmax()]
            assert (f"`{row['setup']}`, `{row['setting']}` ({number(row['recipe_scale'])}× at "
                    f"k = {row['accum_steps']})") in answer


def test_the_powersgd_answer_gives_each_variants_error_after_its_exact_steps():
    rows = pd.read_csv(ROOT / "results" / "hooks.csv").query("status == 'ok'")
    _, answer, _, _ = row_of((ROOT / "results" / REPORT_NAME).read_text(),
                             "Which settings give neither the average")
    for variant in rows.loc[rows["verdict"] == "differs", "variant"].unique():
        differs = rows[(rows["variant"] == variant) & (rows["verdict"] == "differs")]
        assert f"{between(differs['relative_error'])} (DDP {variant})" in answer
