"""The studies, one package each; ``STUDY_PACKAGES`` lists them in the order a run executes them.

Each package ``harness/studies/<name>/`` holds the study (``study.py``: options,
cases, measurement), its CSV's columns (``schema.py``, free of torch) and its
report section (``report.py``: what the report reads and draws). Its ``__init__``
exports ``STUDY``, the study class. Adding a study: write its package, add its name here.

Everything here is loaded on first use: the report reads schemas and sections
without importing a study's measuring code, and with it torch. The report itself imports
no study: ``catalogue()`` is what its callers hand it.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any

from harness.studies.schema import Column, Table

if TYPE_CHECKING:
    from harness.report.catalogue import Catalogue
    from harness.report.section import Section
    from harness.studies.base import Study

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
    "frameworks",
    "trainers",
)


@functools.cache
def _load() -> dict[str, type[Study]]:
    studies = {}
    for package in STUDY_PACKAGES:
        study = importlib.import_module(f"harness.studies.{package}").STUDY
        if study.name != package:
            raise RuntimeError(f"harness.studies.{package} exports the study {study.name!r}")
        studies[study.name] = study
    return studies


def __getattr__(name: str) -> Any:
    """``STUDIES`` (every study by name, in run order) and the study base classes, loaded
    when first asked for: they import the measuring code."""
    if name == "STUDIES":
        return _load()
    if name in ("Case", "Study", "StudyOptions"):
        return getattr(importlib.import_module("harness.studies.base"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def lazy_study(package: str, class_name: str) -> Callable[[str], Any]:
    """A study package's module ``__getattr__``: ``STUDY`` imported on first use, so that its
    schema and report section load without the measuring code (and torch)."""
    def attribute(name: str) -> Any:
        if name != "STUDY":
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.study"), class_name)
    return attribute


def study_columns(name: str) -> tuple[Column, ...]:
    """The own columns of study ``name``, which writes one CSV: its ``schema.COLUMNS``, else
    its study class's."""
    try:
        return importlib.import_module(f"harness.studies.{name}.schema").COLUMNS
    except ModuleNotFoundError:
        return __getattr__("STUDIES")[name].columns


def study_tables(name: str) -> tuple[Table, ...]:
    """The CSVs study ``name`` writes: its ``schema.TABLES`` where it writes several, else
    one, ``<name>.csv`` with its columns."""
    try:
        schema = importlib.import_module(f"harness.studies.{name}.schema")
    except ModuleNotFoundError:
        return __getattr__("STUDIES")[name].tables()
    tables = getattr(schema, "TABLES", None)
    return tuple(tables) if tables is not None else (Table(name, schema.COLUMNS),)


def _report_module(name: str) -> ModuleType | None:
    """Study ``name``'s ``report`` module, or None where it has none."""
    if name not in STUDY_PACKAGES:
        return None
    try:
        return importlib.import_module(f"harness.studies.{name}.report")
    except ModuleNotFoundError:
        return None


def report_section(name: str) -> Section | None:
    """The report section of study ``name`` (its package's ``report.SECTION``), or None."""
    return getattr(_report_module(name), "SECTION", None)


def doc_parts(name: str) -> dict[str, Callable[[Any], str]]:
    """The generated parts of README.md and docs/ that study ``name`` states (its package's
    ``report.DOC_PARTS``: a part's name and a function of the quoted results giving its
    text), or none."""
    return dict(getattr(_report_module(name), "DOC_PARTS", {}))


def catalogue() -> Catalogue:
    """What the report and the docs read of every study (its CSVs, its section, the parts of
    README.md and docs/ it states), in run order: read when called, without torch. The
    report imports no study: its callers hand it this."""
    from harness.report.catalogue import ReportedStudy

    return {name: ReportedStudy(name, study_tables(name), report_section(name), doc_parts(name))
            for name in STUDY_PACKAGES}


__all__ = ["STUDIES", "STUDY_PACKAGES", "Case", "Column", "Study", "StudyOptions",  # noqa: F822
           "Table", "catalogue", "doc_parts", "report_section", "study_columns",
           "study_tables"]
