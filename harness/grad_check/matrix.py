"""The Setup matrix: strategy x world size N x micro-steps k, every case in one launch.

Process subgroups of ranks 0..N-1 are created once; a case of world size N runs on
its subgroup (``local`` on rank 0 alone) while the other ranks go on to the next
case. Rank 0 takes part in every case, holds every row, and writes ``check.csv``
atomically at the end. The big-batch reference is computed once per step by every
rank (spread over all of them with ``Setup.loss_terms``) and shared by all cases
(harness/check/baseline.py); each row says which reference it was compared with.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from harness.check import batches
from harness.check.baseline import Baseline, UsedSamples
from harness.check.case import CaseModel, not_finite_message
from harness.check.causes.evidence import MatrixStep
from harness.check.compare import compare, compare_each, same_on_every_rank, sampled_fingerprint
from harness.check.fix import Facts, batchnorm_tensors, measure_loss_combination
from harness.check.judge import (
    Compared,
    Judged,
    JudgedStep,
    Memory,
    Seeing,
    Seen,
    at_full_precision,
    judge_step,
    judged_row,
)
from harness.check.load import prepared_model
from harness.check.precision import case_precision, tolerance
from harness.check.reference import ReferenceStep, state_names, window_of
from harness.check.setup import Setup
from harness.check.spread import Spread
from harness.check.step import check_step_device, run_dtype
from harness.errors import UsageError, first_sentence, timed_out_in_collective
from harness.grad_check.check_config import CSV_NAME, CheckConfig
from harness.grad_check.schema import COLUMN_NAMES, COLUMNS
from harness.placement import Launch, Placement
from harness.results import write_csv_atomic
from harness.strategies import STRATEGIES
from harness.tolerances import dtype_name
from harness.verdicts import Status, skipped


class NotFinite(Exception):
    """A case's loss or gradient held a NaN or an infinity: its rows say where."""

    def __init__(self, step: int, message: str) -> None:
        super().__init__(message)
        self.step = step


@dataclass(frozen=True)
class MatrixCase:
    """One case of the matrix: a strategy at N ranks x k micro-steps."""

    strategy: str
    world_size: int
    accum_steps: int

    @property
    def participants(self) -> int:
        return STRATEGIES[self.strategy].participants(self.world_size)

    @property
    def label(self) -> str:
        return f"{self.strategy} N={self.world_size} k={self.accum_steps}"


def case_model(strategy: str) -> type[CaseModel]:
    """The class that runs a user's step under ``strategy``: the one its spec names."""
    make = STRATEGIES[strategy].check_case
    if make is None:
        raise ValueError(f"strategy {strategy!r} has no check case")
    return make()


def matrix(config: CheckConfig, world_sizes: tuple[int, ...]) -> list[MatrixCase]:
    return [MatrixCase(strategy, n, k) for strategy in config.strategies for n in world_sizes
            for k in config.accum_steps]


class CheckRun:
    """Every setup named on the command line, one after the other, in one launch."""

    def __init__(self, config: CheckConfig, setups: list[tuple[str, Setup]], launch: Launch,
                 placement: Placement, world_sizes: tuple[int, ...]) -> None:
        self.config, self.setups, self.launch = config, setups, launch
        self.placement, self.world_sizes = placement, world_sizes
        self.rows: list[dict[str, Any]] = []

    def init_distributed(self) -> dict[int, dist.ProcessGroup]:
        """The process group and one subgroup per world size (``{}``: no process group)."""
        if self.placement.device.type == "cuda":
            torch.cuda.set_device(self.placement.device)
        timeout = timedelta(seconds=self.config.timeout)
        if not dist.is_initialized():
            dist.init_process_group(self.placement.backend, timeout=timeout)
        # new_group is collective: every rank creates every group, in the same order.
        return {n: dist.new_group(list(range(n)), timeout=timeout) for n in self.world_sizes}

    def measured_rows(self) -> list[dict[str, Any]]:
        """Every setup's rows (on rank 0; [] elsewhere)."""
        groups = self.init_distributed()
        for target, setup in self.setups:
            self.rows += SetupCheck(self, target, setup, groups).case_rows()
        return self.rows

    def run(self) -> int:
        """Every setup's cases; rank 0 writes check.csv (rows of all setups). Exit code 0."""
        self.measured_rows()
        if self.launch.is_leader:
            write_csv_atomic(self.config.out / CSV_NAME, self.rows, COLUMN_NAMES)
        dist.barrier()
        dist.destroy_process_group()
        return 0


