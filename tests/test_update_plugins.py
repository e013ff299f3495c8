"""The update study's experiments are plug-ins: the study, its CSVs, its schema and its
report read the registry, so that an experiment added to it (here a throwaway one, in
the test) shows up in the cases, a CSV of its own and a subsection of REPORT.md with no
other change."""

from __future__ import annotations

import csv
import re
import subprocess
import sys

import pandas as pd
import pytest
import torch

from harness.report.figures import FigureWriter
from harness.report.section import Finding
from harness.studies import study_tables
from harness.studies.schema import Column
from harness.studies.update import columns, experiments, report, schema
from harness.studies.update.experiment import Experiment, Grid, report_part
from harness.studies.update.study import UpdateStudy
from harness.verdicts import Equivalence
from tests.distributed import run_cli
from tests.runs import make_run

NAME = "throwaway"


def measure_square(trial) -> list[dict]:
    """d(w²)/dw at w = N, by autograd: 2N."""
    w = torch.tensor(float(trial.world_size), dtype=torch.float64, requires_grad=True)
    (w * w).backward()
    exact = float(w.grad) == 2 * trial.world_size
    return [{"gradient": float(w.grad),
             "verdict": Equivalence.MATCHES if exact else Equivalence.DIFFERS}]


@report_part()
def square_finding(rows: pd.DataFrame, inputs) -> Finding:
    pairs = ", ".join(f"{g:g} at N = {n}" for n, g in zip(rows["world_size"], rows["gradient"],
                                                          strict=True))
    return Finding(f"The gradient of w² at w = N was {pairs}.",
                   inputs.source("status = ok", len(rows)))


THROWAWAY = Experiment(
    name=NAME,
    question="is the gradient of w² at w = N equal to 2N?",
    intro="One weight, one backward per world size.",
    columns=(columns.strategy("local"), columns.WORLD_SIZE,
             Column("gradient", "", "d(w²)/dw at w = N"), columns.VERDICT),
    grid=lambda offered: [{"strategy": "local", "world_size": n} for n in offered.sizes],
    measure=measure_square,
    cost_ms=1.0,
    findings=(square_finding,),
)


@pytest.fixture
def registered(monkeypatch):
    """The throwaway experiment registered after the study's own: in the registry, and in
    what the schema and the report build from the registry when they are imported (as
    adding it to the tuple in experiments/__init__.py would)."""
    registry = (*experiments.EXPERIMENTS, THROWAWAY)
    monkeypatch.setattr(experiments, "EXPERIMENTS", registry)
    monkeypatch.setattr(schema, "TABLES", tuple(e.table for e in registry))
    monkeypatch.setattr(report, "SECTION", report.section(registry))
    return THROWAWAY


def test_the_study_its_schema_and_its_report_read_the_registry(registered):
    names = [e.name for e in experiments.EXPERIMENTS]
    assert UpdateStudy.tables() == study_tables("update") == tuple(
        e.table for e in experiments.EXPERIMENTS)
    assert UpdateStudy.tables()[-1].csv == f"update-{NAME}.csv"
    assert [sub.csv for sub in report.SECTION.subsections] == [
        f"update-{name}.csv" for name in names]


