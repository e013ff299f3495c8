"""Training a fleet window by window, the one-process big-batch run it is compared with, and
how the comparison is judged."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from harness.fit import relative_error
from harness.strategies.common import StrategyTrainer, flat_grad, flat_params
from harness.studies.update.fleet import members, micro_step_context
from harness.studies.update.optimizers import OPTIMIZERS, PLAIN, OptimizerSpec
from harness.studies.update.recipes import (
    MICRO_BATCH,
    TASK,
    Shape,
    big_batch,
    initial_model,
    l2_penalty,
    recipe_loss,
    windows,
)
from harness.tasks import Batch
from harness.tolerances import dtype_name, update_tolerance
from harness.verdicts import Equivalence

if TYPE_CHECKING:
    from harness.studies.update.trial import Trial

#: A window: [micro-step][device] shards.
Window = list[list[Batch]]


@dataclass
class Member:
    """One training run inside a fleet: its loss recipe and its optimizer."""

    loss: str
    optimizer: OptimizerSpec


def fleet_loss(trainer: StrategyTrainer, output: torch.Tensor, batch: Batch,
               runs: Sequence[Member], shape: Shape) -> torch.Tensor:
    """The sum of every copy's loss: copies share no weight, so each gets its own gradient.

    The L2 terms are computed after the forward on purpose: FSDP2 keeps the root
    module's parameters unsharded between forward and backward, so the term is
    reduced (averaged) with the data gradient, as DDP reduces it.
    """
    terms = copy_loss_terms(output, batch)
    total = output.new_zeros(())
    for loss in dict.fromkeys(member.loss for member in runs):
        columns = [i for i, member in enumerate(runs) if member.loss == loss]
        total = total + recipe_loss(loss, terms[:, columns], shape).sum()
    copies = members(trainer)
    for i, member in enumerate(runs):
        if member.optimizer.l2_in_loss:
            total = total + l2_penalty(copies[i].parameters(), member.optimizer.l2_in_loss,
                                       shape.accum_steps)
    return total


def copy_loss_terms(output: torch.Tensor, batch: Batch) -> torch.Tensor:
    """The task's loss terms of every copy at once: (samples, copies) from the fleet's
    (samples, copies, outputs), each sample's target repeated for every copy."""
    samples, copies = output.shape[:2]
    targets = batch.y.unsqueeze(1).expand(samples, copies, *batch.y.shape[1:])
    flat = Batch(batch.x, targets.reshape(samples * copies, *batch.y.shape[1:]))
    return TASK.loss_terms(output.reshape(samples * copies, *output.shape[2:]), flat
                           ).reshape(samples, copies)


