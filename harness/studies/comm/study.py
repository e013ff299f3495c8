"""The comm study: how fast the collectives behind gradient reduction are, and are they right?

An nccl-tests-style micro-benchmark (NVIDIA/nccl-tests) run as a study, on the
run's backend and device (gloo on CPU tensors, nccl on CUDA):

- ``all_reduce``, ``reduce_scatter``, ``all_gather`` and ``broadcast`` over
  message sizes from 8 B to 64 MiB, on world sizes 2..N: the median time per
  call, algbw = S / time and busbw = algbw x nccl-tests' factor (see
  collectives.py), and ``wrong``, the elements of a checked call that differ
  from the exactly known result;
- a DDP training step of the harness's toy models, split into forward, backward
  and the gradient all-reduce, with and without ``no_sync`` (steps.py);
- where CUDA devices exist, DataParallel's step on the same global batch.

Times are measurements and vary from run to run; no verdict reads them. The
correctness verdict is ``wrong``. The default run keeps the study small (three
sizes, the smallest and largest world size, few iterations); ``--matrix full``
sweeps every size and world size.
"""

from __future__ import annotations

import math
from typing import Any

import torch.distributed as dist

from harness.context import RunContext
from harness.strategies import dp
from harness.studies.base import Case, Column, Study
from harness.studies.comm.collectives import (
    COLLECTIVES,
    bandwidths,
    bus_factor,
    measure_collective,
)
from harness.studies.comm.steps import (
    SHARD_SIZE,
    STEP_MODELS,
    SYNC_MODES,
    StepResult,
    measure_ddp_steps,
    measure_dp_step,
)
from harness.studies.comm.timing import Timing

KiB, MiB = 1024, 1024**2
#: ``--matrix full``: 8 B, then every power of 4 from 16 B to 64 MiB (13 sizes).
FULL_SIZES = (8, *(4**e for e in range(2, 14)))
#: The default run: latency (one float64), a mid-size message, a bandwidth-bound one.
DEFAULT_SIZES = (8, 64 * KiB, 4 * MiB)
#: Untimed and timed iterations per measurement (nccl-tests' defaults are 5 and 20).
TIMINGS = {"default": Timing(warmup=2, iterations=10), "full": Timing(warmup=5, iterations=20)}
STEP_OPERATIONS = ("ddp-step", "dp-step")

#: Measured columns: empty until a measurement fills them (each kind of row fills its own).
MEASURED = ("elements", "message_bytes", "buckets", "warmup", "iterations", "time_s",
            "forward_s", "backward_s", "reduction_s", "algbw_GBps", "bus_factor", "busbw_GBps",
            "wrong")


def comm_world_sizes(run: RunContext) -> tuple[int, ...]:
    """World sizes >= 2 of the run: all of them (``--matrix full``) or the smallest and the
    largest (default), which is where the bus factors differ most."""
    sizes = [k for k in run.world_sizes if k >= 2]
    if run.config.matrix == "full" or len(sizes) <= 2:
        return tuple(sizes)
    return (sizes[0], sizes[-1])


def message_sizes(run: RunContext) -> tuple[int, ...]:
    return FULL_SIZES if run.config.matrix == "full" else DEFAULT_SIZES


def timing_of(run: RunContext) -> Timing:
    return TIMINGS[run.config.matrix]


def unavailable(operation: str, world_size: int, run: RunContext) -> str | None:
    """Why a case cannot be measured here (its rows' status), or None; alike on every rank."""
    if world_size not in run.world_sizes:
        measured = ", ".join(map(str, run.world_sizes))
        return f"skipped: needs world size {world_size}; this run measures {measured}"
    if operation == "dp-step":
        return dp.unavailable_reason(world_size)
    return None


