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
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from harness.context import RunContext
from harness.seeding import generator_for
from harness.studies.update.recipes import MICRO_BATCH, TASK, initial_model
from harness.studies.update.training import flat_parameters, relative_distance, update_error
from harness.studies.update.verdicts import ScalingRule
from harness.tasks import Batch
from harness.tolerances import LINEAR_SCALING_TOLERANCE

PHASES = ("initial", "trained")
#: Enough SGD steps for the loss to flatten out on this regression (the "later in
#: training" phase), at a learning rate well inside the stable range.
PRETRAIN_STEPS = 100
PRETRAIN_LR = 0.1


def sgd_step(model: nn.Module, batch: Batch, lr: float) -> None:
    """One step of torch.optim.SGD on the mean loss of ``batch``."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    TASK.loss(model(batch.x), batch, "mean").backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


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


def run(world_size: int, lrs: tuple[float, ...], run_context: RunContext) -> list[dict[str, Any]]:
    dtype, seed = run_context.dtype, run_context.seed
    initial = initial_model(seed, dtype)
    starts = {"initial": initial, "trained": pretrained(initial, world_size, seed, dtype)}
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
            error = update_error(big, small, flat_parameters(start))
            rows.append({
                "accum_steps": 1, "loss": "mean", "sync": "none", "optimizer": "sgd",
                "optimizer_settings": f"SGD lr={lr:g} (big step: lr={lr * world_size:g})",
                "learning_rate": lr, "steps": 1, "setting": phase,
                "dtype_used": str(dtype).removeprefix("torch."),
                "lr_multiplier": world_size, "device": "cpu",
                "param_distance": relative_distance(big, small), "update_error": error,
                "verdict": (ScalingRule.HOLDS if error <= LINEAR_SCALING_TOLERANCE
                            else ScalingRule.BREAKS),
            })
    return rows
