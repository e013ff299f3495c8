"""The seed001 study: see study.py (measurement) and report.py (its report section)."""

from harness.studies.seed001.study import Seed001Study as STUDY

__all__ = ["STUDY"]
