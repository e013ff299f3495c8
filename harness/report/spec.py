"""The vocabulary a study's ``report.py`` declares its section with::

    from harness.report import spec

    SECTION = spec.Section(study=..., title=..., intro=...,
                           answers=(...), findings=(...), tables=(...), figures=(...))

Each part is a callable of :class:`~harness.report.section.Rows`; the generic
ones are configured with column names (``spec.Verdicts``, ``spec.VerdictAnswer``,
``spec.PerRow``, ``spec.skipped``, ``spec.Pivot``, ``spec.Records``,
``spec.Lines``, ``spec.Heatmap``), the evidence of a verdict with a detail
(``spec.ratio``, ``spec.spread``, ``spec.largest``, ``spec.joined``). A function
of ``Rows`` of the study's own is a part too.
"""

from harness.report.figures import Heatmap, Lines
from harness.report.findings import (
    BIG_BATCH,
    PerRow,
    VerdictAnswer,
    Verdicts,
    corrections,
    emulation_only,
    joined,
    largest,
    multiples,
    ratio,
    ratio_words,
    skipped,
    spread,
    yes_no,
)
from harness.report.section import Answer, Finding, Rows, Section
from harness.report.tables import Pivot, Records, cell, column, numbers

__all__ = ["BIG_BATCH", "Answer", "Finding", "Heatmap", "Lines", "PerRow", "Pivot", "Records",
           "Rows", "Section", "VerdictAnswer", "Verdicts", "cell", "column", "corrections",
           "emulation_only", "joined", "largest", "multiples", "numbers", "ratio", "ratio_words",
           "skipped", "spread", "yes_no"]
