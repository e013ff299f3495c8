"""The update study: see study.py (measurement) and report.py (its report section)."""

from harness.studies.update.study import UpdateStudy as STUDY

__all__ = ["STUDY"]
