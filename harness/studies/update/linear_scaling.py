"""Experiment ``linear-scaling``: Goyal et al.'s rule, one step at lr*N vs N steps at lr.

The rule (Goyal et al. 2017, section 2.1): when the minibatch is multiplied by
N, multiply the learning rate by N. Its argument: N sequential SGD steps at lr
on N small batches move the weights by ``-lr * sum_j g(θ_j)``; one step at
``N * lr`` on the N batches at once moves them by ``-lr * sum_j g(θ_0)``. The two
agree when ``g(θ_j) ≈ g(θ_0)``: when the weights barely change over the N steps.
Large learning rates and the rapidly changing early phase break it; Goyal et al.
add a warm-up for the latter.

For each N of the run (>= 2), each learning rate of ``--update-lrs`` and two
phases -- ``initial`` (the study's initial weights) and ``trained`` (after
``PRETRAIN_STEPS`` steps of SGD on fresh N-device batches) -- one row: the
distance between the two results, relative to the parameters and to how far the
N small steps moved them. Small batch j comes from device j's distribution, so
that the big batch is the N-device batch of the other experiments.

Two more rows per N and learning rate follow early training over
``2 * WARMUP_WINDOWS`` windows from the initial weights: the N-device run takes
one big step per window, at lr * N from the start (``no-warm-up``) or with
Goyal et al.'s gradual warm-up (``warm-up``: lr * (1 + (N - 1) * t / W) at
window t, lr * N from window W on), against the small-batch run's N steps per
window at lr, on the same batches.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from harness.fit import relative_error
from harness.seeding import generator_for
from harness.studies.update.experiments.linear_scaling import (
    PHASES,
    SCHEDULES,
    WARM_UP,
    ScalingRule,
)
from harness.studies.update.recipes import MICRO_BATCH, TASK, initial_model
from harness.studies.update.training import flat_parameters, update_error
from harness.tasks import Batch
from harness.tolerances import LINEAR_SCALING_TOLERANCE, dtype_name

if TYPE_CHECKING:
    from harness.studies.update.experiment import Trial

#: Enough SGD steps for the loss to flatten out on this regression (the "later in
#: training" phase), at a learning rate well inside the stable range.
PRETRAIN_STEPS = 100
PRETRAIN_LR = 0.1
#: Goyal et al.'s warm-up length W, in windows (big steps); the runs are compared after 2W,
#: when the warmed-up run has spent as many windows at lr * N as it took to get there.
WARMUP_WINDOWS = 5


def descend(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Batch) -> None:
    """One step of ``optimizer`` on the mean loss of ``batch``."""
    TASK.loss(model(batch.x), batch, "mean").backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def sgd_step(model: nn.Module, batch: Batch, lr: float) -> None:
    """One step of a fresh torch.optim.SGD (no state to carry) on the mean loss of ``batch``."""
    descend(model, torch.optim.SGD(model.parameters(), lr=lr), batch)


def small_batches(seed: int, world_size: int, key: str, dtype: torch.dtype) -> list[Batch]:
    """N batches of b samples, batch j from device j's distribution."""
    generator = generator_for(seed, key, world_size)
    return [TASK.make_shard(MICRO_BATCH, j, generator, dtype) for j in range(world_size)]


def pretrained(initial: nn.Module, world_size: int, seed: int, dtype: torch.dtype) -> nn.Module:
    """The initial weights after PRETRAIN_STEPS steps on fresh N-device batches."""
    model = copy.deepcopy(initial)
    generator = generator_for(seed, "update-pretrain", world_size)
    for _ in range(PRETRAIN_STEPS):
        batch = Batch.cat([TASK.make_shard(MICRO_BATCH, j, generator, dtype)
                           for j in range(world_size)])
        sgd_step(model, batch, PRETRAIN_LR)
    return model


