"""The columns of ``check.csv``, each declared once with its unit and meaning."""

from __future__ import annotations

from harness.studies.schema import ACCUM_STEPS, EQUIVALENCES, Column

COLUMNS: tuple[Column, ...] = (
    Column("setup", "", "the Setup's name (the factory's name when it gives none)"),
    Column("strategy", "`local`, `ddp`, `fsdp`",
           "one process playing the N ranks in turn, DistributedDataParallel, or FSDP2's "
           "`fully_shard`"),
    Column("world_size", "ranks", "N: ranks the global batch is split across"),
    ACCUM_STEPS,
    Column("step", "steps", "optimizer step compared, from 0 (each on its own global batch)"),
    Column("point", "`grad`, `params`, `buffers`",
           "what is compared: `param.grad` right before `optimizer.step()`, the parameters "
           "right after it, or the buffers (models with some), both as updates from where "
           "the reference started the step; buffers each on their own at scale 1, integer "
           "ones (counters) exactly"),
    Column("verdict", EQUIVALENCES,
           "against the single-process big-batch step: the same, a pure multiple s of it, or "
           "no multiple"),
    Column("scale", "ratio", "s in `measured ~ s * reference` (least squares over every tensor)"),
    Column("residual", "ratio", "`||measured - s*reference|| / ||measured||`: 0 when a pure "
           "scale explains it"),
    Column("worst_tensors", "`name=error;...`",
           "the three tensors with the largest `||m - s*r|| / ||s*r||`, worst first"),
    Column("ranks_agree", "`True`, `False`, empty",
           "DDP: whether every rank held the same gradients (`grad`) or parameters "
           "(`params`), as DDP promises; where they differ, each rank's own tensors were "
           "compared. Empty for `local` and `fsdp`, whose ranks are not meant to, and for "
           "`buffers`"),
    Column("fix", "text", "what to change, read from the measurement; empty when it matches"),
    Column("dtype", "`float64`, `float32`", "floating-point type of the model and the batches"),
    Column("precision", "`float64`, `float32`, `bfloat16`, `float16`",
           "the lowest precision the step really ran in (the model's type, the autocast "
           "type, the type of every loss the setup's functions returned): the row's "
           "tolerance is that precision's"),
    Column("status", "", "`ok`, `skipped: why`, or `error`"),
    Column("error", "text", "the exception of a case that failed (`Type: first sentence`), "
           "or where its loss or gradient first held a NaN or an infinity"),
)
COLUMN_NAMES = tuple(column.name for column in COLUMNS)
