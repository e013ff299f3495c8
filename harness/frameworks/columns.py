"""The columns of a framework's row: what it was told, and what its optimizer was handed
against the big batch, judged by the check's own rules (torch-free: the check's
``--frameworks`` front-end, the frameworks study's schema and the report read them)."""

from __future__ import annotations

from harness import columns as shared
from harness.columns import Column

#: What ``point`` names: the gradient before the step, the update it made.
POINTS = ("grad", "params")

COLUMNS = (
    Column("framework", "`accelerate`, `lightning`, `transformers`, `deepspeed`",
           "the training framework: HF Accelerate, PyTorch Lightning, HF transformers' "
           "`Trainer`, DeepSpeed's engine"),
    Column("framework_version", "", "the installed version of the framework's package"),
    Column("setting", "text",
           "the framework's configuration: `default` runs it exactly as shipped; any other "
           "name is the one setting changed from the shipped defaults"),
    Column("code", "text",
           "the complete configuration the harness passed, exactly as passed (the "
           "`Accelerator`/`Trainer`/`TrainingArguments` call, the DeepSpeed JSON), and how "
           "the setup's model, scheduler and data went in"),
    shared.WORLD_SIZE.described("N: ranks training together (every rank of the launch)"),
    shared.ACCUM_STEPS,
    Column("step", "steps", "optimizer step compared, from 0 (each on its own global batch)"),
    Column("point", "`grad`, `params`",
           "what is compared: the gradient the optimizer was handed, read in its `step` "
           "right before the update; or the update it made, θ_after − θ_before, read right "
           "after"),
    Column("model_dtype", "`float64`, `float32`",
           "dtype the framework trained in (DeepSpeed: float32, its ZeRO master weights' "
           "type; float32 under autocast); the references are float64 (float32 under "
           "autocast)"),
    shared.PRECISION,
    shared.AUTOCAST_RESIDUAL,
    Column("recipe", "text",
           "what the framework does to the window's gradient besides accumulating it, as "
           "applied: `clip_grad_norm_(c) once per window`, or `none`"),
    shared.VERDICT.described(
        "against the plain big batch (one process, one backward on the whole global batch, "
        "the setup's step: a plain PyTorch loop): `matches` (`scale` 1, `residual` within "
        "the tolerance of `precision`), `scaled` (another pure multiple) or `differs`"),
    shared.SCALE,
    shared.RESIDUAL,
    Column("relative_error", "ratio", "`‖measured − reference‖ / ‖reference‖`"),
    Column("rank_spread", "ratio",
           "largest `‖x_rank − x_rank0‖ / ‖x_rank0‖` over the ranks: 0 when all agree"),
    shared.WORST_TENSORS,
    Column("recipe_verdict", shared.EQUIVALENCES,
           "the same against the big batch run under the framework's `recipe` (its clip "
           "applied once to the big batch's gradient): equal to `verdict` where the recipe "
           "is `none`; the verdict `--fail-on` judges"),
    Column("recipe_scale", "ratio", "s against the recipe's big batch"),
    Column("recipe_residual", "ratio", "the residual against the recipe's big batch"),
    shared.FIX.described("what to change for the plain big-batch step, read from the two "
                  "comparisons and what the framework was seen to do; empty when it matches"),
    Column("optimizer_steps", "steps",
           "optimizer steps the framework took (one per window of k micro-steps expected)"),
    Column("tokens_per_rank", "tokens, `;`-separated",
           "real (unpadded) tokens, or samples, each rank trained on in step 0's window"),
    shared.ERROR.described("the exception the framework raised for this setting (status `error`), "
                    "or the steps it took where one per window was expected, else empty"),
)
NAMES = tuple(column.name for column in COLUMNS)
