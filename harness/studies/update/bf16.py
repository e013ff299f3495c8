"""Experiment ``bf16-accumulation``: the error of bf16 against fp32 gradients as k grows.

One window of 64 samples split into k micro-batches (``loss / k`` each), gradients
accumulated in ``.grad``: float32 throughout; float32 weights with a bfloat16 autocast
forward (the gradient accumulates in float32); the model in bfloat16 (the gradient
accumulates in bfloat16). Each is compared with the float64 gradient of the same window
and the same weights (rounded to bfloat16 first, so that every variant starts from
identical numbers).
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from harness.seeding import generator_for
from harness.strategies.common import flat_grad
from harness.studies.update.experiments.bf16_accumulation import SETTINGS
from harness.studies.update.recipes import TASK, initial_model
from harness.studies.update.training import big_batch_gradient
from harness.tolerances import dtype_name

if TYPE_CHECKING:
    from harness.studies.update.experiment import Trial

#: Samples of the window, and the k it is split into.
WINDOW = 64
STEPS = {"default": (1, 4, 16, 64), "full": (1, 2, 4, 8, 16, 32, 64)}


def measure(trial: Trial) -> list[dict[str, Any]]:
    seed = trial.run.seed
    generator = generator_for(seed, "update-bf16")
    window = TASK.make_shard(WINDOW, 0, generator, torch.float64)
    # Weights representable in bfloat16, so every variant starts from the same numbers.
    initial = initial_model(seed, torch.float64).to(torch.bfloat16).to(torch.float64)
    reference = big_batch_gradient(initial, [[window]])
    rows = []
    for k in STEPS["full" if trial.full else "default"]:
        for setting in SETTINGS:
            grad = _accumulated_gradient(initial, window, k, setting)
            rows.append({
                "accum_steps": k, "micro_batch": WINDOW // k, "loss": "mean/k",
                "sync": "none", "setting": setting, "dtype_used": dtype_name(grad.dtype),
                # On the CPU whatever the run's device: autocast runs here on the CPU.
                "device": "cpu",
                "grad_error": float((grad.to(torch.float64) - reference).norm()
                                    / reference.norm()),
            })
    return rows


def _accumulated_gradient(initial: nn.Module, window, k: int, setting: str) -> torch.Tensor:
    """``.grad`` after k micro-steps of ``loss / k`` over the window's k equal pieces."""
    dtype = torch.bfloat16 if setting == "bfloat16" else torch.float32
    model = copy.deepcopy(initial).to(dtype)
    for piece in window.chunk(k):
        x, y = piece.x.to(dtype), piece.y.to(dtype)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=setting == "autocast-bfloat16"):
            output = model(x)
        loss = TASK.loss(output, type(piece)(x, y), "mean") / k
        loss.backward()
    return flat_grad(model)