@pytest.mark.launches(seconds=1)
def test_the_registry_its_schema_and_its_section_load_without_torch():
    """Each experiment's module holds its ``measure``, which imports torch when it runs: the
    registry, the CSVs' schema and the report section read the modules without it."""
    code = ("import sys\nimport harness.studies.update.experiments, "
            "harness.studies.update.schema, harness.studies.update.report\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True)
    assert done.stdout.strip() == "[]"


def test_each_csv_has_the_columns_its_experiment_declares_and_no_other():
    tables = study_tables("update")
    assert [t.columns for t in tables] == [e.columns for e in experiments.EXPERIMENTS]
    for table in tables:
        names = [c.name for c in table.columns]
        assert len(names) == len(set(names)), table.name
        assert names[:2] == ["strategy", "world_size"], table.name


def test_an_experiment_added_to_the_registry_gets_its_cases_and_its_rows(registered):
    run = make_run("update")
    study = UpdateStudy()
    cases = [c for c in study.cases(run) if c["experiment"] == NAME]
    assert [c.id for c in cases] == [f"update/experiment={NAME}/strategy=local/world_size=1"]
    assert study.table_of(cases[0]) == THROWAWAY.table
    rows = study.run_case(cases[0], run)
    assert rows == [{"strategy": "local", "world_size": 1, "device": None, "gradient": 2.0,
                     "verdict": "matches"}]


def test_a_case_that_cannot_run_writes_its_coordinates_and_why(monkeypatch):
    run = make_run("update")
    study = UpdateStudy()
    case = next(c for c in study.cases(run) if c["experiment"] == experiments.EXPERIMENTS[0].name)
    monkeypatch.setattr("harness.studies.update.study.unavailable_reason",
                        lambda strategy, n, run: "skipped: for the test")
    (row,) = study.run_case(case, run)
    assert row["status"] == "skipped: for the test" and row["strategy"] == case["strategy"]
    declared = {c.name for c in experiments.EXPERIMENTS[0].columns}
    assert set(row) == declared | {"status", "device"}
    assert all(row[c] is None for c in declared - {"strategy", "world_size", "accum_steps"})


@pytest.mark.parametrize("world_sizes, full, sizes, widest", [
    ((1, 2, 3), False, (2, 3), (3,)), ((1, 2, 3), True, (1, 2, 3), (1, 2, 3)),
    ((1,), False, (1,), (1,))])
def test_the_grid_offers_the_multi_device_sizes_and_the_widest(world_sizes, full, sizes,
                                                               widest):
    offered = Grid(strategies=("local",), world_sizes=world_sizes, accum_steps=4, full=full)
    assert (offered.sizes, offered.widest) == (sizes, widest)


def test_an_experiments_grid_and_cost_come_from_its_declaration():
    offered = Grid(strategies=("local", "ddp"), world_sizes=(1, 2, 3), accum_steps=4,
                   full=False)
    assert THROWAWAY.grid(offered) == [{"strategy": "local", "world_size": 2},
                                       {"strategy": "local", "world_size": 3}]
    assert THROWAWAY.cost({"world_size": 2}) == 1.5
    assert THROWAWAY.cost({"world_size": 2, "accum_steps": 4}) == 6.0


def test_its_report_part_reads_its_rows_and_cites_its_csv(registered, tmp_path):
    frame = pd.DataFrame([{"study": "update", "case_id": "c", "strategy": "local",
                           "world_size": 3, "gradient": 6.0, "verdict": "matches",
                           "status": "ok"}])
    outputs = report.SECTION.summarize_run({THROWAWAY.table.csv: frame}, 1e-9,
                                           FigureWriter(tmp_path)).subsections
    assert list(outputs) == [THROWAWAY.table.csv]
    (finding,) = outputs[THROWAWAY.table.csv].findings
    assert finding.text == "The gradient of w² at w = N was 6 at N = 3."
    assert finding.source == f"`update-{NAME}.csv`: status = ok (1 row)"


@pytest.mark.launches(seconds=6)
def test_a_run_writes_the_added_experiments_csv_and_its_subsection(registered, tmp_path):
    out = tmp_path / "out"
    codes = run_cli(2, ["--studies", "update", "--world-sizes", "1,2", "--strategies", "local",
                        "--update-steps", "1", "--update-accum-steps", "2", "--update-lrs",
                        "0.01", "--out", str(out), "--quiet"], store_dir=tmp_path)
    assert codes == [0, 0]
    with open(out / f"update-{NAME}.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert [(r["world_size"], r["gradient"], r["verdict"]) for r in rows] == [
        ("2", "4.0", "matches")]
    assert list(rows[0])[:6] == ["study", "case_id", "strategy", "world_size", "gradient",
                                 "verdict"]
    text = (out / "REPORT.md").read_text()
    assert f"### `{NAME}`: is the gradient of w² at w = N equal to 2N?" in text
    assert f"The gradient of w² at w = N was 4 at N = 2. <sub>[`update-{NAME}.csv`" in text
    # The study's own experiments ran beside it, each into its CSV.
    assert (out / f"update-{experiments.EXPERIMENTS[0].name}.csv").is_file()


@pytest.mark.parametrize("change, message", [
    ({"name": "Lr_Factor"}, "lower-case words joined by '-'"),
    ({"columns": (columns.WORLD_SIZE, columns.strategy("local"))},
     "start with strategy, world_size"),
    ({"columns": (*THROWAWAY.columns, columns.VERDICT)}, "columns declared twice: verdict"),
    ({"cost_ms": 0.0}, "cost_ms 0.0 is not > 0"),
])
def test_a_declaration_the_study_could_not_use_is_refused_when_made(change, message):
    from dataclasses import replace

    with pytest.raises(ValueError, match=re.escape(message)):
        replace(THROWAWAY, **change)
