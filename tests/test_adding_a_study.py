"""docs/architecture.md's "Adding a study", followed step by step for a throwaway study.

The steps write ``harness/studies/<name>/`` (``schema.py``, ``study.py``,
``report.py``, ``__init__.py``) and add the name to ``STUDY_PACKAGES``; the
test writes the package into a temporary folder that ``harness.studies``
searches, so the repository is left as it is. Then the driver must list the
study, run it, write its CSV with the schema's columns and its section in
REPORT.md, with no other change.
"""

from __future__ import annotations

import csv
import re
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

import harness.studies
from tests.distributed import run_cli

ROOT = Path(__file__).resolve().parent.parent
NAME = "throwaway"

PACKAGE = {
    "__init__.py": '''
        from harness.studies import lazy_study

        __getattr__ = lazy_study(__name__, "ThrowawayStudy")
        __all__ = ["STUDY"]  # noqa: F822
    ''',
    "schema.py": '''
        from harness.studies.schema import Column

        COLUMNS = (
            Column("world_size", "devices", "k"),
            Column("grad", "", "d/dw of the mean of w * x over k samples"),
            Column("verdict", "`matches`, `differs`", "grad equal to the mean of x or not"),
        )
    ''',
    "study.py": '''
        import torch

        from harness.studies.base import Case, Study
        from harness.studies.throwaway.schema import COLUMNS
        from harness.verdicts import Equivalence, close


        class ThrowawayStudy(Study):
            name = "throwaway"
            summary = "the gradient of a mean loss is the mean of the inputs"
            example = "python scripts/study.py --nproc 1 --studies throwaway"
            columns = COLUMNS
            in_default_run = False

            def cases(self, run):
                return [Case.of(self.name, world_size=k) for k in (1, 2, 3)]

            def run_case(self, case, run):
                k = case["world_size"]
                w = torch.ones((), dtype=torch.float64, requires_grad=True)
                x = torch.arange(1, k + 1, dtype=torch.float64)
                (w * x).mean().backward()
                grad = float(w.grad)
                mean = float(x.mean())
                verdict = Equivalence.MATCHES if close(grad, mean, run.rtol) else \\
                    Equivalence.DIFFERS
                return [{"world_size": k, "grad": grad, "verdict": verdict, "status": "ok"}]
    ''',
    "report.py": '''
        from harness.report import spec

        SECTION = spec.Section(
            study="throwaway",
            title="throwaway: is the gradient of a mean loss the mean of the inputs?",
            intro="One weight, k samples.",
            findings=(spec.Verdicts(column="verdict", subject="The gradient", per=(),
                                    phrases={"matches": "was the inputs' mean",
                                             "differs": "was not the inputs' mean"}),),
        )
    ''',
}


def architecture_steps() -> str:
    text = (ROOT / "docs" / "architecture.md").read_text()
    return text.split("## Adding a study", 1)[1].split("\n## ", 1)[0]


def test_the_steps_name_every_file_the_study_needs():
    steps = architecture_steps()
    for file in (*PACKAGE, "STUDY_PACKAGES", "results.md", "python scripts/docs.py"):
        assert file in steps, f"Adding a study does not mention {file}"


@pytest.fixture
def throwaway(tmp_path, monkeypatch) -> Iterator[Path]:
    package = tmp_path / "studies" / NAME
    package.mkdir(parents=True)
    for file, source in PACKAGE.items():
        (package / file).write_text(textwrap.dedent(source).lstrip())
    monkeypatch.setattr(harness.studies, "__path__", [*harness.studies.__path__,
                                                      str(package.parent)])
    monkeypatch.setattr(harness.studies, "STUDY_PACKAGES",
                        (*harness.studies.STUDY_PACKAGES, NAME))
    # The registry is built once per process (a cache): forget it so that it sees the new
    # study, and again afterwards so that the tests after this one see the studies alone.
    harness.studies._load.cache_clear()
    yield tmp_path
    harness.studies._load.cache_clear()


def test_a_study_written_from_the_steps_runs_and_reports_without_other_changes(throwaway):
    out = throwaway / "out"
    codes = run_cli(1, ["--studies", NAME, "--out", str(out), "--quiet"], store_dir=throwaway)
    assert codes == [0]
    with open(out / f"{NAME}.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert [r["world_size"] for r in rows] == ["1", "2", "3"]
    assert [float(r["grad"]) for r in rows] == [1.0, 1.5, 2.0]
    assert {r["verdict"] for r in rows} == {"matches"}
    report = (out / "REPORT.md").read_text()
    assert "## throwaway: is the gradient of a mean loss the mean of the inputs?" in report
    assert re.search(r"The gradient .*was the inputs' mean.*throwaway\.csv", report), report
