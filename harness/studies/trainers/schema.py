"""The ``trainers`` study's CSV columns (torch-free: the registry and the report read them).

One row per trainer, setting and split: the first window's gradient before the trainer's
clip (where it clips; else the gradient its first optimizer step was handed), judged by
``grad-check run`` against the same command's big-batch step (``1x1``), and, where the two
differ, the cause in the trainer's own terms with the line of its source that makes it.
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
        "the first window's gradient at this split, before the trainer's clip (where it "
        "clips: a clip that binds would hide a scale; else the gradient its first optimizer "
        "step was handed), against the same command's at 1x1 (one process, one "
        "micro-step), judged by `grad-check run`; empty where the run failed"),
    shared.SCALE.described("s in `measured ~ s * reference`, the gradient before the clip "
                           "(least squares over every tensor)"),
    shared.RESIDUAL.described("`||measured - s*reference||/||measured||`, the gradient before "
                              "the clip: 0 when a pure scale explains it"),
    _SCRIPT["clip"],
    _SCRIPT["clip_factor"].described(
        "`||gradient the optimizer was handed|| / ||gradient before the clip||` at this split: "
        "below 1 where the trainer's clip bound (the optimizer's gradient is this times the "
        "one compared); empty without a clip"),
    _SCRIPT["precision"],
    Column("check_cause", "id", "the cause `grad-check run` named for the difference (its "
           "id: docs/results.md's causes); empty where the split matched or its run failed"),
    Column("cause", "text", "why the step differs, in the trainer's own terms, where the "
           "cause `grad-check run` named for the measured difference (by its id), or the "
           "failed run's error (by its type and file), is one the study knows; else empty"),
    Column("source", "`file:line, function`", "the line of the trainer's installed source "
           "that makes the cause, found in this version by its function and its text"),
    Column("fix", "text", "the setting that makes the step the big batch's, where there is "
           "one; else what `grad-check run` measured and advised"),
    Column("cpu_args", "text", "what the command adds to the trainer's shipped config to run "
           "tiny, offline and on a CPU (the study's model, tokenizer, data and device)"),
    Column("command", "text", "the command line run at this split, as a shell types it: the "
           "variables added first (the trainer's offline settings; `ACCELERATE_USE_CPU=1` "
           "where `grad-check run` gave it to a launcher on a machine without GPUs), the "
           "launcher's arguments it added (`--multi_gpu`), b, k and N filled in; "
           "`{assets}` the study's offline files, `{scripts}` the project's examples/scripts/, "
           "`{python}` the trainer's own environment's Python"),
)
