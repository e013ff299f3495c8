"""Experiment ``clipping``: where ``clip_grad_norm_`` runs decides what it clips.

The big-batch run clips its one gradient per step at ``max_norm``. A recipe
that equals the big batch without clipping (``mean/k`` accumulation, DDP's
``mean``) is compared with it when it clips

- ``per-window``: once, after the k micro-steps (one process);
- ``per-micro-step``: after every micro-step's backward, i.e. the partial sums
  of the window's gradient (one process);
- ``after-reduction``: after DDP's all-reduce, on the averaged gradient every
  rank holds;
- ``before-reduction``: each DDP rank on its own gradient (backward under
  ``no_sync``), then the ranks average the clipped gradients by hand;
- ``total-norm``: FSDP2, ``clip_grad_norm_`` on the sharded DTensor gradients
  (the norm of the whole gradient, taken across shards);
- ``local-shard-norm``: FSDP2, each rank clipping its shard by the norm of that
  shard alone (the norm of a local tensor, as code written for unsharded
  gradients computes it).

``max_norm`` is a multiple of the big batch's gradient norm at the first step:
below it (0.5: the big batch clips) and above it (2: the big batch does not,
yet a partial sum or one rank's gradient still may). Each clipping call's
coefficient is measured as ``‖g after‖ / ‖g before‖`` on what that call saw.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from harness.strategies import STRATEGIES
from harness.strategies.common import Trainer
from harness.strategies.ddp import gather_to_leader
from harness.studies.update import fleet
from harness.studies.update.experiments.clipping import SETTINGS
from harness.studies.update.optimizers import OPTIMIZERS, PLAIN
from harness.studies.update.recipes import MICRO_BATCH
from harness.studies.update.training import (
    FleetOptimizers,
    Member,
    ReferenceRuns,
    Start,
    accumulate_window,
    big_batch_gradient,
    big_batch_run,
)

if TYPE_CHECKING:
    from harness.context import RunContext
    from harness.studies.update.experiment import Trial

#: max_norm as multiples of the big batch's gradient norm at the first step.
MAX_NORM_RATIOS = (0.5, 2.0)
#: torch's clip_grad_norm_ divides by ``norm + 1e-6``; the hand-written local-shard
#: clipping does the same, so that only the norm it uses differs.
CLIP_EPS = 1e-6


def measured_coefficient(before: float, after: float) -> float:
    """The factor a clipping call applied, read off the gradient's norm before and after."""
    return after / before if before > 0 else math.nan


def local_norm(params: Sequence[nn.Parameter]) -> float:
    """The norm of what this process holds of the gradients (its shard, under FSDP)."""
    grads = [p.grad.to_local() if fleet.is_sharded(p.grad) else p.grad for p in params]
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g)
                                                        for g in grads])))


def clip_local_shards(params: Sequence[nn.Parameter], max_norm: float) -> None:
    """Clip by the norm of this rank's shard alone: the mistake code written for whole
    gradients makes on FSDP's sharded ones (each rank picks its own coefficient)."""
    coefficient = min(1.0, max_norm / (local_norm(params) + CLIP_EPS))
    with torch.no_grad():
        for p in params:
            (p.grad.to_local() if fleet.is_sharded(p.grad) else p.grad).mul_(coefficient)


def average_by_hand(params: Sequence[nn.Parameter], group: dist.ProcessGroup) -> None:
    """What DDP's all-reduce does, on gradients the user clipped first: sum over ranks / N."""
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(flat, group=group)
    flat /= dist.get_world_size(group)
    offset = 0
    for p in params:
        p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
        offset += p.numel()


def torch_clip(params: Sequence[nn.Parameter], max_norm: float) -> None:
    torch.nn.utils.clip_grad_norm_(params, max_norm)


def clip_and_measure(params: Sequence[nn.Parameter], max_norm: float,
                     how: Callable[[Sequence[nn.Parameter], float], Any] = torch_clip) -> float:
    """Clip the gradients of ``params`` as ``how`` does; the coefficient it applied."""
    before = local_norm(params)
    how(params, max_norm)
    return measured_coefficient(before, local_norm(params))


