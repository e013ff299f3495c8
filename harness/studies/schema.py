"""What a study's CSV holds: its columns, each with a unit and a meaning.

Free of torch, so that the registry, the README check and the report can read
every study's schema (``harness/studies/<name>/schema.py``) without loading a
study's measuring code. ``Table`` and the columns every CSV starts and ends with are
``harness.columns``' (the report reads them too); here they are with the columns several
studies share.
"""

from __future__ import annotations

from harness.columns import (
    ACCUM_STEPS,
    EQUIVALENCES,
    LEADING_COLUMNS,
    TRAILING_COLUMNS,
    Column,
    Table,
    names,
)
from harness.columns import WORLD_SIZE as _ANY_WORLD_SIZE

__all__ = ["ACCUM_STEPS", "EMULATED", "EQUIVALENCES", "LEADING_COLUMNS", "STRATEGY",
           "STRATEGY_OR_LOCAL", "TRAILING_COLUMNS", "WORLD_SIZE", "Column", "Table", "names"]

#: Columns several studies share, documented once.
STRATEGY = Column("strategy", "`ddp`, `fsdp`, `dp-emulated`, `dp`",
                  "how the model was wrapped: DistributedDataParallel, FSDP2's `fully_shard`, "
                  "a CPU emulation of DataParallel, the real DataParallel (CUDA)")
#: The same for a study whose cases include the one-process reference.
STRATEGY_OR_LOCAL = Column("strategy", "`local`, " + STRATEGY.unit,
                           "one process with nothing to reduce, or " + STRATEGY.doc)
EMULATED = Column("emulated", "bool", "true for the emulation")
#: N of a study whose strategies include DataParallel, which counts devices, not ranks.
WORLD_SIZE = _ANY_WORLD_SIZE.described(
    "N: ranks (DDP, FSDP) or devices asked for (DataParallel)", unit="devices")
