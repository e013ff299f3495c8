"""The ``accumulation`` study's CSV columns (torch-free: the registry and the report read them)."""

from __future__ import annotations

from harness.studies.schema import (
    ACCUM_STEPS,
    EMULATED,
    EQUIVALENCES,
    STRATEGY_OR_LOCAL,
    WORLD_SIZE,
    Column,
)

COLUMNS = (
    STRATEGY_OR_LOCAL,
    EMULATED,
    WORLD_SIZE,
    ACCUM_STEPS,
    Column("zero_grad", "`never`, `every-micro-step`, `every-step`",
           "when `zero_grad` runs: never (seed 000/001's bug), before every backward (only "
           "the last micro-batch survives), after every optimizer step (the textbook recipe)"),
    Column("loss_scaling", "`none`, `1/k`",
           "each micro-step's loss as is, or divided by k"),
    Column("sync", "`every-micro-step`, `no_sync`, `none`",
           "DDP all-reduces after every micro-step, or under `no_sync()` for the first k-1; "
           "DataParallel reduce-adds in every backward (`every-micro-step`: it has no "
           "`no_sync`); one process has nothing to reduce (`none`)"),
    Column("norm", "`none`, `batchnorm`, `groupnorm`, `syncbatchnorm`",
           "normalization after the MLP's first layer (SyncBatchNorm: DDP on CUDA only)"),
    Column("shards", "`even`, `uneven`, `tokens`",
           "4 samples per device per micro-step; 2..6 samples varying by device and "
           "micro-step; 4 sequences of 1..6 tokens each (one loss term per real token)"),
    Column("loss_normalization", "`micro-batch-mean`, `window-total`",
           "each micro-batch's loss is the mean over its own elements; or its sum divided by"
           " the element count of the whole window on all devices (times DDP's world size, "
           "undoing DDP's average)"),
    Column("optimizer_steps", "steps",
           "windows trained (2); the last is measured"),
    Column("window_elements", "samples or tokens",
           "loss terms in the measured window, all devices"),
    Column("allreduce_calls", "calls per optimizer step",
           "gradient all-reduces DDP issued in the measured window, counted by a "
           "communication hook wrapping DDP's default all-reduce (empty for other "
           "strategies)"),
    Column("allreduce_bytes", "bytes per optimizer step",
           "bytes those all-reduces carried"),
    Column("reduce_add_calls", "calls per optimizer step",
           "DataParallel's reduce-adds of replica gradients into device 0 (one per "
           "backward), counted in the backward"),
    Column("reduce_add_bytes", "bytes per optimizer step",
           "gradient bytes sent by the replicas other than device 0"),
    Column("full_batch_scale", "ratio",
           "s in `g ~ s * g_big_batch`"),
    Column("fit_residual", "ratio",
           "`‖g - s·g_big_batch‖ / ‖g‖`"),
    Column("relative_error", "ratio",
           "`‖g - g_big_batch‖ / ‖g_big_batch‖`: how far off, scale included"),
    Column("cumulative_scale", "ratio",
           "g fitted against the *sum* of the big-batch gradients of every window so far "
           "(what a never-zeroed gradient grows into)"),
    Column("cumulative_residual", "ratio",
           "residual of that fit"),
    Column("verdict", EQUIVALENCES,
           "equal to the big batch within the tolerance; a pure multiple of it (s ≠ 1); not "
           "a multiple at all"),
    Column("rank_spread", "ratio",
           "largest `‖g_rank - g_rank0‖ / ‖g_rank0‖` over the ranks: 0 when all agree"),
    Column("full_batch_multiple", "`1`, `1/k`, `k`, empty",
           "which of 1, 1/k and k (k: `accum_steps`) `full_batch_scale` equals within the "
           "tolerance, where a multiple fits (`verdict` not `differs`); empty otherwise"),
    Column("cumulative_verdict", "`matches`, `scaled`, `differs`",
           "what `cumulative_scale` and `cumulative_residual` say, as `verdict` does of the "
           "last step's big batch: the gradient is the sum of every step's big-batch gradient, "
           "another multiple of it, or no multiple"),
    Column("cumulative_multiple", "`1`, `1/k`, `k`, empty",
           "which of 1, 1/k and k `cumulative_scale` equals within the tolerance, where a "
           "multiple fits (`cumulative_verdict` not `differs`); empty otherwise"),
)


def default_scaling(normalization: str) -> str:
    """The scaling that completes a normalization: a window-total loss is already 1/window."""
    return "1/k" if normalization == "micro-batch-mean" else "none"
