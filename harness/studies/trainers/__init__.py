"""The trainers study: see study.py (measurement), trainers.py (what runs) and report.py
(its report section)."""

from harness.studies import lazy_study

__getattr__ = lazy_study(__name__, "TrainersStudy")
__all__ = ["STUDY"]  # noqa: F822 -- lazy_study provides it
