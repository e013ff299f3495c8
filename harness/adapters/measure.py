"""One user setup through one framework setting, judged by the check's engine.

The one implementation behind the frameworks study and ``grad-check --frameworks``:
every rank trains (the framework's way, see its adapter), rank 0 gathers what each
rank's optimizer was handed and did, and compares it with two big-batch references from
the check's engine (:func:`harness.check.reference.compute_reference`, float64): the
plain one (what a user moving from a plain PyTorch loop expects), and the same under the
framework's recipe (its gradient-norm clip, once per window). The fit, the verdict, the
precision a row is judged at and the fix are the check's (harness/check/compare.py,
precision.py, fix.py); what only a framework does (a clip it applies, a count it
passes, a scheduler it steps its own way) is named by :mod:`harness.adapters.fixes`.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import io
import logging
import math
import os
import sys
import tempfile
import warnings
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from harness.adapters.columns import COLUMNS
from harness.adapters.data import IGNORE, label_counts
from harness.adapters.registry import Applied, Framework, FrameworkSetting, Job
from harness.adapters.step_capture import CapturedStep, StepCapture, watching_losses
from harness.check import batches
from harness.check.causes.evidence import FrameworkStep
from harness.check.compare import Comparison, Pair, compare
from harness.check.fix import Facts, batchnorm_tensors, measure_loss_combination
from harness.check.judge import (
    Compared,
    Judged,
    Memory,
    Seeing,
    Seen,
    at_full_precision,
    judge_step,
    judged_row,
)
from harness.check.load import prepared_model
from harness.check.precision import case_precision, tolerance
from harness.check.reference import ReferenceStep, compute_reference, state_names
from harness.check.setup import Setup
from harness.check.step import run_dtype
from harness.columns import POINTS
from harness.errors import first_sentence
from harness.fit import relative_error
from harness.strategies.common import relative_spread
from harness.tolerances import dtype_name
from harness.verdicts import Status

#: Loggers that announce devices, plugins and hints on every training run.
CHATTY_LOGGERS = ("accelerate", "transformers", "DeepSpeed", "deepspeed", "torch.distributed",
                  "torch.nn.parallel.distributed")
#: A framework's own cells of a row with nothing measured (a setting it refused).
UNMEASURED = {"relative_error": math.nan, "rank_spread": math.nan, "recipe_verdict": "",
              "recipe_scale": math.nan, "recipe_residual": math.nan}
#: The references run on the CPU of rank 0, whatever the frameworks trained on.
CPU = torch.device("cpu")


@contextlib.contextmanager
def quietly():
    """The frameworks' warnings and banners say nothing about the gradient: keep the
    console for the harness."""
    levels = {name: logging.getLogger(name).level for name in CHATTY_LOGGERS}
    for name in levels:
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        # DeepSpeed prints its banners; the run's stdout is the harness's summary.
        with (warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()),
              without_noise()):
            warnings.simplefilter("ignore")
            yield
    finally:
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)


#: Lines of C++ warnings no Python filter reaches (the reducer warns from its own thread
#: through c10's log): DDP's hint that find_unused_parameters=True, which the Trainer
#: passes for any model not a PreTrainedModel, found no unused parameter.
NOISE = ("find_unused_parameters=True was specified in DDP constructor",)


@contextlib.contextmanager
def without_noise():
    """The process's stderr (its descriptor: C++ writes there directly) kept aside while
    a framework trains, then written back without the :data:`NOISE` lines."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as kept:
        os.dup2(kept.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            kept.seek(0)
            lines = kept.read().decode(errors="replace").splitlines(keepends=True)
            sys.stderr.write("".join(line for line in lines
                                     if not any(noise in line for noise in NOISE)))
            sys.stderr.flush()


def freeze_survivors() -> None:
    """Collect the case's garbage, then exempt every object still alive (above all the
    frameworks' modules, millions of objects) from later collections.

    Accelerate (under transformers' Trainer) calls ``gc.collect()`` as every training
    ends; scanning the imported frameworks made each call take 0.4 s, 7 s of a rank's
    18 s run. Frozen objects are still freed when their last reference goes.
    """
    gc.collect()
    gc.freeze()


def training_dtype(framework: Framework, setup: Setup, wanted: torch.dtype) -> torch.dtype:
    """The framework's dtype, or the one asked for when that is narrower; float32 under
    autocast (which never casts float64)."""
    if torch.float32 in (framework.dtype, wanted, run_dtype(setup, wanted)):
        return torch.float32
    return torch.float64


def measure(framework: Framework, setting: FrameworkSetting, setup: Setup, accum_steps: int,
            dtype: torch.dtype) -> list[dict[str, Any]] | None:
    """Train on every rank (a collective); rank 0 returns one row per step and point, the
    others None. A framework that raises gives one ``error`` row with its exception.

    Under ``Setup.autocast`` the framework trains the setup again without it, and rows are
    judged as the check judges them (:func:`~harness.check.judge.at_full_precision`)."""
    judged = measured_once(framework, setting, setup, accum_steps, dtype)
    if setup.autocast is not None:
        twin = measured_once(framework, setting, replace(setup, autocast=None), accum_steps,
                             dtype)
        judged = at_full_precision(judged, twin) if judged is not None else None
    return None if judged is None else [judged_row(COLUMNS, row) for row in judged]


def measured_once(framework: Framework, setting: FrameworkSetting, setup: Setup, accum_steps: int,
                  dtype: torch.dtype) -> list[Judged] | None:
    """:func:`measure`'s judgements of one training, as the setup says (autocast or not);
    each carries its training's own cells (what was passed, what it took)."""
    job = Job(setup, setting, accum_steps, training_dtype(framework, setup, dtype),
              StepCapture(), world_size=dist.get_world_size())
    applied, error = Applied(""), ""
    try:
        with quietly(), watching_losses(job.capture):
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
    identity = _identity(framework, setting, job, applied, captures)
    failure = next((e for _, _, e in everyone if e), "") or _step_count_error(
        captures, setup.steps, accum_steps)
    if failure:
        return [Judged(0, "", status=Status.ERROR, error=failure,
                       own={**identity, **UNMEASURED})]
    return FrameworkJudge(framework, job, applied, captures).judged(identity)


def _identity(framework: Framework, setting: FrameworkSetting, job: Job, applied: Applied,
              captures: list[StepCapture]) -> dict[str, Any]:
    return {"framework": framework.name, "framework_version": framework.version(),
            "setting": setting.name, "code": applied.code, "world_size": job.world_size,
            "accum_steps": job.accum_steps, "model_dtype": dtype_name(job.dtype),
            "recipe": _recipe(applied), "optimizer_steps": captures[0].step_count,
            "tokens_per_rank": ";".join(str(c.tokens) for c in captures)}


def _recipe(applied: Applied) -> str:
    return f"clip_grad_norm_({applied.clip:g}) once per window" if applied.clip else "none"


def _step_count_error(captures: list[StepCapture], steps: int, accum_steps: int) -> str:
    """Each window of k micro-steps must end in exactly one optimizer step on every rank."""
    taken = sorted({capture.step_count for capture in captures})
    if taken == [steps]:
        return ""
    return (f"took {'/'.join(map(str, taken))} optimizer steps for {steps} window(s) of "
            f"{accum_steps} micro-steps, not {steps}")


def clipping_before(clip: float, before_step):
    """A before_step that clips the window's gradient to norm ``clip`` first, as a
    framework's recipe does, then runs the setup's own."""
    def clipped(model, optimizer, where) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        torch.nn.utils.clip_grad_norm_(params, clip)
        if before_step is not None:
            before_step(model, optimizer, where)

    return clipped


class FrameworkJudge:
    """Rank 0's comparison of every rank's captured steps with the big batch."""

    def __init__(self, framework: Framework, job: Job, applied: Applied,
                 captures: list[StepCapture]) -> None:
        self.framework, self.job, self.applied, self.captures = (framework, job, applied,
                                                                 captures)
        setup = job.setup
        self.dtype = run_dtype(setup, torch.float64)
        used = (job.samples,) * setup.steps
        rtol = tolerance(self.dtype)
        self.plain = compute_reference(setup, self.dtype, CPU, used, rtol, setup.name)
        self.recipe = (compute_reference(
            replace(setup, before_step=clipping_before(applied.clip, setup.before_step)),
            self.dtype, CPU, used, rtol, setup.name) if applied.clip else self.plain)
        window = batches.prepared(batches.take(setup.batch(0), 0, job.samples), self.dtype,
                                  CPU)
        pieces = job.world_size * job.accum_steps
        #: How the loss of the window combines its pieces' losses (for the check's fix),
        #: measured once, where a row asks.
        self.loss_combination = functools.cache(lambda: measure_loss_combination(
            prepared_model(setup, self.dtype, CPU), setup.loss, window, job.micro_batch_size,
            pieces, rtol))
        model = job.model()
        self.names = state_names(model)[0]
        self.sizes = {name: p.numel() for name, p in model.named_parameters()
                      if p.requires_grad}
        self.batchnorm = batchnorm_tensors(model)

    def judged(self, identity: dict[str, Any]) -> list[Judged]:
        """Every step's rows, judged by the engine; the framework's own causes first."""
        facts = Facts(world_size=self.job.world_size, accum_steps=self.job.accum_steps,
                      reduces_in_buckets=self.framework.reduces_in_buckets,
                      find_unused=self.framework.find_unused, batchnorm=frozenset(self.batchnorm),
                      unused=self.plain[0].unused, loss_combination=self.loss_combination)
        judged: list[Judged] = []
        memory = Memory()
        for step in range(self.job.setup.steps):
            precision = case_precision(self.job.dtype, self.job.setup,
                                       [self.plain[step].loss_dtype,
                                        *self.captures[0].loss_dtypes])
            rtol = tolerance(precision)
            recipes = {point: self._compare(step, point, self.recipe[step], rtol)
                       for point in POINTS}
            compared = [self._compared(step, point, rtol, recipes[point], identity)
                        for point in POINTS]
            rows, memory = judge_step(step, compared, precision,
                                      replace(facts, learning_rates=self.plain[step].lrs),
                                      memory, seen=self._seen(step, recipes))
            judged += rows
        return judged

    def _compared(self, step: int, point: str, rtol: float, recipe: Comparison,
                  identity: dict[str, Any]) -> Compared:
        """One point against the plain big batch; the recipe's comparison, the ranks'
        spread and the framework's own cells beside it."""
        plain = self._compare(step, point, self.plain[step], rtol)
        measured = [self._flat(c.steps[step], point, self.plain[step]) for c in self.captures]
        expected = self._flat_reference(point, self.plain[step])
        spread = relative_spread(measured[0], measured)
        own = {**identity, "relative_error": relative_error(measured[0], expected),
               "rank_spread": spread, "recipe_verdict": str(recipe.verdict),
               "recipe_scale": recipe.scale, "recipe_residual": recipe.residual}
        return Compared(point, plain, ranks_agree=spread <= rtol, own=own)

    def _seen(self, step: int, recipes: dict[str, Comparison]) -> Seeing:
        """What only a framework's step shows of a row's cause (harness/check/causes/): its
        recipe's comparison, its clip, its learning rates and the counts it passed."""
        applied = self.applied

        def seeing(measured: Compared) -> Seen:
            return Seen(framework=FrameworkStep(
                recipes[measured.point], self.framework.name, self.framework.clip_setting,
                self.framework.clip_off, self.framework.schedules, applied.clip,
                applied.counts_passed, applied.count_ignored,
                label_counts(self.job.windows[0]), IGNORE, self._learning_rates(step),
                self.job.setup.make_model))

        return seeing

    def _learning_rates(self, step: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """The learning rates the framework's optimizer used and the big batch's."""
        return self.captures[0].steps[step].lrs, self.plain[step].lrs

    def _pieces(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """A flat vector in the model's trainable-parameter order, cut into its tensors."""
        pieces, start = {}, 0
        for name in self.names:
            pieces[name] = flat[start:start + self.sizes[name]]
            start += self.sizes[name]
        return pieces

    def _compare(self, step: int, point: str, reference: ReferenceStep,
                 rtol: float) -> Comparison:
        """Rank 0's gradient (or update) against ``reference``'s, by the check's compare."""
        taken = self.captures[0].steps[step]
        if point == "grad":
            measured = self._pieces(taken.grad)
            pairs = [Pair(name, measured[name], reference.grads[name]) for name in self.names]
        else:
            measured = self._pieces(taken.params)
            pairs = [Pair(name, measured[name], reference.after[name],
                          origin=reference.before[name]) for name in self.names]
        return compare(pairs, self.names, None, CPU, rtol)

    def _flat(self, taken: CapturedStep, point: str, reference: ReferenceStep) -> torch.Tensor:
        """A rank's gradient, or its update from where the big batch started the step."""
        if point == "grad":
            return taken.grad
        return taken.params - self._flat_state(reference.before)

    def _flat_reference(self, point: str, reference: ReferenceStep) -> torch.Tensor:
        if point == "grad":
            return self._flat_state(reference.grads)
        return self._flat_state(reference.after) - self._flat_state(reference.before)

    def _flat_state(self, tensors: dict[str, torch.Tensor | None]) -> torch.Tensor:
        return torch.cat([(tensors[name] if tensors.get(name) is not None
                           else torch.zeros(self.sizes[name], dtype=torch.float64))
                          .detach().reshape(-1).to(torch.float64) for name in self.names])
