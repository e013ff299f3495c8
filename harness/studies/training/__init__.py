"""The training study: see study.py (measurement) and report.py (its report section)."""

from harness.studies.training.study import TrainingStudy as STUDY

__all__ = ["STUDY"]
