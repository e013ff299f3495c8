"""The frameworks study: do real training frameworks give the optimizer the big-batch gradient?

At world size N = 2 with gradient accumulation k in {1, 4}, each framework trains one
optimizer step of the study's user setups (:mod:`harness.studies.frameworks.setups`: a
tiny language model, a token-mean cross-entropy, plain SGD, and the variants users
write) its own way, exactly as shipped (``default``) and with the settings users
commonly change, through the same code as ``grad-check --frameworks``
(:mod:`harness.adapters.measure`).

The frameworks reduce over the default process group, so the study measures at a
launch of exactly two ranks (``--nproc 2``). A framework whose package is missing
gets one row saying so; the study itself is unavailable when none is installed.
"""

from __future__ import annotations

import math
from typing import Any

from harness.adapters import FRAMEWORKS
from harness.adapters.columns import COLUMNS as FRAMEWORK_COLUMNS
from harness.adapters.measure import UNMEASURED, measure
from harness.adapters.registry import DEFAULT, INSTALL_HINT, Framework, FrameworkSetting
from harness.check.judge import Judged, judged_row
from harness.context import RunContext
from harness.studies.base import Case, Study
from harness.studies.frameworks.schema import COLUMNS
from harness.studies.frameworks.setups import LOSSES, PLAIN, VARIANTS, SetupVariant, make_setup

VARIANT = {variant.name: variant for variant in VARIANTS}
#: The frameworks reduce over the default process group: exactly these ranks.
WORLD_SIZE = 2
ACCUM_STEPS = (1, 4)


def measured_pairs(framework: Framework) -> list[tuple[FrameworkSetting, SetupVariant]]:
    """Every setting on the plain setup, and every variant of the user's code the framework
    is measured with, under its default setting and, where the default clips, with the
    clip off too (a binding clip scales any gradient to the same norm, hiding a wrong
    scale of the accumulation)."""
    plain = VARIANT[PLAIN]
    names = [DEFAULT, *([framework.unclipped] if framework.unclipped else [])]
    return ([(setting, plain) for setting in framework.settings]
            + [(framework.setting(name), variant) for variant in VARIANTS
               if variant is not plain and framework.name in variant.frameworks
               for name in names])


def accum_steps(setting: FrameworkSetting, variant: SetupVariant,
                run: RunContext) -> tuple[int, ...]:
    """Every k for the defaults and the settings and variants marked core (and with
    ``--matrix full``); the largest alone for the rest, where k = 1 only repeats what
    the default showed."""
    core = (setting.core and variant.name == PLAIN) or (setting.name == DEFAULT
                                                       and variant.core)
    return ACCUM_STEPS if core or run.config.matrix == "full" else ACCUM_STEPS[-1:]


class FrameworksStudy(Study):
    name = "frameworks"
    summary = ("HF Accelerate, Lightning, HF transformers' Trainer and DeepSpeed at 2 ranks "
               "with gradient accumulation, as shipped and with the settings users change: "
               "does the optimizer get the plain big-batch gradient, and take its step?")
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
                              setting=setting.name, setup=variant.name, loss=loss,
                              world_size=WORLD_SIZE, accum_steps=k)
                      for setting, variant in measured_pairs(framework) for loss in LOSSES
                      for k in accum_steps(setting, variant, run)]
        return cases

    @staticmethod
    def _launch_fits(run: RunContext) -> bool:
        return run.launch.world_size == WORLD_SIZE and WORLD_SIZE in run.world_sizes

    def run_case(self, case: Case, run: RunContext) -> list[dict[str, Any]] | None:
        framework = FRAMEWORKS[case["framework"]]
        if "setting" not in case.params:
            return [_unmeasured_row(framework, self._not_measured(framework, run))]
        variant = VARIANT[case["setup"]]
        setup = variant.make(make_setup(case["loss"], WORLD_SIZE, case["accum_steps"],
                                        run.seed))
        rows = measure(framework, framework.setting(case["setting"]), setup,
                       case["accum_steps"], run.dtype)
        if rows is None or not run.reports(case):
            return None
        return [{**row, "setup": variant.name, "setup_code": variant.code,
                 "loss": case["loss"]} for row in rows]

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
        table = measured.pivot_table(index=["framework", "setting", "setup", "loss"],
                                     columns="accum_steps", values="verdict", aggfunc="first",
                                     sort=False)
        return "verdict (the optimizer's gradient vs the plain big batch's) by k:\n" + \
            table.to_string()


def _unmeasured_row(framework: Framework, status: str) -> dict[str, Any]:
    """The row of a framework the run could not train (missing, or a launch of another
    size): nothing judged, its status says why."""
    unmeasured = Judged(math.nan, "", status=status,
                        own={**UNMEASURED, "setting": "", "code": "", "model_dtype": "",
                             "recipe": "", "optimizer_steps": math.nan, "tokens_per_rank": ""})
    return {**judged_row(FRAMEWORK_COLUMNS, unmeasured, framework=framework.name,
                         framework_version=framework.version(), world_size=WORLD_SIZE,
                         accum_steps=math.nan),
            "setup": "", "setup_code": "", "loss": ""}
