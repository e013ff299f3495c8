"""The seed004 study: see study.py (measurement) and report.py (its report section)."""

from harness.studies.seed004.study import Seed004Study as STUDY

__all__ = ["STUDY"]
