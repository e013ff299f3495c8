"""Experiment ``non-finite``: a non-finite input on one rank under GradScaler with accumulation.

The grad-scaler recipe under DDP (or one process), three windows; in the second, the first
micro-batch of the last rank gets an infinite input. The loss stays finite (tanh
saturates) but the first layer's gradient is NaN (tanh's zero slope times the infinite
input); under ``no_sync`` it stays on that rank until the window's last micro-step
all-reduces it into every rank. Each rank reports whether ``scaler.step`` left its
parameters unchanged, and its scale.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from harness.strategies import STRATEGIES
from harness.strategies.ddp import gather_to_leader
from harness.studies.update import fleet
from harness.studies.update.clipping import plain_sgd_columns
from harness.studies.update.optimizers import OPTIMIZERS, PLAIN
from harness.studies.update.recipes import windows
from harness.studies.update.training import Member, Start, accumulate_window, big_batch_run

if TYPE_CHECKING:
    from harness.studies.update.experiment import Trial

#: Windows of the experiment, the one that holds the infinite input, and the micro-step it
#: is in (the first: under DDP's no_sync it reaches the others only through the window's
#: final all-reduce).
WINDOWS = 3
INJECTED_WINDOW = 1
INJECTED_MICRO_STEP = 0


def inject_non_finite(data, world_size: int) -> None:
    """An infinite input in the first sample of the chosen micro-batch of the last device."""
    shard = data[INJECTED_WINDOW][INJECTED_MICRO_STEP][world_size - 1]
    shard.x[0, 0] = float("inf")


def measure(trial: Trial) -> list[dict[str, Any]] | None:
    start = Start.of(trial, WINDOWS)
    clean = windows(trial.run.seed, start.shape, WINDOWS, start.dtype)
    inject_non_finite(start.data, trial.world_size)
    trainer = fleet.fleet_trainer(trial.strategy, fleet.Fleet(start.initial, 1),
                                  trial.world_size, trial.run)
    per_window, parameters = _train_through_non_finite(trainer, start, trial.run.device.type)
    every_rank = _every_rank(torch.tensor(per_window, dtype=torch.float64), trial)
    if not trial.reports:
        return None
    reference = big_batch_run(start.initial, OPTIMIZERS[PLAIN], clean, skip=[INJECTED_WINDOW])
    recipe = plain_sgd_columns("mean/k", STRATEGIES[trial.strategy].sync(trial.accum_steps),
                               start)
    rows = []
    for w in range(WINDOWS):
        after = [float(rank[w, 2]) for rank in every_rank]
        rows.append({
            **recipe, "steps": WINDOWS,
            "setting": (f"inf in sample 0 of micro-step {INJECTED_MICRO_STEP} of device "
                        f"{trial.world_size - 1} in window {INJECTED_WINDOW}"),
            "window": w, "injected": w == INJECTED_WINDOW,
            "ranks_skipped": int(sum(rank[w, 0] for rank in every_rank)),
            "scale_before": float(every_rank[0][w, 1]), "scale_after": after[0],
            "scale_spread": max(abs(a - after[0]) for a in after),
            **start.judged(parameters[w], reference[w]),
        })
    return rows


def _train_through_non_finite(trainer, start: Start, device_type: str
                              ) -> tuple[list[tuple[float, float, float]], list[torch.Tensor]]:
    """One copy trained under a GradScaler; per window (skipped on this rank, scale before,
    scale after) and the parameters after it."""
    runs = [Member("mean/k", OPTIMIZERS[PLAIN])]
    member = fleet.members(trainer)[0]
    optimizer = OPTIMIZERS[PLAIN].build(member.parameters())
    scaler = torch.amp.GradScaler(device_type)
    per_window, parameters = [], []
    for window in start.data:
        scale_before = scaler.get_scale()
        accumulate_window(trainer, runs, window, start.shape,
                          no_sync=start.shape.accum_steps > 1, scale=scaler.scale)
        before = [p.detach().clone() for p in member.parameters()]
        scaler.step(optimizer)
        optimizer.zero_grad(set_to_none=True)
        scaler.update()
        unchanged = all(torch.equal(b, p) for b, p in zip(before, member.parameters(),
                                                          strict=True))
        per_window.append((float(unchanged), scale_before, scaler.get_scale()))
        parameters.append(fleet.every_member_parameters(trainer)[0])
    return per_window, parameters


def _every_rank(mine: torch.Tensor, trial: Trial) -> list[torch.Tensor]:
    """This rank's per-window record, or every rank's on rank 0 (a collective case)."""
    if not STRATEGIES[trial.strategy].collective:
        return [mine]
    return gather_to_leader(mine, trial.run.group(trial.world_size), trial.run.device) or []
