"""One launch runs the whole matrix: strategy x world size N x micro-steps k.

Process subgroups of ranks 0..N-1 are created once; a case of world size N runs on
its subgroup (``local`` on rank 0 alone) while the other ranks go on to the next
case. Rank 0 takes part in every case, holds every row, and writes ``check.csv``
atomically at the end. The big-batch reference is computed once per step by every
rank and shared by all cases.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from harness.check import batches
from harness.check.compare import (
    Comparison,
    compare,
    compare_each,
    same_on_every_rank,
    sampled_fingerprint,
    worst_tensors,
)
from harness.check.config import CSV_NAME, CheckConfig
from harness.check.fix import Facts, batchnorm_tensors, measure_loss_combination, suggest
from harness.check.load import copy_of, prepared_model
from harness.check.precision import case_precision, unsplit_fix
from harness.check.precision import name as dtype_name
from harness.check.reference import (
    ReferenceStep,
    Rows,
    compute_reference,
    state_names,
    window_of,
)
from harness.check.schema import COLUMN_NAMES
from harness.check.setup import Setup
from harness.check.step import check_step_device, micro_step_edit_fix, run_dtype
from harness.check.strategies import CaseModel, case_model, merged, not_finite_message
from harness.errors import UsageError, first_sentence, timed_out_in_collective
from harness.launch import Launch, Placement
from harness.results import write_csv_atomic
from harness.strategies import STRATEGIES
from harness.tolerances import check_tolerance
from harness.verdicts import Equivalence


class NotFinite(Exception):
    """A case's loss or gradient held a NaN or an infinity: its rows say where."""

    def __init__(self, step: int, message: str) -> None:
        super().__init__(message)
        self.step = step


@dataclass(frozen=True)
class Case:
    strategy: str
    world_size: int
    accum_steps: int

    @property
    def participants(self) -> int:
        return STRATEGIES[self.strategy].participants(self.world_size)

    @property
    def label(self) -> str:
        return f"{self.strategy} N={self.world_size} k={self.accum_steps}"


def matrix(config: CheckConfig, world_sizes: tuple[int, ...]) -> list[Case]:
    return [Case(strategy, n, k) for strategy in config.strategies for n in world_sizes
            for k in config.accum_steps]


class CheckRun:
    """Every setup named on the command line, one after the other, in one launch."""

    def __init__(self, config: CheckConfig, setups: list[tuple[str, Setup]], launch: Launch,
                 placement: Placement, world_sizes: tuple[int, ...]) -> None:
        self.config, self.setups, self.launch = config, setups, launch
        self.placement, self.world_sizes = placement, world_sizes
        self.rows: list[dict[str, Any]] = []

    def _init_distributed(self) -> dict[int, dist.ProcessGroup]:
        if self.placement.device.type == "cuda":
            torch.cuda.set_device(self.placement.device)
        timeout = timedelta(seconds=self.config.timeout)
        if not dist.is_initialized():
            dist.init_process_group(self.placement.backend, timeout=timeout)
        # new_group is collective: every rank creates every group, in the same order.
        return {n: dist.new_group(list(range(n)), timeout=timeout) for n in self.world_sizes}

    def run(self) -> int:
        """Every setup's cases; rank 0 writes check.csv (rows of all setups). Exit code 0."""
        groups = self._init_distributed()
        for target, setup in self.setups:
            self.rows += SetupCheck(self, target, setup, groups).run()
        if self.launch.is_leader:
            write_csv_atomic(self.config.out / CSV_NAME, self.rows, COLUMN_NAMES)
        dist.barrier()
        dist.destroy_process_group()
        return 0


