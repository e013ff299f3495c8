"""The studies, one package each; ``STUDY_PACKAGES`` lists them in the order a run executes them.

Each package ``harness/studies/<name>/`` holds the study (``study.py``: schema,
options, cases, measurement) and its report section (``report.py``: what the
report reads and draws). Its ``__init__`` exports ``STUDY``, the study class.
Adding a study: write its package, add its name here.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from harness.studies.base import Case, Column, Study, StudyOptions

if TYPE_CHECKING:
    from harness.report.section import Section

STUDY_PACKAGES: tuple[str, ...] = (
    "reduction",
    "seed001",
    "accumulation",
    "update",
    "training",
    "seed004",
    "diagnostics",
    "hooks",
    "comm",
)


def _load() -> dict[str, type[Study]]:
    studies = {}
    for package in STUDY_PACKAGES:
        study = importlib.import_module(f"harness.studies.{package}").STUDY
        if study.name != package:
            raise RuntimeError(f"harness.studies.{package} exports the study {study.name!r}")
        studies[study.name] = study
    return studies


#: Every study by name, in run order.
STUDIES: dict[str, type[Study]] = _load()


def report_section(name: str) -> Section | None:
    """The report section of study ``name`` (its package's ``report.SECTION``), or None."""
    if name not in STUDIES:
        return None
    try:
        module = importlib.import_module(f"harness.studies.{name}.report")
    except ModuleNotFoundError:
        return None
    return getattr(module, "SECTION", None)


__all__ = ["STUDIES", "STUDY_PACKAGES", "Case", "Column", "Study", "StudyOptions",
           "report_section"]
