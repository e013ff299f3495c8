"""The update study: see study.py (its cases), experiments/ (an experiment each: its spec and
its measurement) and report.py (its report section)."""

from harness.studies import lazy_study

__getattr__ = lazy_study(__name__, "UpdateStudy")
__all__ = ["STUDY"]  # noqa: F822 -- lazy_study provides it
