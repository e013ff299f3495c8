"""The ``reduction`` study's CSV columns (torch-free: the registry and the report read them)."""

from __future__ import annotations

from harness.studies.schema import EMULATED, STRATEGY, WORLD_SIZE, Column

COLUMNS = (
    STRATEGY,
    EMULATED,
    WORLD_SIZE,
    Column("model", "`toy`, `mlp`, `mlp-batchnorm`, `loss-in-forward`",
           "seed 001's model (output x (device + 1)); a 4-8-2 MLP whose inputs come from a "
           "different distribution on each device; the same with BatchNorm; the MLP "
           "returning its own mean loss from `forward` (DataParallel only)"),
    Column("loss_reduction", "`mean`, `sum`",
           "reduction of the loss terms; for `loss-in-forward`, of the per-device loss "
           "vector DataParallel gathers"),
    Column("shard_sizes", "samples, `;`-separated",
           "samples given to each device"),
    Column("devices_used", "devices",
           "devices that computed (DataParallel uses fewer than asked when the batch is "
           "small)"),
    Column("chunk_sizes", "samples, `;`-separated",
           "samples each used device computed on"),
    Column("rank_weight", "ratio",
           "w in `g ~ w * sum_r g_r`"),
    Column("rank_weight_residual", "ratio",
           "`‖g - w·sum_r g_r‖ / ‖g‖`"),
    Column("full_batch_scale", "ratio",
           "s in `g ~ s * g_full`"),
    Column("full_batch_residual", "ratio",
           "`‖g - s·g_full‖ / ‖g‖`"),
    Column("fit_residual", "ratio",
           "the larger of the two residuals"),
    Column("verdict", "`mean`, `sum`, `sum=mean`, `other`",
           "what w says, within the tolerance: `mean` for w = 1/N, `sum` for w = 1, "
           "`sum=mean` at N = 1 where the two coincide, `other` when no such w fits"),
    Column("full_batch_verdict", "`matches`, `scaled`, `differs`",
           "what s says, within the tolerance: `matches` for s = 1 (the big batch exactly), "
           "`scaled` for another pure multiple, `differs` when no multiple fits"),
    Column("reduce_weight", "ratio",
           "g fitted against the sum of what each device *fed into the reduction* (DDP: each"
           " rank's local gradient, taken under `no_sync`; FSDP: each rank's gradient of its"
           " own shard, computed once more without FSDP, which keeps it internal; "
           "DataParallel: each replica's gradient of the gathered loss)"),
    Column("reduce_op", "as `verdict`",
           "the collective's own operation, read from `reduce_weight`"),
    Column("rank_spread", "ratio",
           "largest `‖g_rank - g_rank0‖ / ‖g_rank0‖` over the ranks: 0 when all agree"),
    Column("running_stats_vs_full", "ratio",
           "BatchNorm running mean/var after the step vs after one forward of the whole "
           "batch (relative distance; empty without BatchNorm)"),
    Column("running_stats_vs_first_shard", "ratio",
           "the same vs one forward of the first device's shard alone"),
    Column("full_batch_multiple", "`1`, `1/N`, `N`, empty",
           "which of 1, 1/N and N (N: `devices_used`) `full_batch_scale` equals within the "
           "tolerance, where a multiple fits (`full_batch_verdict` not `differs`); empty "
           "otherwise"),
    Column("ranks_agree", "bool",
           "`rank_spread` within the tolerance: every rank held the same param.grad"),
    Column("running_stats_from_first_shard", "bool",
           "`running_stats_vs_first_shard` within the tolerance: the running statistics are "
           "one forward pass's over the first device's shard alone; empty without BatchNorm"),
)
