"""The columns of a framework's row: what it was told, and what its optimizer was handed
against the big batch, judged by the check's own rules (torch-free: the check's
``--frameworks`` front-end, the frameworks study's schema and the report read them)."""

from __future__ import annotations

from harness import columns as shared
from harness.columns import Column

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
    Column("model_dtype", "`float64`, `float32`",
           "dtype the framework trained in (DeepSpeed: float32, its ZeRO master weights' "
           "type; float32 under autocast); the references are float64 (float32 under "
           "autocast)"),
    Column("recipe", "text",
           "what the framework does to the window's gradient besides accumulating it, as "
           "applied: `clip_grad_norm_(c) once per window`, or `none`"),
    *shared.judged_columns(
        point="what is compared: the gradient the optimizer was handed, read in its `step` "
              "right before the update; or the update it made, θ_after − θ_before, read "
              "right after",
        ranks_agree="whether every rank's optimizer was handed the same tensors "
                    "(`rank_spread` within the row's tolerance)",
        fix="what to change for the plain big-batch step, read from the two comparisons "
            "and what the framework was seen to do; empty when it matches",
        error="the exception the framework raised for this setting (status `error`), or the "
              "steps it took where one per window was expected, else empty"),
    shared.AUTOCAST_RESIDUAL,
    Column("relative_error", "ratio", "`‖measured − reference‖ / ‖reference‖`"),
    Column("rank_spread", "ratio",
           "largest `‖x_rank − x_rank0‖ / ‖x_rank0‖` over the ranks: 0 when all agree"),
    Column("recipe_verdict", shared.EQUIVALENCES,
           "the same against the big batch run under the framework's `recipe` (its clip "
           "applied once to the big batch's gradient): equal to `verdict` where the recipe "
           "is `none`; the verdict `--fail-on` judges"),
    Column("recipe_scale", "ratio", "s against the recipe's big batch"),
    Column("recipe_residual", "ratio", "the residual against the recipe's big batch"),
    Column("optimizer_steps", "steps",
           "optimizer steps the framework took (one per window of k micro-steps expected)"),
    Column("tokens_per_rank", "tokens, `;`-separated",
           "real (unpadded) tokens, or samples, each rank trained on in step 0's window"),
)
NAMES = tuple(column.name for column in COLUMNS)


def case_label(row: dict) -> str:
    """How a failing row of ``--frameworks`` names its case (its rows carry the setup)."""
    return (f"{row['setup']} {row['framework']} {row['setting']} N={row['world_size']} "
            f"k={row['accum_steps']}")


def judged_verdict(row: dict) -> str:
    """What ``--fail-on`` judges of a framework's row: the verdict against the big batch
    under the framework's own recipe (its shipped clip applied once), which is its
    ``verdict`` where the recipe is none."""
    return str(row.get("recipe_verdict") or row["verdict"])
