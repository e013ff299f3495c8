"""Findings every study's section can state the same way."""

from __future__ import annotations

from typing import TYPE_CHECKING

from harness.report.rows import ordered
from harness.report.section import Finding, SectionInputs
from harness.report.text import strategy_name

if TYPE_CHECKING:
    import pandas as pd


def skipped_findings(frame: pd.DataFrame, inputs: SectionInputs, unit: str = "case",
                     headline: bool = False) -> list[Finding]:
    """Per strategy, how many of its rows were not measured, and why (the ``status`` texts)."""
    skipped = frame[frame["status"] != "ok"]
    findings = []
    for strategy in ordered(skipped, "strategy"):
        rows = skipped[skipped["strategy"] == strategy]
        total = int((frame["strategy"] == strategy).sum())
        reasons = ordered(rows, "status")
        shown = "; ".join(reasons[:2]) + ("; ..." if len(reasons) > 2 else "")
        name = strategy_name(strategy)
        text = (f"{name} was not measured: all {total} of its {unit}s were skipped ({shown})."
                if len(rows) == total else
                f"{len(rows)} of the {total} {unit}s of {name} were skipped ({shown}).")
        source = inputs.source(f"strategy = {strategy}, status != ok", len(rows))
        findings.append(Finding(text, source, headline=headline))
    return findings
