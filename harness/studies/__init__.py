"""The studies, one module each; ``STUDIES`` lists them in the order a run executes them."""

from __future__ import annotations

from harness.studies.accumulation import AccumulationStudy
from harness.studies.base import Case, Study
from harness.studies.diagnostics import DiagnosticsStudy
from harness.studies.reduction import ReductionStudy
from harness.studies.seed001 import Seed001Study
from harness.studies.seed004 import Seed004Study
from harness.studies.training import TrainingStudy

STUDIES: dict[str, type[Study]] = {
    study.name: study
    for study in (
        ReductionStudy,
        Seed001Study,
        AccumulationStudy,
        TrainingStudy,
        Seed004Study,
        DiagnosticsStudy,
    )
}

__all__ = ["STUDIES", "Case", "Study"]
