"""The ``update`` study's section: what to change when N devices or k micro-steps make the batch.

A subsection per experiment, each reading that experiment's CSV with the parts its plug-in
declares (``experiments/``). Every number and word comes from the rows: the verdicts
(``verdict``, ``lr_factor_verdict``) were written by the study.
"""

from __future__ import annotations

from collections.abc import Sequence

from harness.report.section import Section
from harness.studies.update.experiment import STUDY, Experiment
from harness.studies.update.experiments import EXPERIMENTS


def section(experiments: Sequence[Experiment]) -> Section:
    """The study's title and intro over a subsection per experiment, in their order."""
    return Section(
        study=STUDY,
        title="update: is the optimizer step still the big batch's, and what must change?",
        intro=("The parameters after the optimizer step, against one process training on the "
               "big batch (every sample of the step, mean loss), in the run's dtype: one "
               "experiment per subsection, each with a CSV of its own ("
               + ", ".join(f"`{e.table.csv}`" for e in experiments) + ")."),
        subsections=tuple(e.section() for e in experiments))


SECTION = section(EXPERIMENTS)
