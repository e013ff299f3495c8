"""The diagnostics study: see study.py (measurement), model.py (the MLP it trains and its
knobs), schema.py (its columns) and report.py (its report section)."""

from harness.studies import lazy_study

__getattr__ = lazy_study(__name__, "DiagnosticsStudy")
__all__ = ["STUDY"]  # noqa: F822 -- lazy_study provides it