class ClipRecorder:
    """Clips the copies a setting names and records the coefficient of every call in the
    first window."""

    def __init__(self, settings: Sequence[str], max_norms: Sequence[float]) -> None:
        self.settings, self.max_norms = list(settings), list(max_norms)
        self.coefficients: list[list[float]] = [[] for _ in settings]
        self.window = 0

    def clip(self, index: int, params: Sequence[nn.Parameter],
             how: Callable[[Sequence[nn.Parameter], float], Any]) -> None:
        coefficient = clip_and_measure(params, self.max_norms[index], how)
        if self.window == 0:
            self.coefficients[index].append(coefficient)


def measure(trial: Trial) -> list[dict[str, Any]] | None:
    start = Start.of(trial, trial.options.steps)
    big_norm = float(big_batch_gradient(start.initial, start.data[0]).norm())
    plan = [(setting, ratio) for setting in SETTINGS[trial.strategy] for ratio in MAX_NORM_RATIOS]
    recorder = ClipRecorder([s for s, _ in plan], [r * big_norm for _, r in plan])
    loss = "mean/k" if trial.accum_steps > 1 else "mean"
    runs = [Member(loss, OPTIMIZERS[PLAIN]) for _ in plan]
    # Clipping before DDP's reduction needs a fleet of its own, under no_sync.
    if "before-reduction" in SETTINGS[trial.strategy]:
        final = _ddp_runs(plan, runs, recorder, start, trial.run)
    else:
        final = _single_trainer_runs(trial.strategy, plan, runs, recorder, start, trial.run)
    spec = STRATEGIES[trial.strategy]
    group = trial.run.group(trial.world_size) if spec.collective else None
    every_rank = _coefficients_of_every_rank(recorder, group, trial.run)
    if not trial.reports:
        return None
    rows = []
    for i, (setting, ratio) in enumerate(plan):
        reference, reference_coefficient = clipped_reference(
            trial.references, start, recorder.max_norms[i])
        rows.append({
            # DDP and FSDP reduce in every backward here.
            **plain_sgd_columns(loss, spec.sync(1), start), "steps": trial.options.steps,
            "setting": setting,
            **clip_columns(recorder.max_norms[i], ratio, reference_coefficient, every_rank[i]),
            **start.judged(final[i], reference),
        })
    return rows


def plain_sgd_columns(loss: str, sync: str, start: Start) -> dict[str, Any]:
    """The columns of a recipe training plain SGD: whose update is the gradient itself."""
    spec = OPTIMIZERS[PLAIN]
    return {"micro_batch": MICRO_BATCH, "loss": loss, "sync": sync, "optimizer": PLAIN,
            "optimizer_settings": spec.settings, "learning_rate": spec.lr,
            "dtype_used": start.dtype_used}


#: The clipping columns of a recipe that does not clip.
UNCLIPPED = {"max_norm": math.nan, "max_norm_ratio": math.nan, "clip_coef_reference": math.nan,
             "clip_coefs": "", "clip_coef_min": math.nan, "clip_coef_max": math.nan}


def clip_columns(max_norm: float, ratio: float, reference_coefficient: float,
                 coefficients: Sequence[float]) -> dict[str, Any]:
    """The columns saying where clipping was set and what it applied at the first step."""
    return {"max_norm": max_norm, "max_norm_ratio": ratio,
            "clip_coef_reference": reference_coefficient,
            "clip_coefs": ";".join(f"{c:.12g}" for c in coefficients),
            "clip_coef_min": min(coefficients), "clip_coef_max": max(coefficients)}


