"""The studies, one module each; ``STUDIES`` lists them in the order a run executes them."""

from __future__ import annotations

from harness.studies.accumulation import AccumulationStudy
from harness.studies.base import Case, Study
from harness.studies.reduction import ReductionStudy
from harness.studies.seed001 import Seed001Study

STUDIES: dict[str, type[Study]] = {
    study.name: study
    for study in (
        ReductionStudy,
        Seed001Study,
        AccumulationStudy,
    )
}

__all__ = ["STUDIES", "Case", "Study"]
