"""What the report and the docs read of the studies, handed to them by whoever joins the two.

The studies declare their sections with this package's vocabulary (``spec``, ``section``,
``text``, ...), so this package imports no study: ``write_report`` and the docs generator
are given a :data:`Catalogue` by their callers (``harness/runner.py``,
``harness/grad_report.py``, ``scripts/docs.py``), who build it with
``harness.studies.catalogue()``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from harness.columns import Table
    from harness.report.quoted import DocPart
    from harness.report.section import Section


@dataclass(frozen=True)
class ReportedStudy:
    """One study as the report and the docs read it."""

    name: str
    #: The CSVs it writes, with their columns: what the report reads of each.
    tables: tuple[Table, ...]
    #: Its section of REPORT.md; None: its rows are counted, not summarized.
    section: Section | None = None
    #: The generated parts of README.md and docs/ it states, by part name.
    doc_parts: Mapping[str, DocPart] = field(default_factory=dict)


#: Every study, by name, in the order a run executes them.
Catalogue = Mapping[str, ReportedStudy]