def _single_trainer_runs(strategy: str, plan, runs, recorder: ClipRecorder, start: Start,
                         run_context: RunContext) -> list[torch.Tensor]:
    """One process (clipping per window or per micro-step) or FSDP (total or local norm)."""
    trainer = fleet.fleet_trainer(strategy, fleet.Fleet(start.initial, len(runs)),
                                  start.shape.world_size, run_context)
    copies = fleet.members(trainer)
    optimizer = FleetOptimizers(runs, copies)
    per_micro_step = [i for i, (s, _) in enumerate(plan) if s == "per-micro-step"]
    for t, window in enumerate(start.data):
        recorder.window = t

        def clip_micro_step(_: int) -> None:
            for i in per_micro_step:
                recorder.clip(i, list(copies[i].parameters()), torch_clip)

        accumulate_window(trainer, runs, window, start.shape, no_sync=False,
                          after_backward=clip_micro_step)
        for i, (setting, _) in enumerate(plan):
            if setting in ("per-window", "total-norm"):
                recorder.clip(i, list(copies[i].parameters()), torch_clip)
            elif setting == "local-shard-norm":
                recorder.clip(i, list(copies[i].parameters()), clip_local_shards)
        optimizer.step()
    return fleet.every_member_parameters(trainer)


def _ddp_runs(plan, runs, recorder: ClipRecorder, start: Start, run_context: RunContext
              ) -> list[torch.Tensor]:
    """Two DDP fleets: one clipping after DDP's all-reduce; one whose backward runs under
    ``no_sync``, clips each rank's own gradient, then averages by hand."""
    after = [i for i, (s, _) in enumerate(plan) if s == "after-reduction"]
    before = [i for i, (s, _) in enumerate(plan) if s == "before-reduction"]
    shape = start.shape
    group = run_context.group(shape.world_size)
    trainers: dict[str, Trainer] = {}
    optimizers = {}
    for name, indices in (("after", after), ("before", before)):
        trainers[name] = fleet.fleet_trainer("ddp", fleet.Fleet(start.initial, len(indices)),
                                             shape.world_size, run_context)
        optimizers[name] = FleetOptimizers([runs[i] for i in indices],
                                           fleet.members(trainers[name]))
    for t, window in enumerate(start.data):
        recorder.window = t
        accumulate_window(trainers["after"], [runs[i] for i in after], window, shape,
                          no_sync=False)
        for j, i in enumerate(after):
            recorder.clip(i, list(fleet.members(trainers["after"])[j].parameters()), torch_clip)
        with trainers["before"].no_sync():
            accumulate_window(trainers["before"], [runs[i] for i in before], window, shape,
                              no_sync=False)
        for j, i in enumerate(before):
            params = list(fleet.members(trainers["before"])[j].parameters())
            recorder.clip(i, params, torch_clip)
            average_by_hand(params, group)
        optimizers["after"].step()
        optimizers["before"].step()
    final: list[torch.Tensor | None] = [None] * len(plan)
    for name, indices in (("after", after), ("before", before)):
        for i, params in zip(indices, fleet.every_member_parameters(trainers[name]), strict=True):
            final[i] = params
    return final


def _coefficients_of_every_rank(recorder: ClipRecorder, group, run_context: RunContext
                                ) -> list[list[float]]:
    """Per copy, the coefficients of the first window's calls on every rank (rank-major)."""
    if group is None:
        return recorder.coefficients
    mine = torch.tensor(recorder.coefficients, dtype=torch.float64)
    gathered = gather_to_leader(mine, group, run_context.device)
    if gathered is None:
        return []
    return [[float(rank[i, j]) for rank in gathered for j in range(rank.shape[1])]
            for i in range(len(recorder.coefficients))]


def clipped_reference(references: ReferenceRuns, start: Start, max_norm: float
                      ) -> tuple[torch.Tensor, float]:
    """The big-batch run clipping its gradient at ``max_norm`` every step: its final
    parameters and the coefficient it applied at the first step."""
    first: list[float] = []

    def clip(model: nn.Module, t: int) -> None:
        coefficient = clip_and_measure(list(model.parameters()), max_norm)
        if t == 0:
            first.append(coefficient)

    def compute() -> list[torch.Tensor]:
        after = big_batch_run(start.initial, OPTIMIZERS[PLAIN], start.data, before_step=clip)
        return [*after, torch.tensor(first[0], dtype=torch.float64)]

    result = references.get((*start.key, PLAIN, "clip", max_norm), compute)
    return result[-2], float(result[-1])
