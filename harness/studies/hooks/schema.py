"""The ``hooks`` study's CSV columns (torch-free: the registry and the report read them),
and the settings they document."""

from __future__ import annotations

from harness.columns import WORLD_SIZE, Column

#: SGD steps per case.
STEPS = 5
#: PowerSGD's cases run longer: error feedback adds each step's compression error to the
#: next step's gradient, so that the *sum* of the applied gradients tracks the exact sum
#: while every single step stays off. Measured on the 4-8-2 MLP at rank 1 (seed 0): after
#: 3 compressed steps (step 5) the sums with and without feedback are as far from the exact
#: sum (cumulative error 0.43 and 0.38 at N = 2); at step 12, 0.20 against 0.50 (N = 2) and
#: 0.18 against 0.46 (N = 4).
POWERSGD_STEPS = 12
#: SGD of every run, the exact one included: momentum gives ZeRO optimizer state to shard.
LEARNING_RATE = 0.1
MOMENTUM = 0.9
#: The reduction variants, in row order (variants.py builds one for each; a test keeps
#: the two lists equal).
VARIANT_NAMES = (
    "allreduce_hook", "fp16_compress_hook", "bf16_compress_hook", "bf16_compress_hook-renamed",
    "powerSGD-rank1", "powerSGD-rank2", "powerSGD-rank1-no-error-feedback", "sum-hook",
    "double-divide-hook", "gradient_as_bucket_view", "static_graph", "bucket_cap_mb-small",
    "bucket_cap_mb-large", "ZeroRedundancyOptimizer", "fully_shard", "set_gradient_divide_factor",
    "reduce_dtype-bfloat16", "reduce_dtype-float16",
)

COLUMNS = (
    Column("strategy", "`ddp`, `fsdp`",
           "DistributedDataParallel, or FSDP2's `fully_shard`"),
    Column("variant", ", ".join(f"`{name}`" for name in VARIANT_NAMES),
           "what is switched on (`setting` spells it out)"),
    Column("setting", "text",
           "the variant's exact settings, as code"),
    WORLD_SIZE.described("N (2 and up: with one rank there is nothing to reduce)"),
    Column("step", "optimizer steps",
           f"the step the row measures, 1..{STEPS} (PowerSGD: 1..{POWERSGD_STEPS})"),
    Column("model_dtype", "`float64`, `float32`",
           "dtype of the model, its data and its gradients (the run's `--dtype`); "
           "references are float64 whatever it is"),
    Column("wire_dtype", "dtypes, `;`-separated",
           "dtypes of the tensors the step's gradient collectives were handed (measured)"),
    Column("collective", "`all_reduce`, `reduce_scatter_single`",
           "the gradient collectives the step called"),
    Column("buckets", "buckets",
           "DDP: distinct buckets the variant's comm hook was handed in the step, logged "
           "by a hook wrapped around it; empty for FSDP"),
    Column("collective_calls", "calls per step",
           "gradient collectives called during the step's backward (PowerSGD's from its "
           "future callbacks too), counted at `torch.distributed`'s API"),
    Column("collective_bytes", "bytes per step",
           "bytes of the tensors handed to them (reduce-scatter: its input)"),
    Column("full_batch_scale", "ratio",
           "s in `g ~ s * ḡ`, ḡ = the exact float64 average of the ranks' gradients "
           "at the step's weights (= the big-batch gradient = DDP's default result)"),
    Column("fit_residual", "ratio",
           "`‖g - s·ḡ‖ / ‖g‖`"),
    Column("relative_error", "ratio",
           "`‖g - ḡ‖ / ‖ḡ‖`: the compression error, scale included"),
    Column("magnitude_ratio", "ratio",
           "`‖mean_r abs(g_r)‖ / ‖ḡ‖`: how much the ranks' gradients cancel (1: not at "
           "all); "
           "rounding errors scale with it"),
    Column("error_bound", "ratio",
           "the largest `relative_error` rounding in the narrowest `wire_dtype` can cause: "
           "`‖γ_{N+2}·mean_r abs(g_r) + 3N·gap/2‖ / ‖ḡ‖`, γ_n = nu/(1-nu), u the unit "
           "roundoff (float16 2^-11, bfloat16 2^-8), gap the subnormal spacing"),
    Column("verdict", "`exact`, `compressed`, `summed`, `over-averaged`, `scaled`, "
           "`differs`",
           "`relative_error` within the run's tolerance; within `error_bound`; else a pure "
           "multiple of ḡ (s = N, s = 1/N, another s); else not a multiple at all"),
    Column("cumulative_error", "ratio",
           "`‖Σ g - Σ ḡ‖ / ‖Σ ḡ‖` over the steps so far: what error feedback keeps small"),
    Column("param_distance", "ratio",
           "`‖θ - θ*‖ / ‖θ*‖` after the step, θ* the exact run: one process, float64, "
           f"SGD (lr {LEARNING_RATE:g}, momentum {MOMENTUM:g}) on every step's big batch"),
    Column("grad_rank_spread", "ratio",
           "largest `‖g_rank - g_rank0‖ / ‖g_rank0‖` over the ranks: 0 when all agree; "
           "empty for FSDP, whose ranks hold shards"),
    Column("param_rank_spread", "ratio",
           "the same for the weights after the step"),
    Column("rank0_state_elements", "elements",
           "optimizer state (momentum) elements rank 0 holds: ZeRO and FSDP shard it"),
)
