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
from harness.studies.base import Case, Study
from harness.studies.comm.collectives import (
    COLLECTIVES,
    bandwidths,
    bus_factor,
    measure_collective,
)
from harness.studies.comm.schema import COLUMNS, SHARD_SIZE
from harness.studies.comm.steps import (
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
    sizes = [n for n in run.world_sizes if n >= 2]
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
    columns = COLUMNS

    def cases(self, run: RunContext) -> list[Case]:
        sizes = comm_world_sizes(run) or (2,)  # without N >= 2, rows that say why
        cases = [self._case(run, operation, n, size_bytes=size)
                 for operation in COLLECTIVES for n in sizes for size in message_sizes(run)]
        cases += [self._case(run, operation, n, model=model)
                  for operation in STEP_OPERATIONS for n in sizes for model in STEP_MODELS]
        return cases

    def _case(self, run: RunContext, operation: str, n: int, **axis: Any) -> Case:
        if unavailable(operation, n, run):
            return Case.of(self.name, operation=operation, world_size=n, **axis)
        # DataParallel runs in one process, but on every GPU: the other ranks wait in the
        # case (a collective over all of them) instead of timing something else meanwhile.
        participants = max(run.world_sizes) if operation == "dp-step" else n
        cost = axis.get("size_bytes", MiB) / MiB + 1.0  # ~ms: a step costs about a MiB call
        return Case.of(self.name, participants=participants, collective=True, cost=cost,
                       operation=operation, world_size=n, **axis)

    def run_case(self, case: Case, run: RunContext) -> list[dict[str, Any]] | None:
        operation, n = case["operation"], case["world_size"]
        if reason := unavailable(operation, n, run):
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
        operation, n = case["operation"], case["world_size"]
        timing = timing_of(run)
        result = measure_collective(operation, case["size_bytes"], run.group(n), run.device,
                                    run.dtype, timing)
        if not run.reports(case):
            return None
        algbw, busbw = bandwidths(operation, result.message_bytes, result.seconds, n)
        return [{**self._identity(case), "elements": result.elements,
                 "message_bytes": result.message_bytes, "warmup": timing.warmup,
                 "iterations": timing.iterations, "time_s": result.seconds,
                 "algbw_GBps": algbw, "bus_factor": bus_factor(operation, n),
                 "busbw_GBps": busbw, "wrong": result.wrong}]

    def _ddp_steps(self, case: Case, run: RunContext) -> list[dict[str, Any]] | None:
        n, timing = case["world_size"], timing_of(run)
        results = measure_ddp_steps(case["model"], run.group(n), run.device, run.dtype,
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
