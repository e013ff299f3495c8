"""The hooks study: see study.py (measurement) and report.py (its report section)."""

from harness.studies.hooks.study import HooksStudy as STUDY

__all__ = ["STUDY"]
