"""The columns of ``check.csv``, each declared once with its unit and meaning."""

from __future__ import annotations

from harness import columns as shared
from harness.columns import Column

COLUMNS: tuple[Column, ...] = (
    Column("setup", "", "the Setup's name (the factory's name when it gives none)"),
    Column("strategy", "`local`, `ddp`, `fsdp`",
           "one process playing the N ranks in turn, DistributedDataParallel, or FSDP2's "
           "`fully_shard`"),
    shared.WORLD_SIZE,
    shared.ACCUM_STEPS,
    Column("step", "steps", "optimizer step compared, from 0 (each on its own global batch)"),
    Column("point", "`grad`, `params`, `buffers`",
           "what is compared: `param.grad` right before `optimizer.step()`, the parameters "
           "right after it, or the buffers (models with some), both as updates from where "
           "the reference started the step; buffers each on their own at scale 1, integer "
           "ones (counters) exactly"),
    shared.VERDICT,
    shared.SCALE,
    shared.RESIDUAL,
    shared.WORST_TENSORS,
    Column("ranks_agree", "`True`, `False`, empty",
           "DDP: whether every rank held the same gradients (`grad`) or parameters "
           "(`params`), as DDP promises; where they differ, each rank's own tensors were "
           "compared. Empty for `local` and `fsdp`, whose ranks are not meant to, and for "
           "`buffers`"),
    shared.FIX,
    Column("dtype", "`float64`, `float32`", "floating-point type of the model and the batches"),
    shared.PRECISION,
    shared.AUTOCAST_RESIDUAL,
    Column("reference", "`whole`, `chunked`, `whole: why`",
           "the big-batch reference the row was compared with: one backward on the whole "
           "global batch in every rank, or, for a setup with `loss_terms`, the same gradient "
           "from chunks no larger than a micro-batch spread over the ranks; `whole: why` "
           "where `loss_terms` was given but its chunks cannot add up to the big batch "
           "(BatchNorm in training mode, a forward that changes a buffer, terms that do not "
           "add up)"),
    Column("status", "", "`ok`, `skipped: why`, or `error`"),
    shared.ERROR.described("the exception of a case that failed (`Type: first sentence`), "
                   "or where its loss or gradient first held a NaN or an infinity"),
)
COLUMN_NAMES = tuple(column.name for column in COLUMNS)
