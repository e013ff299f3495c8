"""The diagnostics study: see study.py (measurement) and report.py (its report section)."""

from harness.studies.diagnostics.study import DiagnosticsStudy as STUDY

__all__ = ["STUDY"]
