"""The ``frameworks`` study's CSV columns (torch-free: the registry and the report read them)."""

from __future__ import annotations

from harness.studies.schema import ACCUM_STEPS, EQUIVALENCES, Column

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
           "`Accelerator`/`Trainer`/`TrainingArguments` call, the DeepSpeed JSON)"),
    Column("setup", "text",
           "the user code trained: `tiny-lm` (the plain setup), or a variant users write "
           "(`setup_code` says what it does)"),
    Column("setup_code", "text", "what the user's loss or model does"),
    Column("loss", "`mean`, `token`",
           "cross-entropy averaged over the real tokens of each micro-batch: `mean`, every "
           "sequence full length (every micro-batch holds as many tokens); `token`, padded "
           "sequences of random lengths 1..6 (micro-batches hold different numbers)"),
    Column("world_size", "ranks", "N: ranks training together (2)"),
    ACCUM_STEPS,
    Column("model_dtype", "`float64`, `float32`",
           "dtype the framework trained in (DeepSpeed: float32, its ZeRO master weights' "
           "type); the references are float64 and the verdicts use this dtype's tolerance"),
    Column("recipe", "text",
           "what the framework does to the window's gradient besides accumulating it, as "
           "applied: `clip_grad_norm_(c) once per window`, or `none`"),
    Column("point", "`grad`, `params`",
           "what is compared: the gradient the optimizer was handed, read in its `step` "
           "right before the update; or the update it made, θ_after − θ_0, read right after"),
    Column("verdict", EQUIVALENCES,
           "against the plain big batch (one process, one backward on the whole global "
           "batch, one step: a plain PyTorch loop): `matches` (`scale` 1, `residual` within "
           "the tolerance of `model_dtype`), `scaled` (another pure multiple) or `differs`"),
    Column("scale", "ratio", "s in `measured ~ s * reference`, the plain big batch's"),
    Column("residual", "ratio", "`‖measured − s·reference‖ / ‖measured‖`"),
    Column("relative_error", "ratio", "`‖measured − reference‖ / ‖reference‖`"),
    Column("rank_spread", "ratio",
           "largest `‖x_rank − x_rank0‖ / ‖x_rank0‖` over the ranks: 0 when all agree"),
    Column("worst_tensors", "`name=error;...`",
           "the three parameters with the largest `‖m − s·r‖ / ‖s·r‖` against the plain big "
           "batch, worst first"),
    Column("recipe_verdict", EQUIVALENCES,
           "the same against the big batch run under the framework's `recipe` (its clip "
           "applied once to the big batch's gradient): equal to `verdict` where the recipe "
           "is `none`"),
    Column("recipe_scale", "ratio", "s against the recipe's big batch"),
    Column("recipe_residual", "ratio", "the residual against the recipe's big batch"),
    Column("fix", "text",
           "what to change for the plain big-batch step, read from the two comparisons; "
           "empty when it matches"),
    Column("optimizer_steps", "steps",
           "optimizer steps the framework took for the k micro-steps (one expected)"),
    Column("tokens_per_rank", "tokens, `;`-separated",
           "real (unpadded) tokens each rank trained on in the window"),
    Column("error", "text",
           "the exception the framework raised for this setting (status `failed`), else empty"),
)

#: ``grad-check --frameworks``'s ``frameworks.csv``: the study's columns for a user's setup
#: (named in ``setup``; no study loss or variant), and each row's status.
CHECK_COLUMNS = ("setup", *(column.name for column in COLUMNS
                            if column.name not in ("setup", "setup_code", "loss")), "status")
