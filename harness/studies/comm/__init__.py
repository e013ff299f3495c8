"""The comm study: see study.py (measurement) and report.py (its report section)."""

from harness.studies.comm.study import CommStudy as STUDY

__all__ = ["STUDY"]
