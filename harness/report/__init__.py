"""REPORT.md: the findings of a run, with tables and plots, built from its CSVs.

    from harness.report import write_report
    from harness.studies import catalogue
    write_report(Path("results"), catalogue())   # -> results/REPORT.md, results/figures/*.png

The folder is checked first (``run.json`` and every CSV it lists, with the
columns the report reads); a malformed folder raises :class:`ReportError`
before anything is written. Each study declares its section next to it, in
``harness/studies/<study>/report.py`` (see :mod:`harness.report.spec`); this package
imports no study: the caller hands it the studies' catalogue
(:mod:`harness.report.catalogue`). matplotlib is imported only here, when a report is
written, so that a study run that skips the report never loads it.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

from harness.report.data import ReportError

if TYPE_CHECKING:
    from harness.report.catalogue import Catalogue

REPORT_NAME = "REPORT.md"

__all__ = ["REPORT_NAME", "ReportError", "write_report"]


def write_report(out: Path, catalogue: Catalogue) -> Path:
    """Write ``out/REPORT.md`` and ``out/figures/*.png`` from the run in ``out``, each study's
    rows read and summarized as ``catalogue`` declares; its path."""
    from harness.manifest import read_manifest
    from harness.report.data import load_results, tolerance

    out = Path(out)
    manifest = read_manifest(out)  # first, and cheap: a wrong folder fails before heavy imports
    from harness.report.document import render_document
    from harness.report.figures import FigureWriter, style
    from harness.results import write_text_atomic

    # The run's studies that have a section; the others' rows are counted, not summarized.
    reported = {name: study for name in manifest.studies
                if (study := catalogue.get(name)) is not None and study.section is not None}
    sections = {name: study.section for name, study in reported.items()}
    results = load_results(out, manifest, reported)
    rtol = tolerance(results.dtype)
    figures = FigureWriter(out)

    def render(studies: list[str]) -> dict:
        return {study: _render_section(sections[study], results.frames, rtol, figures)
                for study in studies}

    with style():
        outputs = _on_two_processes(render, results.summarized, figures)
    figures.remove_stale()
    target = out / REPORT_NAME
    write_text_atomic(target, render_document(results, sections, outputs))
    return target


def _on_two_processes(render, studies: list[str], figures) -> dict:
    """``render(studies)``, every other study in a forked child where the system forks.

    Drawing figures is most of a report's time and a report machine has a core to
    spare: the child renders its sections (writing their figures) and sends back
    what it rendered; should it fail, the parent renders its share itself. The
    bytes of REPORT.md and of every figure are the same either way.
    """
    import os
    import pickle

    if len(studies) < 2 or not hasattr(os, "fork"):
        return render(studies)
    read, write = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(read)
        try:
            with os.fdopen(write, "wb") as pipe:
                pickle.dump((render(studies[1::2]), figures.written), pipe)
        finally:
            os._exit(0)
    os.close(write)
    outputs = render(studies[::2])
    with os.fdopen(read, "rb") as pipe:
        received = pipe.read()
    os.waitpid(child, 0)
    try:
        theirs, written = pickle.loads(received)
    except Exception:  # noqa: BLE001 -- the child died: its share is rendered here
        theirs, written = render(studies[1::2]), []
    figures.written += written
    return {study: {**outputs, **theirs}[study] for study in studies}


def _render_section(section, frames, rtol, figures):
    """A study's section; if it fails, the reason, so that the other studies still get theirs.

    A report is written at the end of a run whose CSVs are already safe on disk:
    one section's failure (a bug, or rows it did not expect) must not cost the others.
    """
    try:
        return section.summarize_run(frames, rtol, figures)
    except Exception as error:  # noqa: BLE001 -- reported in REPORT.md and on stderr
        reason = f"{type(error).__name__}: {error}"
        print(f"report: section {section.study} failed: {reason}", file=sys.stderr)
        return reason