class CommStudy(Study):
    name = "comm"
    summary = ("nccl-tests-style collective benchmark (all_reduce, reduce_scatter, all_gather, "
               "broadcast: time, algbw, busbw, checked results) and DDP's step-time breakdown")
    example = ("torchrun --standalone --nproc_per_node=4 scripts/study.py --studies comm "
               "--matrix full")
    columns = (
        Column("operation", "`all_reduce`, `reduce_scatter`, `all_gather`, `broadcast`, "
               "`ddp-step`, `dp-step`",
               "a collective (SUM where it reduces, rank 0 the root of broadcast; reduce_scatter"
               " and all_gather on single tensors, as FSDP calls them), or a training step of "
               "DistributedDataParallel or DataParallel (CUDA only)"),
        Column("world_size", "ranks",
               "k: ranks 0..k-1 of the launch (`dp-step`: CUDA devices 0..k-1 of one process)"),
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
               "reduce_scatter and all_gather rounded down to a multiple of k (at least k)"),
        Column("message_bytes", "bytes",
               "S, the bytes nccl-tests counts: all_reduce's and broadcast's buffer, "
               "reduce_scatter's input, all_gather's output (k chunks, one per rank); for "
               "`ddp-step`, the gradient bytes DDP all-reduced in one step (0 under `no_sync`)"),
        Column("buckets", "all-reduces per step",
               "gradient buckets DDP all-reduced in one step (0 under `no_sync`)"),
        Column("warmup", "iterations",
               "untimed iterations first; the first call of a collective is the checked one"),
        Column("iterations", "iterations",
               "timed iterations: 10 by default, 20 with `--matrix full`"),
        Column("time_s", "seconds",
               "median over the timed iterations of one call (collectives) or one whole step "
               "(forward + backward); each iteration's time is the mean over the k ranks of "
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
               "nccl-tests' busbw / algbw for k ranks: all_reduce 2(k-1)/k, reduce_scatter and "
               "all_gather (k-1)/k, broadcast 1"),
        Column("busbw_GBps", "GB/s (1e9 B/s)",
               "bus bandwidth: algbw_GBps x bus_factor, what each link carried in an optimal "
               "ring; comparable across collectives and with the hardware's peak"),
        Column("wrong", "elements",
               "the verdict: elements of the checked call that differ from the exact expected "
               "value, summed over the ranks (ranks send small integers depending on rank and "
               "position, so every sum is exact): 0 = correct"),
    )

    def cases(self, run: RunContext) -> list[Case]:
        sizes = comm_world_sizes(run) or (2,)  # without k >= 2, rows that say why
        cases = [self._case(run, operation, k, size_bytes=size)
                 for operation in COLLECTIVES for k in sizes for size in message_sizes(run)]
        cases += [self._case(run, operation, k, model=model)
                  for operation in STEP_OPERATIONS for k in sizes for model in STEP_MODELS]
        return cases

    def _case(self, run: RunContext, operation: str, k: int, **axis: Any) -> Case:
        if unavailable(operation, k, run):
            return Case.of(self.name, operation=operation, world_size=k, **axis)
        # DataParallel runs in one process, but on every GPU: the other ranks wait in the
        # case (a collective over all of them) instead of timing something else meanwhile.
        participants = max(run.world_sizes) if operation == "dp-step" else k
        cost = axis.get("size_bytes", MiB) / MiB + 1.0  # ~ms: a step costs about a MiB call
        return Case.of(self.name, participants=participants, collective=True, cost=cost,
                       operation=operation, world_size=k, **axis)

    def run_case(self, case: Case, run: RunContext) -> list[dict[str, Any]] | None:
        operation, k = case["operation"], case["world_size"]
        if reason := unavailable(operation, k, run):
            return [{**self._identity(case, mode), "status": reason}
                    for mode in self._sync_modes(operation)]
        if operation in COLLECTIVES:
            return self._collective(case, run)
        if operation == "ddp-step":
            return self._ddp_steps(case, run)
        return self._dp_step(case, run)

    @staticmethod
    def _sync_modes(operation: str) -> tuple[str, ...]:
        return {"ddp-step": SYNC_MODES, "dp-step": ("every-step",)}.get(operation, ("",))

    # ------------------------------------------------------------- rows
    @staticmethod
    def _identity(case: Case, sync: str = "") -> dict[str, Any]:
        """The row's coordinates, every measured column empty, status ok."""
        step = case["operation"] in STEP_OPERATIONS
        return {"operation": case["operation"], "world_size": case["world_size"],
                "size_bytes": case.params.get("size_bytes", math.nan),
                "model": case.params.get("model", ""), "sync": sync,
                "batch_size": SHARD_SIZE * case["world_size"] if step else math.nan,
                **dict.fromkeys(MEASURED, math.nan), "status": "ok"}

    def _collective(self, case: Case, run: RunContext) -> list[dict[str, Any]] | None:
        operation, k = case["operation"], case["world_size"]
        timing = timing_of(run)
        result = measure_collective(operation, case["size_bytes"], run.group(k), run.device,
                                    run.dtype, timing)
        if not run.reports(case):
            return None
        algbw, busbw = bandwidths(operation, result.message_bytes, result.seconds, k)
        return [{**self._identity(case), "elements": result.elements,
                 "message_bytes": result.message_bytes, "warmup": timing.warmup,
                 "iterations": timing.iterations, "time_s": result.seconds,
                 "algbw_GBps": algbw, "bus_factor": bus_factor(operation, k),
                 "busbw_GBps": busbw, "wrong": result.wrong}]

    def _ddp_steps(self, case: Case, run: RunContext) -> list[dict[str, Any]] | None:
        k, timing = case["world_size"], timing_of(run)
        results = measure_ddp_steps(case["model"], run.group(k), run.device, run.dtype,
                                    run.seed, timing)
        if not run.reports(case):
            return None
        return [self._step_row(case, mode, results[mode], timing) for mode in SYNC_MODES]

    def _dp_step(self, case: Case, run: RunContext) -> list[dict[str, Any]] | None:
        timing = timing_of(run)
        result = None
        if run.reports(case):
            result = measure_dp_step(case["model"], case["world_size"], run.dtype, run.seed,
                                     timing)
        dist.barrier(group=run.group(max(run.world_sizes)))
        if result is None:
            return None
        row = self._step_row(case, "every-step", result, timing)
        return [{**row, "device": "cuda"}]

    def _step_row(self, case: Case, sync: str, result: StepResult, timing: Timing
                  ) -> dict[str, Any]:
        return {**self._identity(case, sync), "message_bytes": result.bucket_bytes,
                "buckets": result.buckets, "warmup": timing.warmup,
                "iterations": timing.iterations, "time_s": result.step,
                "forward_s": result.forward, "backward_s": result.backward,
                "reduction_s": result.reduction}

    def summary_table(self, frame) -> str:
        ok = frame[frame["status"] == "ok"]
        collectives = ok[ok["operation"].isin(COLLECTIVES)].astype({"size_bytes": int})
        if collectives.empty:
            return "no collective measured: " + "; ".join(dict.fromkeys(frame["status"]))
        lines = [f"busbw (GB/s) by world size; wrong elements in all checks: "
                 f"{int(collectives['wrong'].sum())}",
                 collectives.pivot_table(index=["operation", "size_bytes"], columns="world_size",
                                         values="busbw_GBps", aggfunc="first").to_string()]
        steps = ok[ok["operation"] == "ddp-step"]
        if not steps.empty:
            lines += ["DDP step time (ms) by world size:",
                      (steps.pivot_table(index=["model", "sync"], columns="world_size",
                                         values="time_s", aggfunc="first") * 1e3).to_string()]
        return "\n".join(lines)
