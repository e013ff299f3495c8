"""The frameworks study: do real training frameworks give the optimizer the big-batch gradient?

At world size N = 2 with gradient accumulation k in {1, 4}, each framework trains one
optimizer step of the user setup (:mod:`harness.studies.frameworks.setups`: a tiny
language model, a token-mean cross-entropy, plain SGD) its own way, in its default
configuration and with the settings users commonly change. In the optimizer's
``step`` the harness reads the gradient the update is about to use and, right
after, the weights it produced; rank 0 fits both against one process's big batch
(one backward on the whole global batch, one SGD step), in float64.

The frameworks reduce over the default process group, so the study measures at a
launch of exactly two ranks (``--nproc 2``). A framework whose package is missing
gets one row saying so; the study itself is unavailable when none is installed.
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

from harness.context import RunContext
from harness.errors import first_sentence
from harness.fit import equivalence_verdict, fit_scale, relative_error
from harness.strategies.common import relative_spread
from harness.studies.base import Case, Study
from harness.studies.frameworks import (
    deepspeed_engine,
    hf_accelerate,
    hf_trainer,
    lightning_trainer,
)
from harness.studies.frameworks.capture import StepCapture, gather_captures
from harness.studies.frameworks.registry import INSTALL_HINT, Framework, Setting
from harness.studies.frameworks.schema import COLUMNS, POINTS
from harness.studies.frameworks.setups import LOSSES, Reference, big_batch_reference, make_setup
from harness.tolerances import relative_tolerance

#: Every framework, in row order.
FRAMEWORKS: dict[str, Framework] = {
    framework.name: framework
    for framework in (hf_accelerate.FRAMEWORK, lightning_trainer.FRAMEWORK,
                      hf_trainer.FRAMEWORK, deepspeed_engine.FRAMEWORK)}
#: The frameworks reduce over the default process group: exactly these ranks.
WORLD_SIZE = 2
ACCUM_STEPS = (1, 4)
#: Loggers that announce devices, plugins and hints on every training run.
CHATTY_LOGGERS = ("accelerate", "transformers", "DeepSpeed", "deepspeed", "torch.distributed")
NUMBERS = ("scale", "residual", "relative_error", "rank_spread")


def accum_steps(setting: Setting, run: RunContext) -> tuple[int, ...]:
    """Every k for a framework's defaults (and with ``--matrix full``); the largest alone for
    the settings users change, where k = 1 only repeats what the default showed."""
    return ACCUM_STEPS if setting.core or run.config.matrix == "full" else ACCUM_STEPS[-1:]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def training_dtype(framework: Framework, run: RunContext) -> torch.dtype:
    """The framework's dtype, or the run's when that is narrower (``--dtype float32``)."""
    return torch.float32 if torch.float32 in (framework.dtype, run.dtype) else torch.float64


@contextlib.contextmanager
def quietly():
    """The frameworks' warnings and banners say nothing about the gradient: keep the run's
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


