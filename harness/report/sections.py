"""The registry of report sections: one module per study, listed here in report order.

To add a study's section, write ``harness/report/<study>.py`` defining
``SECTION = Section(...)`` (see harness/report/section.py) and add the module
below. A study of the run without a section is named in the report, with its
CSV, but not summarized.
"""

from __future__ import annotations

from harness.report import accumulation, diagnostics, reduction, seed001, seed004, training
from harness.report.section import Section

SECTIONS: dict[str, Section] = {
    module.SECTION.study: module.SECTION
    for module in (
        reduction,
        seed001,
        accumulation,
        training,
        seed004,
        diagnostics,
    )
}