class SetupCheck:
    """One setup's matrix, every case compared with the same baseline."""

    def __init__(self, run: CheckRun, target: str, setup: Setup,
                 groups: dict[int, dist.ProcessGroup]) -> None:
        self.config, self.launch, self.placement = run.config, run.launch, run.placement
        self.world_sizes, self.target, self.setup, self.groups = (run.world_sizes, target,
                                                                  setup, groups)
        self.device = self.placement.device
        self.dtype = run_dtype(setup, self.config.torch_dtype)
        #: Under autocast, the same cases without it, at the run's precision: a split that
        #: differs there must not be hidden by the autocast precision's tolerance.
        self.twin = (SetupCheck(run, target, replace(setup, autocast=None), groups)
                     if setup.autocast is not None else None)
        check_step_device(setup, target, self.device)
        self.rtol = tolerance(self.dtype)
        self.baseline = Baseline(setup, self.dtype, self.device, target, self.rtol,
                                 self._spread())
        initial = self.baseline.initial
        _, buffer_names = state_names(initial)
        #: What each case compares: the buffers on their own, where the model has some.
        self.points = ("grad", "params", *(("buffers",) if buffer_names else ()))
        #: Integer buffers (counters such as BatchNorm's num_batches_tracked) must be equal.
        self.exact_buffers = {name for name, buffer in initial.named_buffers()
                              if not buffer.is_floating_point()}

    def _spread(self) -> Spread:
        """Every rank of the launch (or this process alone, on no process group), and the
        matrix's largest N x k."""
        pieces = max(case.world_size * case.accum_steps
                     for case in matrix(self.config, self.world_sizes))
        if not self.groups:
            return Spread(None, 0, 1, pieces)
        return Spread(None, self.launch.rank, self.launch.world_size, pieces)

    def _same_on_every_rank(self, reference: list[ReferenceStep]) -> None:
        """make_model() and batch(i) must give every rank the same numbers: compared as
        scalars (max and min over the ranks of a fingerprint of the initial weights, of
        each step's loss and of each batch)."""
        if self.launch.world_size == 1:  # one rank: nothing to tell apart, no collective
            return
        values = [sampled_fingerprint(self.baseline.initial.state_dict().values())]
        values += [step.loss for step in reference]
        values += [batches.batch_sum(self.setup.batch(i)) for i in range(self.setup.steps)]
        if not same_on_every_rank(values, None, self.device):
            raise UsageError(f"{self.target}: make_model() or batch(i) gave the ranks "
                             "different numbers; allowed: deterministic functions (seed inside "
                             "them, e.g. torch.manual_seed(0) in make_model)")

    def used_samples(self, case: MatrixCase) -> UsedSamples:
        """Samples of each step's global batch the case uses: all, unless --drop-last cuts
        some (each batch by its own size: later batches may be smaller than the first)."""
        if not self.config.drop_last:
            return None
        pieces = case.world_size * case.accum_steps
        return tuple(batches.sample_count(self.setup.batch(step), f"batch({step})")
                     // pieces * pieces for step in range(self.setup.steps))

    # ------------------------------------------------------------------- run
    def case_rows(self) -> list[dict[str, Any]]:
        """The rows of every case (on rank 0; [] elsewhere)."""
        every_case = matrix(self.config, self.world_sizes)
        cases = [case for case in every_case if self.launch.rank < case.participants]
        every_used = list(dict.fromkeys(self.used_samples(case) for case in every_case))
        for check in (self, self.twin):
            if check is not None:
                check.expect(cases)
                check.baseline.compute_together(every_used)
        # The same reference on every rank, whichever cases a rank takes part in.
        self._same_on_every_rank(self.baseline.reference(every_used[0]))
        rows: list[dict[str, Any]] = []
        for case in cases:
            measured = self.run_case(case)
            if self.twin is not None:
                measured = at_full_precision(measured, self.twin.run_case(case))
            rows += self.rows(case, measured)
        return rows

    def expect(self, cases: list[MatrixCase]) -> None:
        """Tell the baseline what this rank's cases compare and which of them train."""
        for case in cases:
            self.baseline.expect_case(
                case_model(case.strategy).compared_parts(self.baseline.initial,
                                                         case.world_size, self.launch.rank),
                trains=self._unavailable(case) is None)

    def run_case(self, case: MatrixCase) -> list[Judged]:
        """The case's measurements, one per step and point."""
        reason = self._unavailable(case)
        if reason is not None:
            return [Judged(step, point, status=skipped(reason))
                    for step in range(self.setup.steps) for point in self.points]
        try:
            return self._measure(case)
        except UsageError:
            raise
        except NotFinite as error:
            return [Judged(error.step, point, status=Status.ERROR, error=str(error))
                    for point in self.points]
        except Exception as error:  # noqa: BLE001 -- the user's step failing is a finding
            if timed_out_in_collective(f"{type(error).__name__}: {error}"):
                raise  # another rank hung: no later case can run, the launch names it
            return [Judged(0, point, status=Status.ERROR, error=first_sentence(error))
                    for point in self.points]

    def _unavailable(self, case: MatrixCase) -> str | None:
        return case_model(case.strategy).unavailable(self.placement)

    def _group(self, case: MatrixCase) -> dist.ProcessGroup | None:
        return self.groups[case.world_size] if STRATEGIES[case.strategy].collective else None

    def _measure(self, case: MatrixCase) -> list[Judged]:
        """Train the case's steps, each compared with the reference's."""
        used = self.used_samples(case)
        reference = self.baseline.reference(used)
        group = self._group(case)
        model = case_model(case.strategy)(self.setup, self.baseline.model_for_case(),
                                           case.world_size, self.device, group)
        facts = self._facts(case, model, reference)
        measured: list[Judged] = []
        memory = Memory()
        for step, ref in enumerate(reference):
            window = window_of(self.setup, step, used, self.dtype, self.device)
            rows, memory = self._measure_step(case, model, step, ref, window, facts, memory,
                                              group)
            measured += rows
        return measured

    def _measure_step(self, case: MatrixCase, model: CaseModel, step: int, ref: ReferenceStep,
                      window: Any, facts: Facts, memory: Memory,
                      group: dist.ProcessGroup | None) -> JudgedStep:
        """One optimizer step of the case: its window's micro-steps, then each point
        compared and judged at the precision the step ran in."""
        samples = batches.sample_count(window, f"batch({step})")
        combination = self._loss_combination(window, samples, case)
        model.backward_window(window, samples, case.accum_steps)
        self._refuse_not_finite(model, step, case, group)
        if self._scaler_skipped(model, group) or ref.skipped:
            return JudgedStep(self._skipped_step(model, step, ref.skipped), memory)
        precision = case_precision(self.dtype, self.setup,
                                   [ref.loss_dtype, *model.whole.loss_dtypes])
        rtol = tolerance(precision)
        grads = compare(model.grad_pairs(ref), model.param_names, group, self.device, rtol)
        compared = [Compared("grad", grads, model.ranks_agree("grad"))]
        self.baseline.before_optimizer_step()
        model.step()
        compared += self._compare_after_step(model, ref, group, rtol)
        return judge_step(step, compared, precision,
                          replace(facts, loss_combination=combination, learning_rates=ref.lrs),
                          memory, seen=self._seen(model.whole.edits_in_forward),
                          explaining=self.launch.is_leader)

    def _scaler_skipped(self, model: CaseModel, group: dist.ProcessGroup | None) -> bool:
        """Whether the case's GradScaler skips this step on any rank (all skip together:
        a DDP gradient is the same everywhere, FSDP's scaler agrees across shards)."""
        if model.whole.scaler is None:
            return False
        skips = torch.tensor([float(model.scaler_skips)], device=self.device)
        if group is not None:
            dist.all_reduce(skips, op=dist.ReduceOp.MAX, group=group)
        return bool(skips.item())

    def _skipped_step(self, model: CaseModel, step: int,
                      reference_skipped: bool) -> list[Judged]:
        """A step the GradScaler skipped: nothing to fit (its gradient is not finite). Alike
        in the big batch and the case, as it must be, the rows say so; in one of them only,
        the case failed."""
        self.baseline.before_optimizer_step()
        model.step()
        if reference_skipped and model.whole.scaler is not None:
            status, error = (skipped(f"the GradScaler skipped step {step} in the big batch "
                                     "and in the case alike (a non-finite gradient)"), "")
        else:
            where = "big batch only" if reference_skipped else "case only"
            status, error = Status.ERROR, (f"the GradScaler skipped step {step} in the "
                                           f"{where}: a gradient, unscaled, was not finite "
                                           "there alone")
        return [Judged(step, point, status=status, error=error) for point in self.points]

    def _compare_after_step(self, model: CaseModel, ref: ReferenceStep,
                            group: dist.ProcessGroup | None, rtol: float) -> list[Compared]:
        """The parameters after the step, and the buffers when the model has any, against
        the reference's."""
        update = compare(model.update_pairs(ref, model.param_names), model.param_names,
                         group, self.device, rtol)
        compared = [Compared("params", update, model.ranks_agree("params"))]
        if model.buffer_names:
            buffers = compare_each(model.update_pairs(ref, model.buffer_names),
                                   model.buffer_names, self.exact_buffers, group,
                                   self.device, rtol)
            compared.append(Compared("buffers", buffers))
        return compared

    def _refuse_not_finite(self, model: CaseModel, step: int, case: MatrixCase,
                           group: dist.ProcessGroup | None) -> None:
        """Every rank of the case raises together (so none waits in a collective) when any
        rank's loss or gradient was not finite: a NaN matches nothing, not even a NaN."""
        first = torch.tensor([model.first_not_finite], dtype=torch.float64, device=self.device)
        if group is not None:
            dist.all_reduce(first, op=dist.ReduceOp.MIN, group=group)
        if not math.isinf(float(first)):
            raise NotFinite(step, not_finite_message(float(first), step, case.world_size,
                                                      case.accum_steps))

    def _facts(self, case: MatrixCase, model: CaseModel, reference: list[ReferenceStep]) -> Facts:
        return Facts(world_size=case.world_size, reduces_in_buckets=model.reduces_in_buckets,
                     accum_steps=case.accum_steps,
                     batchnorm=frozenset(batchnorm_tensors(model.inner)),
                     unused=reference[0].unused,
                     finds_unused=bool(self.setup.ddp_options.get("find_unused_parameters")),
                     rtol=self.rtol)

    def _seen(self, edits_in_micro_step: set[str]) -> Seeing:
        """What only the matrix knows of a row's cause (harness/check/causes/): whether the
        setup runs a micro_step of its own, and what it edited that the forward saw. Only
        rank 0 writes rows, so only rank 0 looks for a cause (one may forward pieces)."""
        matrix = MatrixStep(self.setup.micro_step is not None, frozenset(edits_in_micro_step))
        return lambda _measured: Seen(matrix=matrix)

    def _loss_combination(self, window, samples: int, case: MatrixCase):
        """How the loss of the step's window combines its pieces' losses: measured once per
        step, when a row of it first asks (the ``grad`` and ``params`` rows share it)."""
        pieces = case.world_size * case.accum_steps

        @functools.cache
        def combination():
            return measure_loss_combination(
                prepared_model(self.setup, self.dtype, self.device), self.setup.loss,
                window, samples // pieces, pieces, self.rtol)

        return combination

    def rows(self, case: MatrixCase, measured: list[Judged]) -> list[dict[str, Any]]:
        """The case's CSV rows, on rank 0 ([] on the other ranks)."""
        if not self.launch.is_leader:
            return []
        # Rows left unmeasured (a skipped or failed step) are said at the case's precision.
        judged = next((m.precision for m in measured if m.precision is not None), self.dtype)
        return [judged_row(COLUMNS, replace(m, precision=m.precision or judged),
                           setup=self.setup.name, strategy=case.strategy,
                           world_size=case.world_size, accum_steps=case.accum_steps,
                           dtype=dtype_name(self.dtype), reference=self.baseline.kind)
                for m in measured]