class SetupCheck:
    """One setup's matrix, sharing the big-batch reference between its cases."""

    def __init__(self, run: CheckRun, target: str, setup: Setup,
                 groups: dict[int, dist.ProcessGroup]) -> None:
        self.config, self.launch, self.placement = run.config, run.launch, run.placement
        self.world_sizes, self.target, self.setup, self.groups = (run.world_sizes, target,
                                                                  setup, groups)
        self.dtype, self.device = self.config.torch_dtype, self.placement.device
        self.dtype = run_dtype(setup, self.dtype)
        check_step_device(setup, target, self.device)
        #: The precision each measured case was judged at (see precision.py).
        self.precisions: dict[Case, torch.dtype] = {}
        #: Gradient edits the user's micro_step made in the case being measured.
        self.edits_in_micro_step: set[str] = set()
        self.rtol = check_tolerance(self.dtype)
        self.references: dict[tuple[int, ...] | None, list[ReferenceStep]] = {}
        #: The initial model: copied for every case but this rank's last, which takes it.
        self.initial: nn.Module | None = prepared_model(setup, self.dtype, self.device, target)
        #: Cases this rank still has to measure.
        self.cases_left = 0
        #: Parameters the references share with the model of the last case, until its step.
        self.parameters_to_keep: set[str] = set()
        #: The tensors (and rows) this rank compares in some case: all the reference keeps.
        self.kept: dict[str, Rows] = {}
        _, buffer_names = state_names(self.initial)
        #: What each case compares: the buffers on their own, where the model has some.
        self.points = ("grad", "params", *(("buffers",) if buffer_names else ()))
        #: Integer buffers (counters such as BatchNorm's num_batches_tracked) must be equal.
        self.exact_buffers = {name for name, buffer in self.initial.named_buffers()
                              if not buffer.is_floating_point()}

    def _same_on_every_rank(self, reference: list[ReferenceStep]) -> None:
        """make_model() and batch(i) must give every rank the same numbers: compared as
        scalars (max and min over the ranks of a fingerprint of the initial weights, of
        each step's loss and of each batch)."""
        if self.launch.world_size == 1:  # one rank: nothing to tell apart, no collective
            return
        values = [sampled_fingerprint(self.initial.state_dict().values())]
        values += [step.loss for step in reference]
        values += [batches.fingerprint(self.setup.batch(i)) for i in range(self.setup.steps)]
        if not same_on_every_rank(values, None, self.device):
            raise UsageError(f"{self.target}: make_model() or batch(i) gave the ranks "
                             "different numbers; allowed: deterministic functions (seed inside "
                             "them, e.g. torch.manual_seed(0) in make_model)")

    def used_samples(self, case: Case) -> tuple[int, ...] | None:
        """Samples of each step's global batch the case uses: all, unless --drop-last cuts
        some (each batch by its own size: later batches may be smaller than the first)."""
        if not self.config.drop_last:
            return None
        pieces = case.world_size * case.accum_steps
        return tuple(batches.sample_count(self.setup.batch(step), f"batch({step})")
                     // pieces * pieces for step in range(self.setup.steps))

    def reference(self, used: tuple[int, ...] | None) -> list[ReferenceStep]:
        if used not in self.references:
            self.references[used] = compute_reference(
                self.setup, self.dtype, self.device, used, self.rtol, self.target,
                initial=self.initial, keeps=self.kept)
        return self.references[used]

    # ------------------------------------------------------------------- run
    def run(self) -> list[dict[str, Any]]:
        """The rows of every case (on rank 0; [] elsewhere)."""
        cases = matrix(self.config, self.world_sizes)
        for case in cases:
            if self.launch.rank < case.participants:
                parts = case_model(case.strategy).compared_parts(self.initial, case.world_size,
                                                                  self.launch.rank)
                for name, rows in parts.items():
                    self.kept[name] = merged(self.kept[name], rows) if name in self.kept else rows
                self.cases_left += self._unavailable(case) is None
        self._same_on_every_rank(self.reference(self.used_samples(cases[0])))
        rows: list[dict[str, Any]] = []
        for case in cases:
            if self.launch.rank < case.participants:
                rows += self.run_case(case)
        return rows

    def run_case(self, case: Case) -> list[dict[str, Any]]:
        """The case's rows on rank 0 (one per step and point); [] on the other ranks."""
        reason = self._unavailable(case)
        if reason is not None:
            return self._rows(case, [(step, point, None, None, "", f"skipped: {reason}", "")
                                     for step in range(self.setup.steps)
                                     for point in self.points])
        try:
            measured = self._measure(case)
        except UsageError:
            raise
        except NotFinite as error:
            return self._rows(case, [(error.step, point, None, None, "", "error", str(error))
                                     for point in self.points])
        except Exception as error:  # noqa: BLE001 -- the user's step failing is a finding
            if timed_out_in_collective(f"{type(error).__name__}: {error}"):
                raise  # another rank hung: no later case can run, the launch names it
            return self._rows(case, [(0, point, None, None, "", "error", first_sentence(error))
                                     for point in self.points])
        return self._rows(case, measured)

    def _unavailable(self, case: Case) -> str | None:
        return case_model(case.strategy).unavailable(self.placement)

    def _group(self, case: Case) -> dist.ProcessGroup | None:
        return self.groups[case.world_size] if STRATEGIES[case.strategy].collective else None

    def _measure(self, case: Case) -> list[tuple]:
        """Train the case's steps; (step, point, comparison, ranks agree, fix, status, error)
        each."""
        used = self.used_samples(case)
        reference = self.reference(used)
        group = self._group(case)
        model = case_model(case.strategy)(self.setup, self._initial_model(), case.world_size,
                                           self.device, group)
        facts = self._facts(case, model, reference)
        results = []
        for step, ref in enumerate(reference):
            window = window_of(self.setup, step, used, self.dtype, self.device)
            samples = batches.sample_count(window, f"batch({step})")
            facts.loss_combination = self._loss_combination(window, samples, case)
            model.backward_window(window, samples, case.accum_steps)
            self._refuse_not_finite(model, step, case, group)
            if self._scaler_skipped(model, group) or ref.skipped:
                results += self._skipped_step(model, step, ref.skipped)
                continue
            precision = case_precision(self.dtype, self.setup,
                                       [ref.loss_dtype, *model.whole.loss_dtypes])
            self.precisions[case] = precision
            self.edits_in_micro_step = model.whole.edits_in_forward
            facts.rtol = rtol = check_tolerance(precision)
            grads = compare(model.grad_pairs(ref), model.param_names, group, self.device,
                            rtol)
            grads_agree = model.ranks_agree("grad")
            self._keep_initial_parameters()
            model.step()
            measured = [("grad", grads, grads_agree),
                        *self._compare_after_step(model, ref, group, rtol)]
            for point, comparison, agree in measured:
                facts.ranks_agree = agree
                results.append((step, point, comparison, agree,
                                self._fix(point, comparison, facts), "ok", ""))
                if step == 0 and point == "grad" and comparison.verdict is Equivalence.SCALED:
                    # The step's later rows (and every later step's) follow from it.
                    facts.gradient_scale = comparison.scale
        return results

    def _scaler_skipped(self, model: CaseModel, group: dist.ProcessGroup | None) -> bool:
        """Whether the case's GradScaler skips this step on any rank (all skip together:
        a DDP gradient is the same everywhere, FSDP's scaler agrees across shards)."""
        if model.whole.scaler is None:
            return False
        skips = torch.tensor([float(model.scaler_skips)], device=self.device)
        if group is not None:
            dist.all_reduce(skips, op=dist.ReduceOp.MAX, group=group)
        return bool(skips.item())

    def _skipped_step(self, model: CaseModel, step: int, reference_skipped: bool) -> list[tuple]:
        """A step the GradScaler skipped: nothing to fit (its gradient is not finite). Alike
        in the big batch and the case, as it must be, the rows say so; in one of them only,
        the case failed."""
        self._keep_initial_parameters()
        model.step()
        if reference_skipped and model.whole.scaler is not None:
            status, error = (f"skipped: the GradScaler skipped step {step} in the big batch "
                             "and in the case alike (a non-finite gradient)", "")
        else:
            where = "big batch only" if reference_skipped else "case only"
            status, error = "error", (f"the GradScaler skipped step {step} in the {where}: "
                                      "a gradient, unscaled, was not finite there alone")
        return [(step, point, None, None, "", status, error) for point in self.points]

    def _compare_after_step(self, model: CaseModel, ref: ReferenceStep,
                            group: dist.ProcessGroup | None, rtol: float) -> list[tuple]:
        """(point, comparison, ranks agree) of the parameters after the step, and of the
        buffers when the model has any, against the reference's."""
        update = compare(model.update_pairs(ref, model.param_names), model.param_names,
                         group, self.device, rtol)
        measured = [("params", update, model.ranks_agree("params"))]
        if model.buffer_names:
            buffers = compare_each(model.update_pairs(ref, model.buffer_names),
                                   model.buffer_names, self.exact_buffers, group,
                                   self.device, rtol)
            measured.append(("buffers", buffers, None))
        return measured

    def _refuse_not_finite(self, model: CaseModel, step: int, case: Case,
                           group: dist.ProcessGroup | None) -> None:
        """Every rank of the case raises together (so none waits in a collective) when any
        rank's loss or gradient was not finite: a NaN matches nothing, not even a NaN."""
        first = torch.tensor([model.first_not_finite], dtype=torch.float64, device=self.device)
        if group is not None:
            dist.all_reduce(first, op=dist.ReduceOp.MIN, group=group)
        if not math.isinf(float(first)):
            raise NotFinite(step, not_finite_message(float(first), step, case.world_size,
                                                      case.accum_steps))

    def _initial_model(self) -> nn.Module:
        """A model at the initial state: a copy, except for this rank's last case, which
        takes the initial model itself (one model's memory less while it trains).

        The references' step-0 state is that model's own tensors, so it must be copied
        before the case changes them: the floating buffers now (a training-mode forward
        updates them), the parameters only right before the optimizer step
        (:meth:`_keep_initial_parameters`), so that the copy is not held while the case
        builds its wrapper and runs its backward passes.
        """
        self.cases_left -= 1
        if self.cases_left > 0:
            return copy_of(self.initial, self.setup, self.dtype, self.device)
        self.parameters_to_keep = {name for name, _ in self.initial.named_parameters()}
        self._copy_initial_state(lambda name: name not in self.parameters_to_keep)
        model, self.initial = self.initial, None
        return model

    def _keep_initial_parameters(self) -> None:
        """Before the last case's first optimizer step: copy the parameters the references
        still share with the model. Step 0's gradients have been compared by then in every
        case, so the copies go into their memory: pages already resident, where fresh ones
        cost more to fault in than the copy itself (0.5 s for 200 MB on a 2-core VM)."""
        if self.parameters_to_keep:
            self._copy_initial_state(self.parameters_to_keep.__contains__, into_grads=True)
            self.parameters_to_keep = set()

    def _copy_initial_state(self, which, into_grads: bool = False) -> None:
        """Copy the step-0 tensors ``which`` names that are still the initial model's own
        (kept rows were copied when they were cut), into step 0's gradient of the same
        name if ``into_grads`` (those gradients are then gone)."""
        for reference in self.references.values():
            first = reference[0]
            spares = first.grads if into_grads else {}
            first.before = {name: copied(tensor, spares.get(name))
                            if which(name) and name not in first.first_rows else tensor
                            for name, tensor in first.before.items()}
            if into_grads:
                first.grads = {}

    def _facts(self, case: Case, model: CaseModel, reference: list[ReferenceStep]) -> Facts:
        return Facts(strategy=case.strategy, world_size=case.world_size,
                     accum_steps=case.accum_steps, batchnorm=batchnorm_tensors(model.inner),
                     unused=reference[0].unused,
                     finds_unused=bool(self.setup.ddp_options.get("find_unused_parameters")),
                     rtol=self.rtol)

    def _fix(self, point: str, comparison: Comparison, facts: Facts) -> str:
        """Only rank 0 writes rows, so only rank 0 looks for a fix (it may forward pieces)."""
        if not self.launch.is_leader:
            return ""
        if facts.world_size == facts.accum_steps == 1:
            return unsplit_fix(point, comparison, self.setup)
        if self.edits_in_micro_step and comparison.verdict is not Equivalence.MATCHES:
            return micro_step_edit_fix(self.edits_in_micro_step)
        return suggest(point, comparison, facts)

    def _loss_combination(self, window, samples: int, case: Case):
        """How the loss of the step's window combines its pieces' losses: measured once per
        step, when a row of it first asks (the ``grad`` and ``params`` rows share it)."""
        pieces = case.world_size * case.accum_steps

        @functools.cache
        def combination():
            return measure_loss_combination(
                prepared_model(self.setup, self.dtype, self.device), self.setup.loss,
                window, samples // pieces, pieces, self.rtol)

        return combination

    def _rows(self, case: Case, results: list[tuple]) -> list[dict[str, Any]]:
        if not self.launch.is_leader:
            return []
        rows = []
        precision = self.precisions.get(case, self.dtype)
        rtol = check_tolerance(precision)
        for step, point, comparison, agree, fix, status, error in results:
            rows.append({
                "setup": self.setup.name, "strategy": case.strategy,
                "world_size": case.world_size, "accum_steps": case.accum_steps,
                "step": step, "point": point,
                "verdict": str(comparison.verdict) if comparison else "",
                "scale": comparison.scale if comparison else float("nan"),
                "residual": comparison.residual if comparison else float("nan"),
                "worst_tensors": (worst_tensors(comparison.errors.items(), rtol)
                                  if comparison else ""),
                "ranks_agree": "" if agree is None else agree,
                "fix": fix, "dtype": dtype_name(self.dtype), "status": status, "error": error,
                "precision": dtype_name(precision),
            })
        return rows


def copied(tensor: torch.Tensor, spare: torch.Tensor | None) -> torch.Tensor:
    """A copy of ``tensor``, written into ``spare`` where that has its shape, dtype and
    device (a tensor nobody reads any more), else a new one."""
    tensor = tensor.detach()
    if spare is not None and (spare.shape, spare.dtype, spare.device) == (
            tensor.shape, tensor.dtype, tensor.device):
        return spare.copy_(tensor)
    return tensor.clone()