class FrameworksStudy(Study):
    name = "frameworks"
    summary = ("HF Accelerate, Lightning, HF transformers' Trainer and DeepSpeed (ZeRO 0/1/2) "
               "at 2 ranks with gradient accumulation: does the optimizer get the big-batch "
               "gradient, and take the big-batch step?")
    example = "python scripts/study.py --nproc 2 --studies frameworks"
    columns = COLUMNS
    #: 40 to 75 s of a run on 2 cores (most of it importing and starting the frameworks):
    #: too much for the lean default run.
    in_default_run = False

    def unavailable(self) -> str | None:
        if all(framework.missing() for framework in FRAMEWORKS.values()):
            return f"none of {', '.join(FRAMEWORKS)} is installed; {INSTALL_HINT}"
        return None

    def cases(self, run: RunContext) -> list[Case]:
        cases, fits = [], self._launch_fits(run)
        for framework in FRAMEWORKS.values():
            if framework.missing() or not fits:
                cases.append(Case.of(self.name, framework=framework.name))
                continue
            cases += [Case.of(self.name, participants=WORLD_SIZE, framework=framework.name,
                              setting=setting.name, loss=loss, world_size=WORLD_SIZE,
                              accum_steps=k)
                      for setting in framework.settings for loss in LOSSES
                      for k in accum_steps(setting, run)]
        return cases

    @staticmethod
    def _launch_fits(run: RunContext) -> bool:
        return run.launch.world_size == WORLD_SIZE and WORLD_SIZE in run.world_sizes

    def run_case(self, case: Case, run: RunContext) -> list[dict[str, Any]] | None:
        framework = FRAMEWORKS[case["framework"]]
        if "setting" not in case.params:
            return [_unmeasured_row(framework, self._not_measured(framework, run))]
        setting, k = framework.setting(case["setting"]), case["accum_steps"]
        dtype = training_dtype(framework, run)
        setup = make_setup(case["loss"], WORLD_SIZE, k, dtype, run.seed)
        capture, error = StepCapture(), ""
        try:
            with quietly():
                framework.train(setup, setting, k, capture)
        except Exception as raised:  # a setting the framework refuses, alike on every rank
            error = first_sentence(raised)
        freeze_survivors()
        captures = gather_captures((capture, error))
        if not run.reports(case):
            return None
        identity = _identity(framework, setting, case, dtype)
        failure = next((e for _, e in captures if e), "") or _step_count_error(captures, k)
        if failure:
            return [{**identity, **dict.fromkeys(NUMBERS, math.nan), "point": "",
                     "verdict": "", "optimizer_steps": capture.steps,
                     "tokens_per_rank": _tokens(captures), "error": failure,
                     "status": "failed"}]
        reference = big_batch_reference(setup)
        return [{**identity, **_compare(point, [c for c, _ in captures], reference,
                                        relative_tolerance(dtype)),
                 "optimizer_steps": capture.steps, "tokens_per_rank": _tokens(captures),
                 "error": "", "status": "ok"}
                for point in POINTS]

    def _not_measured(self, framework: Framework, run: RunContext) -> str:
        if reason := framework.missing():
            return f"unavailable: {reason}"
        return (f"skipped: the frameworks reduce over the default process group, which must "
                f"hold exactly {WORLD_SIZE} ranks (this launch has {run.launch.world_size}); "
                f"run with --nproc {WORLD_SIZE}")

    def summary_table(self, frame) -> str:
        measured = frame[(frame["status"] == "ok") & (frame["point"] == "grad")]
        if measured.empty:
            return frame[["framework", "status"]].drop_duplicates().to_string(index=False)
        table = measured.pivot_table(index=["framework", "setting", "loss"],
                                     columns="accum_steps", values="verdict", aggfunc="first",
                                     sort=False)
        return "verdict (the optimizer's gradient vs the big batch's) by k:\n" + \
            table.to_string()


def _identity(framework: Framework, setting: Setting, case: Case,
              dtype: torch.dtype) -> dict[str, Any]:
    return {"framework": framework.name, "framework_version": framework.version(),
            "setting": setting.name, "code": setting.code, "loss": case["loss"],
            "world_size": case["world_size"], "accum_steps": case["accum_steps"],
            "model_dtype": dtype_name(dtype)}


def _unmeasured_row(framework: Framework, status: str) -> dict[str, Any]:
    return {"framework": framework.name, "framework_version": framework.version(),
            "setting": "", "code": "", "loss": "", "world_size": WORLD_SIZE,
            "accum_steps": math.nan, "model_dtype": "", "point": "", "verdict": "",
            **dict.fromkeys(NUMBERS, math.nan), "optimizer_steps": math.nan,
            "tokens_per_rank": "", "error": "", "status": status}


def _step_count_error(captures: list, accum_steps: int) -> str:
    """One window of k micro-steps must end in exactly one optimizer step on every rank."""
    steps = sorted({capture.steps for capture, _ in captures})
    if steps == [1]:
        return ""
    return (f"took {'/'.join(map(str, steps))} optimizer steps for one window of "
            f"{accum_steps} micro-steps, not 1")


def _tokens(captures: list) -> str:
    return ";".join(str(capture.tokens) for capture, _ in captures)


def _compare(point: str, captures: list[StepCapture], reference: Reference,
             rtol: float) -> dict[str, Any]:
    """Rank 0's gradient (or update) against the big batch's: scale, residual, verdict."""
    if point == "grad":
        measured = [c.grad for c in captures]
        expected = reference.grad
    else:
        # The update, not the weights: a step of the wrong size is then a wrong scale.
        measured = [c.params - reference.before for c in captures]
        expected = reference.after - reference.before
    fit = fit_scale(measured[0], expected)
    return {"point": point, "verdict": equivalence_verdict(fit, rtol), "scale": fit.scale,
            "residual": fit.residual, "relative_error": relative_error(measured[0], expected),
            "rank_spread": relative_spread(measured[0], measured)}
