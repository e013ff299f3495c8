"""One module per strategy: how a model is wrapped, fed and reduced.

- :mod:`~harness.strategies.local`: one process, the reference everything is compared with;
- :mod:`~harness.strategies.ddp`: DistributedDataParallel over a process subgroup;
- :mod:`~harness.strategies.fsdp`: FSDP2's ``fully_shard`` over a process subgroup;
- :mod:`~harness.strategies.dp_emulated`: DataParallel's dataflow emulated on the CPU;
- :mod:`~harness.strategies.dp`: the real torch.nn.DataParallel on CUDA devices.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from harness.strategies import ddp, dp, dp_emulated, fsdp
from harness.strategies.common import StepMeasurement, StepSpec

if TYPE_CHECKING:
    from harness.context import RunContext


def measure_step(strategy: str, spec: StepSpec, world_size: int, run: RunContext
                 ) -> StepMeasurement | None:
    """One measured step of ``spec`` under ``strategy`` over ``world_size`` devices.

    Returns the measurement on rank 0; None on the other ranks of a DDP case.
    """
    if strategy == "ddp":
        return ddp.measure_step(spec, run.group(world_size), run.device)
    if strategy == "fsdp":
        return fsdp.measure_step(spec, run.group(world_size), run.device)
    if strategy == "dp-emulated":
        return dp_emulated.measure_step(spec, world_size, run.device)
    if strategy == "dp":
        return dp.measure_step(spec, world_size)
    raise ValueError(f"strategy {strategy!r} does not measure single steps")


def row_device(strategy: str) -> str | None:
    """The device a row records when it is not the run's: real DataParallel is always CUDA."""
    return "cuda" if strategy == "dp" else None


def unavailable_reason(strategy: str, world_size: int, run: RunContext) -> str | None:
    """Why ``strategy`` cannot run at ``world_size`` here (the row's status), or None.

    The same answer on every rank, so that all skip a collective case together.
    """
    if strategy == "dp":
        return dp.unavailable_reason(world_size)
    if strategy == "fsdp":
        return fsdp.unavailable_reason(run.placement)
    return None


def step_cost(strategy: str, world_size: int) -> float:
    """Rough milliseconds of one forward/backward step, for balancing work across ranks.

    Measured on a 2-core CPU running 4 gloo ranks: DDP's step is dominated by the
    all-reduce's latency, which grows with the group; single-process strategies
    cost about one forward/backward per device.
    """
    if strategy in ("ddp", "fsdp"):
        return 1.2 + 2.2 * (world_size - 1)
    return 1.0 + 0.75 * world_size
