"""One module per strategy, and one :class:`Strategy` spec each that says what it is.

- :mod:`~harness.strategies.local`: one process, the reference everything is compared with;
- :mod:`~harness.strategies.ddp`: DistributedDataParallel over a process subgroup;
- :mod:`~harness.strategies.fsdp`: FSDP2's ``fully_shard`` over a process subgroup;
- :mod:`~harness.strategies.dp_emulated`: DataParallel's dataflow emulated on the CPU;
- :mod:`~harness.strategies.dp`: the real torch.nn.DataParallel on CUDA devices.

A study asks the spec (``STRATEGIES[name]``) instead of testing names: whether
cases run collectively, where rows say they computed, what DDP-like
synchronisation choices exist, how to measure one step or build a trainer. The
specs import no torch (each strategy's module is imported when first used), so
the report asks them too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist
    from torch import nn

    from harness.placement import Placement
    from harness.strategies.common import StepMeasurement, StepSpec, StrategyTrainer


class Run(Protocol):
    """What a strategy needs of the run it measures in (a study's ``Run`` has it):
    the subgroup a case of world size N runs on, the device, the backend's placement."""

    device: torch.device
    placement: Placement

    def group(self, world_size: int) -> dist.ProcessGroup: ...


def _available(world_size: int, run: Run) -> str | None:
    return None


@dataclass(frozen=True)
class Strategy:
    """What the harness needs to know about a way of training on k devices."""

    name: str
    #: How the report names it in sentences.
    label: str
    #: One line for ``--help``.
    description: str
    #: True: a case of world size k runs collectives on the subgroup of ranks 0..k-1.
    #: False: one process computes it (and may run on any idle rank).
    collective: bool
    #: Rough milliseconds of one forward/backward step at world size k, for balancing
    #: work across ranks (measured on a 2-core CPU running 4 gloo ranks).
    step_ms: Callable[[int], float]
    #: The strategy this one emulates, whose rows it stands in for where that one is
    #: skipped ("" for a real one).
    emulates: str = ""
    #: The device a row records when it is not the run's (real DataParallel is CUDA).
    row_device: str | None = None
    #: When the accumulation study's micro-steps reduce: DDP can defer its all-reduce
    #: (``no_sync``), DataParallel reduces in every backward, one process never.
    syncs: tuple[str, ...] = ("every-micro-step",)
    #: True for the single-process reference every other strategy is compared with.
    reference: bool = False
    #: True: each rank holds a shard of every parameter, so comparing parameters gathers them.
    sharded: bool = False
    #: Why the strategy cannot run at world size k here (a row's status), or None.
    #: The same answer on every rank, so that all skip a collective case together.
    unavailable: Callable[[int, Run], str | None] = _available
    #: One measured step of a StepSpec over k devices (None: the strategy has none).
    measure: Callable[[StepSpec, int, Run], StepMeasurement | None] | None = None
    #: A model under the strategy over k devices, fed one micro-step at a time.
    trainer: Callable[[nn.Module, int, Run], StrategyTrainer] | None = None
    #: grad-check: the :class:`harness.check.case.CaseModel` that runs a user's step under
    #: this strategy, from the strategy's own module (None: the check does not offer it),
    #: and one line for its --help.
    check_case: Callable[[], type] | None = None
    check_description: str = ""

    def participants(self, world_size: int) -> int:
        """Ranks a case of this world size occupies."""
        return world_size if self.collective else 1

    @property
    def emulated(self) -> bool:
        """The row's ``emulated`` column."""
        return bool(self.emulates)

    def sync(self, accum_steps: int) -> str:
        """When k micro-steps reduce: deferred to the last one where the strategy can
        (``syncs``' last choice), else its only choice."""
        return self.syncs[-1] if accum_steps > 1 else self.syncs[0]


# Each strategy's module imports torch: imported on first use, so that the specs answer
# the report and --help without it.
def _local() -> ModuleType:
    from harness.strategies import local
    return local


def _ddp() -> ModuleType:
    from harness.strategies import ddp
    return ddp


def _fsdp() -> ModuleType:
    from harness.strategies import fsdp
    return fsdp


def _dp() -> ModuleType:
    from harness.strategies import dp
    return dp


def _dp_emulated() -> ModuleType:
    from harness.strategies import dp_emulated
    return dp_emulated


def _gloo_or_collective_ms(world_size: int) -> float:
    # The all-reduce's latency dominates and grows with the group.
    return 1.2 + 2.2 * (world_size - 1)


def _one_process_ms(world_size: int) -> float:
    # About one forward/backward per device, one after the other.
    return 1.0 + 0.75 * world_size


#: The fields shared by the strategies whose case of world size N runs collectively on the
#: subgroup of ranks 0..N-1.
ON_A_SUBGROUP: dict[str, Any] = {"collective": True, "step_ms": _gloo_or_collective_ms,
                                 "syncs": ("every-micro-step", "no_sync")}


STRATEGIES: dict[str, Strategy] = {s.name: s for s in (
    Strategy("local", "one process (local)",
             "one process, no reduction: the single-device reference",
             collective=False, step_ms=_one_process_ms, syncs=("none",), reference=True,
             trainer=lambda module, k, run: _local().LocalTrainer(module, run.device),
             check_case=lambda: _local().LocalCheckCase,
             check_description="one process playing every rank in turn (N x k pieces, each "
                               "rank's gradient averaged over the N as DDP does): "
                               "accumulation without communication"),
    Strategy("ddp", "DDP",
             "torch.nn.parallel.DistributedDataParallel over a process subgroup",
             **ON_A_SUBGROUP,
             measure=lambda spec, n, run: _ddp().measure_step(spec, run.group(n), run.device),
             trainer=lambda module, n, run: _ddp().DDPTrainer(module, run.group(n), run.device),
             check_case=lambda: _ddp().DDPCheckCase,
             check_description="DistributedDataParallel on ranks 0..N-1, no_sync for the "
                               "first k-1 micro-steps"),
    Strategy("fsdp", "FSDP",
             "FSDP2 (torch.distributed.fsdp.fully_shard) over a process subgroup",
             **ON_A_SUBGROUP, sharded=True,
             measure=lambda spec, n, run: _fsdp().measure_step(spec, run.group(n), run.device),
             trainer=lambda module, n, run: _fsdp().FSDPTrainer(module, run.group(n),
                                                                run.device),
             check_case=lambda: _fsdp().FSDPCheckCase,
             unavailable=lambda n, run: _fsdp().unavailable_reason(run.placement),
             check_description="FSDP2 fully_shard on ranks 0..N-1; each rank compares its "
                               "own shard"),
    Strategy("dp-emulated", "DataParallel (CPU emulation)",
             "CPU emulation of DataParallel's scatter/replicate/gather dataflow",
             collective=False, step_ms=_one_process_ms, emulates="dp",
             measure=lambda spec, k, run: _dp_emulated().measure_step(spec, k,
                                                                              run.device),
             trainer=lambda module, k, run: _dp_emulated().EmulatedDPTrainer(
                 module, k, run.device)),
    Strategy("dp", "DataParallel",
             "torch.nn.DataParallel over CUDA devices (rows say 'skipped' without them)",
             collective=False, step_ms=_one_process_ms, row_device="cuda",
             unavailable=lambda k, run: _dp().unavailable_reason(k),
             measure=lambda spec, k, run: _dp().measure_step(spec, k),
             trainer=lambda module, k, run: _dp().DPTrainer(module, k)),
)}


def measure_step(strategy: str, spec: StepSpec, world_size: int, run: Run
                 ) -> StepMeasurement | None:
    """One measured step of ``spec`` under ``strategy`` over ``world_size`` devices.

    Returns the measurement on rank 0; None on the other ranks of a collective case.
    """
    measure = STRATEGIES[strategy].measure
    if measure is None:
        raise ValueError(f"strategy {strategy!r} does not measure single steps")
    return measure(spec, world_size, run)


def row_device(strategy: str) -> str | None:
    return STRATEGIES[strategy].row_device


def unavailable_reason(strategy: str, world_size: int, run: Run) -> str | None:
    return STRATEGIES[strategy].unavailable(world_size, run)


def step_cost(strategy: str, world_size: int) -> float:
    return STRATEGIES[strategy].step_ms(world_size)


def names(**facts: Any) -> list[str]:
    """The strategies whose spec has every one of ``facts`` (``collective=True``), in order:
    how code that selects rows or cases by what a strategy is avoids spelling names."""
    return [s.name for s in STRATEGIES.values()
            if all(getattr(s, fact) == value for fact, value in facts.items())]


def emulated_names() -> list[str]:
    """The strategies an emulation stands in for (real DataParallel), in order."""
    return [s.emulates for s in STRATEGIES.values() if s.emulated]
