"""The ``trainers`` study's CSV columns (torch-free: the registry and the report read them).

One row per trainer, setting and split: the gradient its first optimizer step was handed,
judged by ``grad-check run`` against the same command's big-batch step (``1x1``), and,
where the two differ, the cause in the trainer's own terms with the line of its source
that makes it.
"""

from __future__ import annotations

from harness import columns as shared
from harness.columns import Column
from harness.grad_check.script.schema import COLUMNS as SCRIPT_COLUMNS

_SCRIPT = {column.name: column for column in SCRIPT_COLUMNS}

COLUMNS: tuple[Column, ...] = (
    Column("trainer", "text", "the trainer's program and recipe, as its users run it"),
    Column("trainer_version", "version", "the installed version of the trainer's package"),
    Column("setting", "text", "`default`: the trainer as shipped; else the one setting "
           "changed, as the trainer's users write it"),
    _SCRIPT["split"], _SCRIPT["world_size"], _SCRIPT["accum_steps"], _SCRIPT["micro_batch"],
    Column("global_batch", "samples", "G: samples per optimizer step, the same at every split"),
    shared.VERDICT.described(
        "the gradient the trainer's first optimizer step was handed at this split, against "
        "the same command's at 1x1 (one process, one micro-step), judged by `grad-check run`; "
        "empty where the run failed"),
    shared.SCALE, shared.RESIDUAL,
    _SCRIPT["precision"],
    Column("cause", "text", "why the step differs, in the trainer's own terms, where "
           "`grad-check run`'s explanation of the measured difference (or the failed run's "
           "error) names a cause the study knows; else empty"),
    Column("source", "`file:line, function`", "the line of the trainer's installed source "
           "that makes the cause, found in this version by its function and its text"),
    Column("fix", "text", "the setting that makes the step the big batch's, where there is "
           "one; else what `grad-check run` measured and advised"),
    Column("cpu_args", "text", "what the command adds to the trainer's shipped config to run "
           "tiny, offline and on a CPU (the study's model, tokenizer, data and device)"),
    Column("command", "text", "the command run, `{assets}` the study's offline files, "
           "`{batch}`, `{accum}`, `{nproc}` the split's b, k and N"),
)
