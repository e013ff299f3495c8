"""REPORT.md: the findings of a run, with tables and plots, built from its CSVs.

    from harness.report import write_report
    write_report(Path("results"))          # -> results/REPORT.md, results/figures/*.png

The folder is checked first (``run.json`` and every CSV it lists, with the
columns the report reads); a malformed folder raises :class:`ReportError`
before anything is written. Each study's section lives next to it, in
``harness/studies/<study>/report.py``. matplotlib is imported only here, when a report
is written, so that a study run that skips the report never loads it.
"""

from __future__ import annotations

import sys
from pathlib import Path

from harness.report.data import ReportError

REPORT_NAME = "REPORT.md"

__all__ = ["REPORT_NAME", "ReportError", "write_report"]


def write_report(out: Path) -> Path:
    """Write ``out/REPORT.md`` and ``out/figures/*.png`` from the run in ``out``; its path."""
    from harness.report.data import load_results, read_manifest, tolerance

    out = Path(out)
    manifest = read_manifest(out)  # first, and cheap: a wrong folder fails before heavy imports
    from harness.report.document import render_document
    from harness.report.figures import FigureWriter, style
    from harness.results import write_text_atomic
    from harness.studies import STUDIES, report_section

    sections = {name: section for name in STUDIES if (section := report_section(name))}
    results = load_results(out, manifest, sections)
    rtol = tolerance(results.dtype)
    figures = FigureWriter(out)
    outputs = {}
    with style():
        for study, frame in results.frames.items():
            outputs[study] = _render_section(sections[study], frame, results.csv_name(study),
                                             rtol, figures)
    figures.remove_stale()
    target = out / REPORT_NAME
    write_text_atomic(target, render_document(results, sections, outputs))
    return target


def _render_section(section, frame, csv_name, rtol, figures):
    """A study's section; if it fails, the reason, so that the other studies still get theirs.

    A report is written at the end of a run whose CSVs are already safe on disk:
    one section's failure (a bug, or rows it did not expect) must not cost the others.
    """
    from harness.report.section import SectionInputs

    try:
        return section.render(frame, SectionInputs(csv_name, rtol, figures))
    except Exception as error:  # noqa: BLE001 -- reported in REPORT.md and on stderr
        reason = f"{type(error).__name__}: {error}"
        print(f"report: section {section.study} failed: {reason}", file=sys.stderr)
        return reason
