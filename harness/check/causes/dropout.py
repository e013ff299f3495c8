"""Cause ``dropout``: the script's model has dropout that trains: each split draws other
masks, so no split can give the reference's step."""

from __future__ import annotations

from harness.check.causes.cause import Cause
from harness.check.causes.evidence import Evidence
from harness.check.causes.words import shown


def applies(evidence: Evidence) -> bool:
    return evidence.script is not None and bool(evidence.script.dropout)


def fix(evidence: Evidence) -> str:
    return (f"the model's dropout ({shown(list(evidence.script.dropout))}) is active: each "
            "split draws other masks, so no split can give the reference's step; set its "
            "probability to 0 while checking")


CAUSE = Cause(id="dropout", summary="dropout that trains", applies=applies, fix=fix)