def big_step_factor(schedule: str, window: int, world_size: int) -> float:
    """The big step's learning rate over the small steps' at ``window`` (0-based)."""
    if schedule != WARM_UP:
        return world_size
    return 1 + (world_size - 1) * min(1.0, window / WARMUP_WINDOWS)


def early_windows(seed: int, world_size: int, dtype: torch.dtype) -> list[list[Batch]]:
    """2W windows of N small batches each: the early-training comparison's data."""
    return [small_batches(seed, world_size, f"update-warm-up/{t}", dtype)
            for t in range(2 * WARMUP_WINDOWS)]


def early_training(start: nn.Module, windows: list[list[Batch]], lr: float, world_size: int,
                   schedule: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(big-batch run, small-batch run) parameters after every window, from ``start``."""
    small, big = copy.deepcopy(start), copy.deepcopy(start)
    small_sgd = torch.optim.SGD(small.parameters(), lr=lr)
    big_sgd = torch.optim.SGD(big.parameters(), lr=lr)
    for t, window in enumerate(windows):
        for batch in window:
            descend(small, small_sgd, batch)
        big_sgd.param_groups[0]["lr"] = lr * big_step_factor(schedule, t, world_size)
        descend(big, big_sgd, Batch.cat(window))
    return flat_parameters(big), flat_parameters(small)


def _row(lr: float, world_size: int, steps: int, setting: str, big: torch.Tensor,
         small: torch.Tensor, start: torch.Tensor, dtype: torch.dtype,
         big_lr: str) -> dict[str, Any]:
    error = update_error(big, small, start)
    return {
        "micro_batch": MICRO_BATCH, "loss": "mean", "sync": "none", "optimizer": "sgd",
        "optimizer_settings": f"SGD lr={lr:g} (big step: {big_lr})",
        "learning_rate": lr, "steps": steps, "setting": setting, "dtype_used": dtype_name(dtype),
        "lr_multiplier": world_size, "device": "cpu",
        "param_distance": relative_error(big, small), "update_error": error,
        "verdict": (ScalingRule.HOLDS if error <= LINEAR_SCALING_TOLERANCE
                    else ScalingRule.BREAKS),
    }


def measure(trial: Trial) -> list[dict[str, Any]]:
    """Rows of both phases, and of both warm-up schedules where early training is measured:
    the costly part, at the widest N alone unless the matrix is full."""
    world_size, lrs = trial.world_size, trial.options.lrs
    dtype, seed = trial.run.dtype, trial.run.seed
    early = trial.full or world_size == max(trial.run.world_sizes)
    initial = initial_model(seed, dtype)
    # The phases in their order: the initial weights, and those after pre-training.
    starts = dict(zip(PHASES, (initial, pretrained(initial, world_size, seed, dtype)),
                      strict=True))
    batches = small_batches(seed, world_size, "update-linear-scaling", dtype)
    rows = []
    for phase in PHASES:
        start = starts[phase]
        for lr in lrs:
            sequential = copy.deepcopy(start)
            for batch in batches:
                sgd_step(sequential, batch, lr)
            one_big = copy.deepcopy(start)
            sgd_step(one_big, Batch.cat(batches), lr * world_size)
            small, big = flat_parameters(sequential), flat_parameters(one_big)
            rows.append(_row(lr, world_size, 1, phase, big, small, flat_parameters(start),
                             dtype, f"lr={lr * world_size:g}"))
    windows = early_windows(seed, world_size, dtype) if early else []
    for schedule in SCHEDULES if early else ():
        for lr in lrs:
            big, small = early_training(initial, windows, lr, world_size, schedule)
            ramp = f"lr ramped {lr:g} -> {lr * world_size:g} over {WARMUP_WINDOWS} steps"
            rows.append(_row(lr, world_size, len(windows), schedule, big, small,
                             flat_parameters(initial), dtype,
                             ramp if schedule == WARM_UP else f"lr={lr * world_size:g}"))
    return rows
