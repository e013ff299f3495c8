"""The ``diagnostics`` study's CSV columns (torch-free: the registry and the report read them)."""

from __future__ import annotations

from harness.columns import WORLD_SIZE, Column

COLUMNS = (
    Column("experiment", "`lr-sweep`, `frozen-layer`, `train-vs-eval`, `no-grad`",
           "which question (above)"),
    Column("strategy", "",
           "`local` at 1, or `ddp` at N"),
    WORLD_SIZE.described("`local` at 1, or `ddp` at N"),
    Column("setting", "text",
           "the variant: `lr=10`, `middle frozen (requires_grad=False)`, `middle unused, "
           "find_unused_parameters=False`, `train()`, `torch.no_grad()`, ..."),
    Column("step", "optimizer steps",
           "the step the row describes (DDP: the last completed step)"),
    Column("parameter", "name",
           "the parameter (`input.weight`, ...); `(all)`: all gradients as one vector"),
    Column("requires_grad", "bool",
           "the parameter's flag (`(all)`: every parameter's)"),
    Column("grad_is_none", "bool",
           "`.grad` is None: no backward reached it (`(all)`: none reached any)"),
    Column("grad_norm", "gradient",
           "`‖.grad‖` before the update; empty when None"),
    Column("zero_grad_fraction", "fraction",
           "dead entries of `.grad`: at most 1e-12 (float64; 1e-5 in float32) times the "
           "largest entry of the layer's gradient, i.e. 0 or rounding residue; counting "
           "exact zeros would depend on the CPU"),
    Column("update_ratio", "ratio",
           "`‖w_after - w_before‖ / ‖w_before‖` of that step's update (`local` only): 0 "
           "means the weight did not move"),
    Column("grad_rank_spread", "ratio",
           "DDP: largest `‖grad_rank - grad_rank0‖ / ‖grad_rank0‖`: 0 after an all-reduce, >"
           " 0 when the ranks' gradients were never averaged"),
    Column("dead_relu_fraction", "fraction",
           "units of the ReLU this parameter's layer feeds (`input` → first, `middle` → "
           "second) that output 0 for every sample of the step's batch; empty for the output"
           " layer"),
    Column("loss", "cross-entropy",
           "the step's loss (DDP: rank 0's shard)"),
    Column("output_requires_grad", "bool",
           "`no-grad`: whether the loss tensor requires grad"),
    Column("output_grad_fn", "text",
           "`no-grad`: class of the loss's `grad_fn` (e.g. `NllLossBackward0`); empty: no "
           "graph"),
    Column("bn_batch_mean", "activation",
           "`train-vs-eval`: mean over channels of \\|channel mean\\| of the first BatchNorm's"
           " output on the batch (0: normalized with batch statistics)"),
    Column("bn_batch_std", "activation",
           "the mean channel standard deviation of that output (1 in train mode at the "
           "initial identity affine)"),
    Column("running_stats_change", "ratio",
           "relative change of that BatchNorm's running mean and variance during the forward"),
    Column("steps_completed", "steps",
           "steps that ran before an error (DDP) or in all"),
    Column("error", "text",
           "the exception a step raised (`Type: first sentence`); empty when none"),
    Column("parameter_moved", "bool",
           "`update_ratio` above 1e-12 (float64; 1e-5 in float32): the optimizer step changed "
           "the parameter by more than rounding; empty where no update was measured"),
    Column("relu_dead", "bool",
           "`dead_relu_fraction` is 1: every unit of the ReLU after this layer was 0 for the "
           "whole batch; empty where not measured"),
    Column("zero_since", "optimizer steps",
           "`lr-sweep`: the first reported step from which the parameter's gradient was "
           "dead (`zero_grad_fraction` 1) at every reported step up to the last; empty "
           "when it was alive at the last"),
    Column("grads_averaged", "bool",
           "`grad_rank_spread` within the tolerance: every rank held the same gradient; empty "
           "where there was none to compare"),
    Column("running_stats_changed", "bool",
           "`running_stats_change` above 1e-12 (float64; 1e-5 in float32): the forward pass "
           "updated BatchNorm's running statistics; empty where not measured"),
)
