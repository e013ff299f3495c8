"""One user setup through one framework setting, compared with the big batch twice.

The one implementation behind the frameworks study and ``grad-check --frameworks``:
every rank trains (the framework's way, see its adapter), rank 0 gathers what each
rank's optimizer was handed and did, and fits it against two big-batch steps in
float64: the plain one (what a user moving from a plain PyTorch loop expects), and
the same under the framework's recipe (its gradient-norm clip, once per window).
"""

from __future__ import annotations

import contextlib
import gc
import io
import logging
import math
import warnings
from typing import Any

import torch
import torch.distributed as dist

from harness.check.compare import worst_tensors
from harness.check.fix import loss_scale_fix
from harness.check.setup import Setup
from harness.errors import first_sentence
from harness.fit import equivalence_verdict, fit_scale, relative_error
from harness.frameworks.capture import StepCapture
from harness.frameworks.data import used_samples
from harness.frameworks.registry import Applied, Framework, Job, Setting
from harness.strategies.common import relative_spread
from harness.studies.frameworks.setups import Reference, big_batch_steps
from harness.tolerances import relative_tolerance

#: What ``point`` names: the gradient before the step, the update it made.
POINTS = ("grad", "params")
#: Loggers that announce devices, plugins and hints on every training run.
CHATTY_LOGGERS = ("accelerate", "transformers", "DeepSpeed", "deepspeed", "torch.distributed")
NUMBERS = ("scale", "residual", "relative_error", "rank_spread", "recipe_scale",
           "recipe_residual")
#: Two gradients clipped to the same norm have scales within the clip's own epsilon
#: (1e-6 of the norm) of each other, whatever their scales before: closer than this, a
#: binding clip explains the scale, far below the 1/k or 1/N a wrong accumulation gives.
CLIPPED_ALIKE = 1e-4


@contextlib.contextmanager
def quietly():
    """The frameworks' warnings and banners say nothing about the gradient: keep the
    console for the harness."""
    levels = {name: logging.getLogger(name).level for name in CHATTY_LOGGERS}
    for name in levels:
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        # DeepSpeed prints its banners; the run's stdout is the harness's summary.
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)


def freeze_survivors() -> None:
    """Collect the case's garbage, then exempt every object still alive (above all the
    frameworks' modules, millions of objects) from later collections.

    Accelerate (under transformers' Trainer) calls ``gc.collect()`` as every training
    ends; scanning the imported frameworks made each call take 0.4 s, 7 s of a rank's
    18 s run. Frozen objects are still freed when their last reference goes.
    """
    gc.collect()
    gc.freeze()


def training_dtype(framework: Framework, wanted: torch.dtype) -> torch.dtype:
    """The framework's dtype, or the one asked for when that is narrower."""
    return torch.float32 if torch.float32 in (framework.dtype, wanted) else torch.float64


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def measure(framework: Framework, setting: Setting, setup: Setup, accum_steps: int,
            dtype: torch.dtype) -> list[dict[str, Any]] | None:
    """Train on every rank (a collective); rank 0 returns one row per point, the others
    None. A framework that raises gives one ``failed`` row with its exception."""
    job = Job(setup, setting, accum_steps, training_dtype(framework, dtype), StepCapture())
    applied, error = Applied(""), ""
    try:
        with quietly():
            applied = framework.train(job)
    except Exception as raised:  # a setting the framework refuses, alike on every rank
        error = first_sentence(raised)
    freeze_survivors()
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (job.capture, applied, error))
    if dist.get_rank() != 0:
        return None
    captures = [capture for capture, _, _ in everyone]
    applied = next((a for _, a, _ in everyone if a.code), applied)
    identity = {"framework": framework.name, "framework_version": framework.version(),
                "setting": setting.name, "code": applied.code,
                "world_size": dist.get_world_size(), "accum_steps": accum_steps,
                "model_dtype": dtype_name(job.dtype), "recipe": _recipe(applied),
                "optimizer_steps": job.capture.steps,
                "tokens_per_rank": ";".join(str(c.tokens) for c in captures)}
    failure = next((e for _, _, e in everyone if e), "") or _step_count_error(captures,
                                                                             accum_steps)
    if failure:
        return [{**identity, **dict.fromkeys(NUMBERS, math.nan), "point": "", "verdict": "",
                 "recipe_verdict": "", "worst_tensors": "", "fix": "", "error": failure,
                 "status": "failed"}]
    used = used_samples(setup.batch(0), dist.get_world_size(), accum_steps)
    plain, recipe = big_batch_steps(setup, used, applied.clip)
    rtol = relative_tolerance(job.dtype)
    return [{**identity, **_compare(point, captures, plain, recipe, rtol),
             "fix": _fix_of(framework, applied, point, captures, plain, recipe, rtol,
                            accum_steps),
             "error": "", "status": "ok"}
            for point in POINTS]


