"""Experiments ``grad-scaler``, ``non-finite`` and ``bf16-accumulation``: mixed precision.

``grad-scaler``: ``torch.amp.GradScaler("cpu")`` with k-step accumulation, as
PyTorch's AMP examples prescribe it: ``scaler.scale(loss / k).backward()`` every
micro-step, then once per window ``scaler.unscale_``, ``clip_grad_norm_``,
``scaler.step``, ``scaler.update``. Compared with the big-batch run clipped at the
same ``max_norm`` (or not clipped, for ``no-clip``), and with the slip of clipping
the still-scaled gradient (``clip-before-unscale``). GradScaler accepts float64
gradients on the CPU (torch 2.13): these rows run in the run's dtype.

``non-finite``: the same recipe under DDP (or one process), three windows; in the
second, the first micro-batch of the last rank gets an infinite input. The loss
stays finite (tanh saturates) but the first layer's gradient is NaN (tanh's zero
slope times the infinite input); under ``no_sync`` it stays on that
rank until the window's last micro-step all-reduces it into every rank. Each
rank reports whether ``scaler.step`` left its parameters unchanged, and its scale.

``bf16-accumulation``: one window of 64 samples split into k micro-batches
(``loss / k`` each), gradients accumulated in ``.grad``: float32 throughout;
float32 weights with a bfloat16 autocast forward (the gradient accumulates in
float32); the model in bfloat16 (the gradient accumulates in bfloat16). Each is
compared with the float64 gradient of the same window and the same weights
(rounded to bfloat16 first, so that every variant starts from identical numbers).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from harness.context import RunContext
from harness.fit import relative_error
from harness.seeding import generator_for
from harness.strategies import STRATEGIES
from harness.strategies.common import flat_grad
from harness.strategies.ddp import gather_to_leader
from harness.studies.update.clipping import (
    clip_columns,
    clipped_reference,
    local_norm,
    measured_coefficient,
    torch_clip,
)
from harness.studies.update.fleet import Fleet, every_member_parameters, fleet_trainer, members
from harness.studies.update.optimizers import OPTIMIZERS, PLAIN
from harness.studies.update.recipes import TASK, Shape, initial_model, windows
from harness.studies.update.training import (
    Member,
    ReferenceRuns,
    accumulate_window,
    big_batch_gradient,
    big_batch_run,
    flat_parameters,
    update_error,
)
from harness.tolerances import update_tolerance
from harness.verdicts import Equivalence

#: GradScaler recipes: where clipping happens relative to ``unscale_``.
SCALER_SETTINGS = ("no-clip", "unscale-then-clip", "clip-before-unscale")
#: max_norm of the clipping recipes, as a multiple of the big batch's first gradient norm:
#: below 1, so that the big batch clips.
SCALER_MAX_NORM_RATIO = 0.5
#: Windows of the non-finite experiment, the one that holds the infinite input, and
#: the micro-step it is in (the first: under DDP's no_sync it reaches the others only
#: through the window's final all-reduce).
NON_FINITE_WINDOWS = 3
INJECTED_WINDOW = 1
INJECTED_MICRO_STEP = 0
#: bf16-accumulation: samples of the window, and the k it is split into.
BF16_WINDOW = 64
BF16_STEPS = {"default": (1, 4, 16, 64), "full": (1, 2, 4, 8, 16, 32, 64)}
BF16_SETTINGS = ("float32", "autocast-bfloat16", "bfloat16")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ---------------------------------------------------------------- grad-scaler
def _plain_sgd_columns(strategy: str, accum_steps: int, dtype: torch.dtype) -> dict[str, Any]:
    """The columns every GradScaler row shares: plain SGD on the mean/k loss."""
    spec = OPTIMIZERS[PLAIN]
    return {"loss": "mean/k", "sync": STRATEGIES[strategy].sync(accum_steps), "optimizer": PLAIN,
            "optimizer_settings": spec.settings, "learning_rate": spec.lr,
            "dtype_used": dtype_name(dtype)}


def _judged(error: float, tolerance: float) -> Equivalence:
    return Equivalence.MATCHES if error <= tolerance else Equivalence.DIFFERS


def grad_scaler(strategy: str, world_size: int, accum_steps: int, steps: int,
                run_context: RunContext, reports: bool, references: ReferenceRuns
                ) -> list[dict[str, Any]] | None:
    shape = Shape(world_size, accum_steps)
    dtype, seed = run_context.dtype, run_context.seed
    data = windows(seed, shape, steps, dtype)
    initial = initial_model(seed, dtype)
    max_norm = SCALER_MAX_NORM_RATIO * float(big_batch_gradient(initial, data[0]).norm())
    runs = [Member("mean/k", OPTIMIZERS[PLAIN]) for _ in SCALER_SETTINGS]
    trainer = fleet_trainer(strategy, Fleet(initial, len(runs)), world_size, run_context)
    coefficients, scales = _train_scaled(trainer, runs, data, shape, max_norm,
                                         run_context.device.type)
    final = every_member_parameters(trainer)
    if not reports:
        return None
    start = flat_parameters(initial)
    tolerance = update_tolerance(dtype)
    rows = []
    for i, setting in enumerate(SCALER_SETTINGS):
        reference, reference_coefficient = _scaler_reference(
            setting, references, initial, data, max_norm, (seed, dtype, shape, steps))
        error = update_error(final[i], reference, start)
        clipped = {} if setting == "no-clip" else clip_columns(
            max_norm, SCALER_MAX_NORM_RATIO, reference_coefficient, coefficients[i])
        rows.append({
            **_plain_sgd_columns(strategy, accum_steps, dtype), "steps": steps,
            "setting": setting, **clipped,
            "scale_before": scales[0], "scale_after": scales[-1],
            "param_distance": relative_error(final[i], reference), "update_error": error,
            "verdict": _judged(error, tolerance),
        })
    return rows


def _train_scaled(trainer, runs: list[Member], data, shape: Shape, max_norm: float,
                  device_type: str) -> tuple[list[list[float]], list[float]]:
    """Every window under one GradScaler, each copy clipping as its setting says; the clip
    coefficients of the first window per copy, and the scale before and after each window."""
    copies = members(trainer)
    # One optimizer per copy: unscale_ acts on a whole optimizer, and the copies differ
    # exactly in when they unscale.
    optimizers = [OPTIMIZERS[PLAIN].build(c.parameters()) for c in copies]
    scaler = torch.amp.GradScaler(device_type)
    coefficients: list[list[float]] = [[] for _ in SCALER_SETTINGS]
    scales = [scaler.get_scale()]
    for t, window in enumerate(data):
        accumulate_window(trainer, runs, window, shape, no_sync=shape.accum_steps > 1,
                          scale=scaler.scale)
        for i, setting in enumerate(SCALER_SETTINGS):
            if setting == "unscale-then-clip":
                scaler.unscale_(optimizers[i])
            if setting != "no-clip":
                params = list(copies[i].parameters())
                before = local_norm(params)
                torch_clip(params, max_norm)
                if t == 0:
                    coefficients[i].append(measured_coefficient(before, local_norm(params)))
        for optimizer in optimizers:
            scaler.step(optimizer)
            optimizer.zero_grad(set_to_none=True)
        scaler.update()
        scales.append(scaler.get_scale())
    return coefficients, scales


def _scaler_reference(setting: str, references: ReferenceRuns, initial: nn.Module, data,
                      max_norm: float, key: tuple) -> tuple[torch.Tensor, float]:
    """The big-batch parameters a setting is compared with (clipped at ``max_norm`` where
    the setting clips), and the coefficient clipping applied to it at the first step."""
    if setting != "no-clip":
        return clipped_reference(references, initial, data, max_norm, key)
    spec = OPTIMIZERS[PLAIN]
    reference = references.get((*key, PLAIN), lambda: big_batch_run(initial, spec, data))[-1]
    return reference, float("nan")


# ----------------------------------------------------------------- non-finite
def inject_non_finite(data, world_size: int) -> None:
    """An infinite input in the first sample of the chosen micro-batch of the last device."""
    shard = data[INJECTED_WINDOW][INJECTED_MICRO_STEP][world_size - 1]
    shard.x[0, 0] = float("inf")


def non_finite(strategy: str, world_size: int, accum_steps: int, run_context: RunContext,
               reports: bool) -> list[dict[str, Any]] | None:
    shape = Shape(world_size, accum_steps)
    dtype, seed = run_context.dtype, run_context.seed
    data = windows(seed, shape, NON_FINITE_WINDOWS, dtype)
    clean = windows(seed, shape, NON_FINITE_WINDOWS, dtype)
    inject_non_finite(data, world_size)
    initial = initial_model(seed, dtype)
    trainer = fleet_trainer(strategy, Fleet(initial, 1), world_size, run_context)
    per_window, parameters = _train_through_non_finite(trainer, data, shape,
                                                       run_context.device.type)
    every_rank = _every_rank(torch.tensor(per_window, dtype=torch.float64), strategy,
                             world_size, run_context)
    if not reports:
        return None
    reference = big_batch_run(initial, OPTIMIZERS[PLAIN], clean, skip=[INJECTED_WINDOW])
    start = flat_parameters(initial)
    tolerance = update_tolerance(dtype)
    rows = []
    for w in range(NON_FINITE_WINDOWS):
        error = update_error(parameters[w], reference[w], start)
        after = [float(rank[w, 2]) for rank in every_rank]
        rows.append({
            **_plain_sgd_columns(strategy, accum_steps, dtype), "steps": NON_FINITE_WINDOWS,
            "setting": (f"inf in sample 0 of micro-step {INJECTED_MICRO_STEP} of device "
                        f"{world_size - 1} in window {INJECTED_WINDOW}"),
            "window": w, "injected": w == INJECTED_WINDOW,
            "ranks_skipped": int(sum(rank[w, 0] for rank in every_rank)),
            "scale_before": float(every_rank[0][w, 1]), "scale_after": after[0],
            "scale_spread": max(abs(a - after[0]) for a in after),
            "param_distance": relative_error(parameters[w], reference[w]),
            "update_error": error, "verdict": _judged(error, tolerance),
        })
    return rows


def _train_through_non_finite(trainer, data, shape: Shape, device_type: str
                              ) -> tuple[list[tuple[float, float, float]], list[torch.Tensor]]:
    """One copy trained under a GradScaler; per window (skipped on this rank, scale before,
    scale after) and the parameters after it."""
    runs = [Member("mean/k", OPTIMIZERS[PLAIN])]
    member = members(trainer)[0]
    optimizer = OPTIMIZERS[PLAIN].build(member.parameters())
    scaler = torch.amp.GradScaler(device_type)
    per_window, parameters = [], []
    for window in data:
        scale_before = scaler.get_scale()
        accumulate_window(trainer, runs, window, shape, no_sync=shape.accum_steps > 1,
                          scale=scaler.scale)
        before = [p.detach().clone() for p in member.parameters()]
        scaler.step(optimizer)
        optimizer.zero_grad(set_to_none=True)
        scaler.update()
        unchanged = all(torch.equal(b, p) for b, p in zip(before, member.parameters(),
                                                          strict=True))
        per_window.append((float(unchanged), scale_before, scaler.get_scale()))
        parameters.append(every_member_parameters(trainer)[0])
    return per_window, parameters


def _every_rank(mine: torch.Tensor, strategy: str, world_size: int, run_context: RunContext
                ) -> list[torch.Tensor]:
    """This rank's per-window record, or every rank's on rank 0 (a collective case)."""
    if not STRATEGIES[strategy].collective:
        return [mine]
    return gather_to_leader(mine, run_context.group(world_size), run_context.device) or []


# ---------------------------------------------------------- bf16-accumulation
def bf16_accumulation(full: bool, run_context: RunContext) -> list[dict[str, Any]]:
    seed = run_context.seed
    generator = generator_for(seed, "update-bf16")
    window = TASK.make_shard(BF16_WINDOW, 0, generator, torch.float64)
    # Weights representable in bfloat16, so every variant starts from the same numbers.
    initial = initial_model(seed, torch.float64).to(torch.bfloat16).to(torch.float64)
    reference = big_batch_gradient(initial, [[window]])
    rows = []
    for k in BF16_STEPS["full" if full else "default"]:
        for setting in BF16_SETTINGS:
            grad = _accumulated_gradient(initial, window, k, setting)
            rows.append({
                "accum_steps": k, "micro_batch": BF16_WINDOW // k, "loss": "mean/k",
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

