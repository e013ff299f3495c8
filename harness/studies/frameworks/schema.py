"""The ``frameworks`` study's CSV columns (torch-free: the registry and the report read them).

A framework's row (harness/adapters/columns.py, shared with ``grad-check
--frameworks``) and, after its configuration, which of the study's user setups it
trained and on which data.
"""

from __future__ import annotations

from harness.adapters.columns import COLUMNS as FRAMEWORK_COLUMNS
from harness.columns import POINTS, Column

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
#: A framework's row, its status in the column every study's CSV ends with.
_ROW = tuple(column for column in FRAMEWORK_COLUMNS if column.name != "status")
_AFTER = next(i for i, column in enumerate(_ROW) if column.name == "code") + 1
COLUMNS = (*_ROW[:_AFTER], *_STUDY_COLUMNS, *_ROW[_AFTER:])
