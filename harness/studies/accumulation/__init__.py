"""The accumulation study: see study.py (measurement), recipes.py (its cases: the recipes
measured), schema.py (its columns) and report.py (its report section)."""

from harness.studies import lazy_study

__getattr__ = lazy_study(__name__, "AccumulationStudy")
__all__ = ["STUDY"]  # noqa: F822 -- lazy_study provides it
