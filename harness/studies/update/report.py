"""The ``update`` study's section: what to change when N devices or k micro-steps make the batch.

A subsection per experiment, each reading that experiment's CSV with the parts its plug-in
declares (``experiments/``); built from the registry when asked for. Every number and word
comes from the rows: the verdicts (``verdict``, ``lr_factor_verdict``) were written by
the study.
"""

from __future__ import annotations

from typing import Any

from harness.report.section import Section
from harness.studies.update.experiment import STUDY


def section() -> Section:
    """The study's title and intro over a subsection per registered experiment."""
    from harness.studies.update import experiments

    return Section(
        study=STUDY,
        title="update: is the optimizer step still the big batch's, and what must change?",
        intro=("The parameters after the optimizer step, against one process training on the "
               "big batch (every sample of the step, mean loss), in the run's dtype: one "
               "experiment per subsection, each with a CSV of its own ("
               + ", ".join(f"`{e.table.csv}`" for e in experiments.EXPERIMENTS) + ")."),
        subsections=tuple(e.section() for e in experiments.EXPERIMENTS))


def __getattr__(name: str) -> Any:
    """``SECTION``, built from the experiments registered when it is asked for."""
    if name == "SECTION":
        return section()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
