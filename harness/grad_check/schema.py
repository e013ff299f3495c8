"""The columns of ``check.csv``, each declared once with its unit and meaning: the case,
then the columns every judged row has (harness/columns.py ``JUDGED``), then its own."""

from __future__ import annotations

from harness import columns as shared
from harness.check.table import N_AND_K, POINT, STEP, VERDICT_CELLS, Cell, fix_cell, worst_cell
from harness.columns import Column

COLUMNS: tuple[Column, ...] = (
    Column("setup", "", "the Setup's name (the factory's name when it gives none)"),
    Column("strategy", "`local`, `ddp`, `fsdp`",
           "one process playing the N ranks in turn, DistributedDataParallel, or FSDP2's "
           "`fully_shard`"),
    shared.WORLD_SIZE,
    shared.ACCUM_STEPS,
    Column("dtype", "`float64`, `float32`", "floating-point type of the model and the batches"),
    Column("reference", "`whole`, `chunked`, `whole: why`",
           "the big-batch reference the row was compared with: one backward on the whole "
           "global batch in every rank, or, for a setup with `loss_terms`, the same gradient "
           "from chunks no larger than a micro-batch spread over the ranks; `whole: why` "
           "where `loss_terms` was given but its chunks cannot add up to the big batch "
           "(BatchNorm in training mode, a forward that changes a buffer, terms that do not "
           "add up)"),
    *shared.judged_columns(
        point=("what is compared: `param.grad` right before `optimizer.step()`, the "
               "parameters right after it, or the buffers (models with some), both as updates "
               "from where the reference started the step; buffers each on their own at scale "
               "1, integer ones (counters) exactly", "`grad`, `params`, `buffers`"),
        ranks_agree="DDP: whether every rank held the same gradients (`grad`) or parameters "
                    "(`params`), as DDP promises; where they differ, each rank's own tensors "
                    "were compared. Empty for `local` and `fsdp`, whose ranks are not meant "
                    "to, and for `buffers`",
        error="the exception of a case that failed (`Type: first sentence`), or where its "
              "loss or gradient first held a NaN or an infinity"),
    shared.AUTOCAST_RESIDUAL,
)
COLUMN_NAMES = tuple(column.name for column in COLUMNS)


def case_label(row: dict) -> str:
    """How a failing row names its case: the setup, the strategy, N and k."""
    return f"{row['setup']} {row['strategy']} N={row['world_size']} k={row['accum_steps']}"


#: The console table of check.csv's rows.
CELLS = (Cell("strategy", lambda row: str(row["strategy"])), *N_AND_K, STEP, POINT,
         *VERDICT_CELLS, Cell("worst tensors", worst_cell), Cell("fix", fix_cell))
