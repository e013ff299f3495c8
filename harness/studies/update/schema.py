"""The update study's CSV columns, and a row with every one of them (empty where unmeasured)."""

from __future__ import annotations

import math
from typing import Any

from harness.studies.schema import ACCUM_STEPS, WORLD_SIZE, Column

COLUMNS = (
    Column("experiment", "`lr-factor`, `clipping`, `grad-scaler`, `non-finite`, "
           "`bf16-accumulation`, `linear-scaling`, `momentum-correction`",
           "which question the row answers (see the study's description)"),
    Column("strategy", "`local`, `ddp`, `fsdp`, `dp-emulated`, `dp`",
           "one process; DistributedDataParallel; FSDP2's `fully_shard`; the CPU emulation of "
           "DataParallel; the real DataParallel (CUDA)"),
    Column("emulated", "bool", "true for the DataParallel emulation"),
    WORLD_SIZE.described(WORLD_SIZE.doc + "; 1 for `local`"),
    ACCUM_STEPS,
    Column("micro_batch", "samples", "b, samples per device per micro-step"),
    Column("loss", "`mean`, `mean/k`, `sum`, `sum/b`, `sum/(N*k*b)`",
           "each micro-step's loss from the loss terms of what this process's forward saw "
           "(DDP, FSDP: b samples; DataParallel: the N*b gathered ones): their mean; the "
           "mean / k; their sum; the sum / b (Goyal's \"normalize by n\"); the sum / the "
           "window's N*k*b samples (Goyal's \"normalize by kn\")"),
    Column("sync", "`every-micro-step`, `no_sync`, `none`",
           "when gradients are reduced: in every backward; DDP under `no_sync()` (FSDP2: "
           "`set_requires_gradient_sync(False)`) for the first k-1 micro-steps; never (one "
           "process)"),
    Column("optimizer", "`sgd`, `sgd-momentum`, `sgd-nesterov`, `sgd-weight-decay`, "
           "`sgd-l2-in-loss`, `adam`, `adam-large-eps`, `adamw`, `adamw-large-eps`",
           "the optimizer (hyperparameters in `optimizer_settings`)"),
    Column("optimizer_settings", "text", "its class and hyperparameters, e.g. `SGD lr=0.1 "
           "momentum=0.9`; `loss += 0.1/2*‖p‖²` for the L2 term in the loss"),
    Column("learning_rate", "lr", "the learning rate the recipe ran with (linear-scaling: the "
           "small-batch lr)"),
    Column("steps", "optimizer steps", "T, optimizer steps (windows) trained before comparing"),
    Column("setting", "text", "the experiment's variant: where clipping happens, the "
           "GradScaler recipe, where the non-finite value was put, the gradient dtype; "
           "linear-scaling: one step from the `initial` or `trained` weights, or 2W steps of "
           "early training `no-warm-up` or with Goyal's `warm-up` over W = 5 steps; "
           "momentum-correction: the lr-inside momentum form `lr-inside-corrected` or "
           "`lr-inside-uncorrected` at an lr change"),
    Column("dtype_used", "`float64`, `float32`, `bfloat16`",
           "dtype of the gradients the row measured (the run's, except bf16-accumulation)"),
    Column("grad_scale", "ratio", "s in `g ~ s * g_big`: the recipe's gradient of the first "
           "window fitted against the big batch's"),
    Column("grad_residual", "ratio", "`‖g - s·g_big‖ / ‖g‖`"),
    Column("param_distance", "ratio", "`‖θ - θ_ref‖ / ‖θ_ref‖` after the last step, θ_ref "
           "the big-batch run (linear-scaling: the N small steps)"),
    Column("update_error", "ratio", "`‖θ - θ_ref‖ / ‖θ_ref - θ_0‖`: the same error as a "
           "fraction of how far the reference moved"),
    Column("verdict", "`matches`, `differs`; `holds`, `breaks`",
           "`update_error` within the update tolerance (1e-9 in float64, 1e-5 in float32) or "
           "not; linear-scaling: within the rule's tolerance (0.1) or not"),
    Column("lr_factor", "ratio", "c: the run at lr·c gives the big-batch parameters "
           "(candidates 1 and 1/s; empty when none does)"),
    Column("lr_factor_residual", "ratio", "`update_error` of the run at lr·c for the best "
           "candidate"),
    Column("lr_factor_verdict", "`exact`, `approximate`, `none`",
           "the residual within the update tolerance; within 1e-3; neither"),
    Column("max_norm", "gradient norm", "`clip_grad_norm_`'s threshold"),
    Column("max_norm_ratio", "ratio", "the threshold as a multiple of the big batch's "
           "gradient norm at the first step"),
    Column("clip_coef_reference", "ratio", "the factor clipping applied to the big batch's "
           "gradient at the first step (1: not clipped)"),
    Column("clip_coefs", "ratios, `;`-separated", "the factor each clipping call applied at "
           "the first step, measured as `‖g after‖ / ‖g before‖` (per micro-step, or per rank)"),
    Column("clip_coef_min", "ratio", "the smallest of them"),
    Column("clip_coef_max", "ratio", "the largest of them"),
    Column("window", "optimizer steps", "non-finite: the window (optimizer step) the row "
           "describes, from 0"),
    Column("injected", "bool", "non-finite: whether that window held the non-finite input"),
    Column("ranks_skipped", "ranks", "non-finite: ranks whose `scaler.step` left the "
           "parameters unchanged in that window"),
    Column("scale_before", "factor", "GradScaler's scale at the start of the window (rank 0)"),
    Column("scale_after", "factor", "its scale after `update()`; equal on every rank when "
           "`scale_spread` is 0"),
    Column("scale_spread", "factor", "largest difference between a rank's scale after the window "
           "and rank 0's"),
    Column("grad_error", "ratio", "bf16-accumulation: `‖g - g_64‖ / ‖g_64‖`, the window's "
           "accumulated gradient against the float64 gradient of the same window and weights"),
    Column("lr_multiplier", "ratio", "linear-scaling: the big step's learning rate over the "
           "small steps' (N)"),
)

#: Columns holding text, booleans or verdicts: empty rather than NaN when unmeasured.
TEXT_COLUMNS = {"experiment", "strategy", "loss", "sync", "optimizer", "optimizer_settings",
                "setting", "dtype_used", "verdict", "lr_factor_verdict", "clip_coefs",
                "injected", "emulated"}


def blank_row() -> dict[str, Any]:
    """Every column of the study, empty."""
    return {c.name: ("" if c.name in TEXT_COLUMNS else math.nan) for c in COLUMNS}