def _recipe(applied: Applied) -> str:
    return f"clip_grad_norm_({applied.clip:g}) once per window" if applied.clip else "none"


def _step_count_error(captures: list[StepCapture], accum_steps: int) -> str:
    """One window of k micro-steps must end in exactly one optimizer step on every rank."""
    steps = sorted({capture.steps for capture in captures})
    if steps == [1]:
        return ""
    return (f"took {'/'.join(map(str, steps))} optimizer steps for one window of "
            f"{accum_steps} micro-steps, not 1")


def _measured(point: str, captures: list[StepCapture], reference: Reference
              ) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Every rank's gradient (or update) and the reference's; the update, not the
    weights: a step of the wrong size is then a wrong scale."""
    if point == "grad":
        return [c.grad for c in captures], reference.grad
    return ([c.params - reference.before for c in captures],
            reference.after - reference.before)


def _compare(point: str, captures: list[StepCapture], plain: Reference, recipe: Reference,
             rtol: float) -> dict[str, Any]:
    """Rank 0's gradient (or update) against the plain big batch and the recipe's."""
    measured, expected = _measured(point, captures, plain)
    fit = fit_scale(measured[0], expected)
    measured_recipe, expected_recipe = _measured(point, captures, recipe)
    recipe_fit = fit_scale(measured_recipe[0], expected_recipe)
    return {"point": point, "verdict": equivalence_verdict(fit, rtol), "scale": fit.scale,
            "residual": fit.residual, "relative_error": relative_error(measured[0], expected),
            "rank_spread": relative_spread(measured[0], measured),
            "worst_tensors": worst_tensors(
                tensor_errors(measured[0], expected, fit.scale, plain.shapes), rtol),
            "recipe_verdict": equivalence_verdict(recipe_fit, rtol),
            "recipe_scale": recipe_fit.scale, "recipe_residual": recipe_fit.residual}


def tensor_errors(measured: torch.Tensor, expected: torch.Tensor, scale: float,
                  shapes: tuple[tuple[str, int], ...]) -> list[tuple[str, float]]:
    """Each tensor's ``||m - s r|| / ||s r||``, in the model's order."""
    errors, start = [], 0
    for name, size in shapes:
        m, r = measured[start:start + size], expected[start:start + size] * scale
        start += size
        norm = float(r.norm())
        left = float((m - r).norm())
        errors.append((name, left / norm if norm > 0 else (math.inf if left else 0.0)))
    return errors


def _fix_of(framework: Framework, applied: Applied, point: str,
            captures: list[StepCapture], plain: Reference, recipe: Reference, rtol: float,
            accum_steps: int) -> str:
    measured, expected = _measured(point, captures, plain)
    plain_fit = fit_scale(measured[0], expected)
    measured, expected = _measured(point, captures, recipe)
    return suggest(framework, applied, plain_fit, fit_scale(measured[0], expected), rtol,
                   len(captures), accum_steps)


def suggest(framework: Framework, applied: Applied, plain_fit, recipe_fit, rtol: float,
            world_size: int, accum_steps: int) -> str:
    """The fix a row's two comparisons point to; empty where the plain step is matched."""
    if equivalence_verdict(plain_fit, rtol) == "matches":
        return ""
    verdict = equivalence_verdict(recipe_fit, rtol)
    if verdict == "matches" and applied.clip:
        return (f"{framework.name}'s clip binds: {framework.clip_setting} clipped the "
                f"window's gradient to norm {applied.clip:g}, scaling the step by "
                f"{plain_fit.scale:.4g} (once per window, as a big batch clipped the same "
                f"way); for the plain loop's step set {framework.clip_off}")
    if applied.clip and abs(recipe_fit.scale - 1) < CLIPPED_ALIKE:
        return (f"{framework.name}'s clip binds and hides the accumulation's own scale: "
                f"{framework.clip_setting} clipped the window's gradient to norm "
                f"{applied.clip:g}, as it clips the big batch's; set {framework.clip_off} to "
                f"see the scale, or fix it where the loss is computed")
    if verdict == "scaled":
        return loss_scale_fix(recipe_fit.scale, world_size, accum_steps, rtol)
    return ("no single scale explains it: if the loss is a mean over a count that varies per "
            "micro-batch (tokens), normalize by the window's count instead (the sum over the "
            "window's items, divided by their number on all ranks)")
