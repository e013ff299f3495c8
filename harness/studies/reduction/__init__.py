"""The reduction study: see study.py (measurement) and report.py (its report section)."""

from harness.studies.reduction.study import ReductionStudy as STUDY

__all__ = ["STUDY"]