def accumulate_window(trainer: StrategyTrainer, runs: Sequence[Member], window: Window,
                      shape: Shape, no_sync: bool,
                      after_backward: Callable[[int], None] | None = None,
                      scale: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
    """k micro-steps of forward and backward, no optimizer step.

    ``no_sync``: DDP skips its all-reduce on all but the last micro-step.
    ``after_backward(j)`` runs after micro-step j's backward (e.g. to clip);
    ``scale`` transforms each micro-step's loss before backward (GradScaler's ``scale``).
    """
    for j, shards in enumerate(window):
        batch = trainer.batch_for_this_process(shards)
        sync = not no_sync or j == len(window) - 1
        with micro_step_context(trainer, sync):
            output = trainer.forward(batch.x)
            loss = fleet_loss(trainer, output, batch, runs, shape)
            (scale(loss) if scale else loss).backward()
        trainer.after_backward()
        if after_backward:
            after_backward(j)


def step_all(optimizers: Sequence[torch.optim.Optimizer]) -> None:
    for optimizer in optimizers:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


class FleetOptimizers:
    """One torch optimizer per optimizer configuration, one parameter group per copy.

    Equivalent to one optimizer per copy (every optimizer here acts on each parameter
    on its own, and a group may have its own learning rate), with one ``step()`` call
    per configuration instead of one per copy: a third of a fleet's time on a CPU.
    """

    def __init__(self, runs: Sequence[Member], copies: Sequence[nn.Module]) -> None:
        by_name: dict[str, list[int]] = {}
        for i, member in enumerate(runs):
            by_name.setdefault(member.optimizer.name, []).append(i)
        self.optimizers: list[torch.optim.Optimizer] = []
        self._group: dict[int, dict] = {}
        self._spec = [member.optimizer for member in runs]
        for indices in by_name.values():
            spec = runs[indices[0]].optimizer
            optimizer = spec.build([{"params": list(copies[i].parameters())} for i in indices])
            self.optimizers.append(optimizer)
            self._group.update(zip(indices, optimizer.param_groups, strict=True))

    def set_lr_factor(self, index: int, factor: float) -> None:
        """Copy ``index`` steps at its optimizer's learning rate times ``factor`` from now on."""
        self._group[index]["lr"] = self._spec[index].lr * factor

    def step(self) -> None:
        step_all(self.optimizers)


def flat_parameters(module: nn.Module) -> torch.Tensor:
    return flat_params(module).to(torch.float64)


def descend(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Batch) -> None:
    """One step of ``optimizer`` on the mean loss of ``batch``."""
    TASK.loss(model(batch.x), batch, "mean").backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


# ------------------------------------------------------------------ reference
def big_batch_loss(model: nn.Module, batch: Batch, spec: OptimizerSpec) -> torch.Tensor:
    """The reference's loss: the mean over the whole window, plus the L2 term once."""
    loss = TASK.loss(model(batch.x), batch, "mean")
    if spec.l2_in_loss:
        loss = loss + l2_penalty(model.parameters(), spec.l2_in_loss, 1)
    return loss


def big_batch_gradient(initial: nn.Module, window: Window) -> torch.Tensor:
    """One process's gradient of the mean loss over every sample of ``window``."""
    model = copy.deepcopy(initial)
    batch = big_batch(window)
    TASK.loss(model(batch.x), batch, "mean").backward()
    return flat_grad(model).to(torch.float64)


def big_batch_run(initial: nn.Module, spec: OptimizerSpec, data: Sequence[Window],
                  before_step: Callable[[nn.Module, int], None] | None = None,
                  skip: Sequence[int] = ()) -> list[torch.Tensor]:
    """One process, one optimizer step per window on all of its samples; the parameters
    after each step (float64 vectors). ``before_step(model, t)`` may act on the gradient
    (clipping); windows in ``skip`` are left out (the step a GradScaler skipped)."""
    model = copy.deepcopy(initial)
    optimizer = spec.build(model.parameters())
    after = []
    for t, window in enumerate(data):
        if t not in skip:
            batch = big_batch(window)
            big_batch_loss(model, batch, spec).backward()
            if before_step:
                before_step(model, t)
            step_all([optimizer])
        after.append(flat_parameters(model))
    return after


def update_error(measured: torch.Tensor, reference: torch.Tensor, start: torch.Tensor) -> float:
    """``||measured - reference|| / ||reference - start||``: the error as a fraction of how
    far the reference moved, so that a small learning rate does not hide it."""
    return float((measured - reference).norm() / (reference - start).norm())


def judged(measured: torch.Tensor, reference: torch.Tensor, start: torch.Tensor,
           tolerance: float) -> dict[str, Any]:
    """The columns comparing a run's parameters with the reference's, from the same start:
    ``param_distance``, ``update_error`` and the ``verdict`` on it."""
    error = update_error(measured, reference, start)
    return {"param_distance": relative_error(measured, reference), "update_error": error,
            "verdict": Equivalence.MATCHES if error <= tolerance else Equivalence.DIFFERS}


@dataclass(frozen=True)
class Start:
    """What a case of a fleet experiment trains on and is judged with."""

    shape: Shape
    #: Its windows: the same for every strategy and recipe of the shape.
    data: list[Window]
    initial: nn.Module
    #: The run's dtype, and its update tolerance.
    dtype: torch.dtype
    tolerance: float
    #: What identifies its big-batch runs among those this process shares (ReferenceRuns).
    key: tuple

    @classmethod
    def of(cls, trial: Trial, count: int) -> Start:
        """``count`` windows of the trial's world size and micro-steps, in the run's dtype."""
        shape = Shape(trial.world_size, trial.accum_steps)
        dtype, seed = trial.run.dtype, trial.run.seed
        return cls(shape, windows(seed, shape, count, dtype), initial_model(seed, dtype), dtype,
                   update_tolerance(dtype), (seed, dtype, shape, count))

    @property
    def dtype_used(self) -> str:
        """The run's dtype as the ``dtype_used`` column writes it: ``float64``."""
        return dtype_name(self.dtype)

    def judged(self, measured: torch.Tensor, reference: torch.Tensor) -> dict[str, Any]:
        """:func:`judged` from the initial model's parameters."""
        return judged(measured, reference, flat_parameters(self.initial), self.tolerance)


def plain_sgd_columns(loss: str, sync: str, start: Start) -> dict[str, Any]:
    """The columns of a recipe training plain SGD: whose update is the gradient itself."""
    spec = OPTIMIZERS[PLAIN]
    return {"micro_batch": MICRO_BATCH, "loss": loss, "sync": sync, "optimizer": PLAIN,
            "optimizer_settings": spec.settings, "learning_rate": spec.lr,
            "dtype_used": start.dtype_used}
