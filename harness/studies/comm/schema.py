"""The ``comm`` study's CSV columns (torch-free: the registry and the report read them)."""

from __future__ import annotations

from harness.columns import WORLD_SIZE, Column

#: Samples per device, as in the reduction study's default.
SHARD_SIZE = 4

COLUMNS = (
    Column("operation", "`all_reduce`, `reduce_scatter`, `all_gather`, `broadcast`, "
           "`ddp-step`, `dp-step`",
           "a collective (SUM where it reduces, rank 0 the root of broadcast; reduce_scatter"
           " and all_gather on single tensors, as FSDP calls them), or a training step of "
           "DistributedDataParallel or DataParallel (CUDA only)"),
    WORLD_SIZE.described("N: ranks 0..N-1 of the launch (`dp-step`: CUDA devices 0..N-1 of "
                         "one process)"),
    Column("size_bytes", "bytes",
           "message size asked for (collectives): 8 B, 64 KiB, 4 MiB by default; 8 B and "
           "every power of 4 from 16 B to 64 MiB with `--matrix full`"),
    Column("model", "`toy`, `mlp`, `mlp-batchnorm`",
           "model of a step row (harness/tasks.py); empty for collectives"),
    Column("sync", "`every-step`, `no_sync`",
           "`ddp-step`: DDP all-reduces the gradients every step, or the step runs under "
           "`no_sync()` and sends nothing; `dp-step`: `every-step` (DataParallel "
           "reduce-adds in every backward); empty for collectives"),
    Column("batch_size", "samples",
           f"global batch of a step: {SHARD_SIZE} samples per device"),
    Column("elements", "elements",
           "elements of S's buffer: size_bytes / element size, at least 1, for "
           "reduce_scatter and all_gather rounded down to a multiple of N (at least N)"),
    Column("message_bytes", "bytes",
           "S, the bytes nccl-tests counts: all_reduce's and broadcast's buffer, "
           "reduce_scatter's input, all_gather's output (N chunks, one per rank); for "
           "`ddp-step`, the gradient bytes DDP all-reduced in one step (0 under `no_sync`)"),
    Column("buckets", "all-reduces per step",
           "gradient buckets DDP all-reduced in one step (0 under `no_sync`)"),
    Column("warmup", "iterations",
           "untimed iterations first; the first call of a collective is the checked one"),
    Column("iterations", "iterations",
           "timed iterations: 10 by default, 20 with `--matrix full`"),
    Column("time_s", "seconds",
           "median over the timed iterations of one call (collectives) or one whole step "
           "(forward + backward); each iteration's time is the mean over the N ranks of "
           "what each rank measured (CPU: perf_counter; CUDA: events on the current stream)"
           "; a measurement that varies from run to run"),
    Column("forward_s", "seconds",
           "median time of a step's forward and loss (DDP with BatchNorm also broadcasts "
           "its buffers here)"),
    Column("backward_s", "seconds",
           "median time of a step's backward, including the all-reduces DDP overlaps with "
           "it and waits for at its end"),
    Column("reduction_s", "seconds",
           "median of a DDP step's bucket all-reduce time: from DDP handing a bucket to "
           "its comm hook until the all-reduce completed, summed over buckets (0 under "
           "`no_sync`; empty for DataParallel, whose reduce-add has no hook)"),
    Column("algbw_GBps", "GB/s (1e9 B/s)",
           "algorithm bandwidth: message_bytes / time_s"),
    Column("bus_factor", "ratio",
           "nccl-tests' busbw / algbw for N ranks: all_reduce 2(N-1)/N, reduce_scatter and "
           "all_gather (N-1)/N, broadcast 1"),
    Column("busbw_GBps", "GB/s (1e9 B/s)",
           "bus bandwidth: algbw_GBps x bus_factor, what each link carried in an optimal "
           "ring; comparable across collectives and with the hardware's peak"),
    Column("wrong", "elements",
           "the verdict: elements of the checked call that differ from the exact expected "
           "value, summed over the ranks (ranks send small integers depending on rank and "
           "position, so every sum is exact): 0 = correct"),
)
