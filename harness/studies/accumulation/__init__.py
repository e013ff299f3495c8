"""The accumulation study: see study.py (measurement) and report.py (its report section)."""

from harness.studies.accumulation.study import AccumulationStudy as STUDY

__all__ = ["STUDY"]
