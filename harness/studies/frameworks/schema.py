"""The ``frameworks`` study's CSV columns (torch-free: the registry and the report read them).

A framework's row (harness/frameworks/columns.py, shared with ``grad-check
--frameworks``) and, after its configuration, which of the study's user setups it
trained and on which data.
"""

from __future__ import annotations

from harness.columns import Column
from harness.frameworks.columns import COLUMNS as FRAMEWORK_COLUMNS
from harness.frameworks.columns import POINTS

__all__ = ["COLUMNS", "POINTS"]

_STUDY_COLUMNS = (
    Column("setup", "text",
           "the user code trained: `tiny-lm` (the plain setup), a variant users write "
           "(`setup_code` says what it does), or a tiny Hugging Face model built from a "
           "config"),
    Column("setup_code", "text", "what the user's loss or model does"),
    Column("loss", "`mean`, `token`",
           "cross-entropy averaged over the real tokens of each micro-batch: `mean`, every "
           "sequence full length (every micro-batch holds as many tokens); `token`, padded "
           "sequences of random lengths (micro-batches hold different numbers)"),
)
_AFTER = FRAMEWORK_COLUMNS.index(next(c for c in FRAMEWORK_COLUMNS if c.name == "code")) + 1
COLUMNS = (*FRAMEWORK_COLUMNS[:_AFTER], *_STUDY_COLUMNS, *FRAMEWORK_COLUMNS[_AFTER:])
