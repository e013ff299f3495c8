"""What a framework adapter declares: its package, its settings, and how it trains a setup.

Each adapter module (``hf_accelerate``, ``lightning_trainer``, ``hf_trainer``,
``deepspeed_engine``) exports one :class:`Framework`. Its ``train`` runs on every rank
of a world whose default process group is already initialized (by the harness's
launch), trains ``Setup.steps`` optimizer steps of ``accum_steps`` micro-steps each of a
user's :class:`Setup` the framework's way, with the setup's whole step (``before_step``,
``make_scheduler``, ``autocast``) run through the framework's own hooks, records each
step in the :class:`StepCapture` it is handed, and returns the configuration it passed,
exactly as passed. A field of the setup a framework has no place for is refused by
name before anything runs (:attr:`Framework.refuses`), never ignored.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from harness.adapters.step_capture import StepCapture
from harness.check import batches
from harness.check.setup import MicroStep, Setup

#: What to install when a framework is missing (the package's optional extra).
INSTALL_HINT = "pip install '.[frameworks]'"
#: The label of the setting that runs the framework exactly as shipped.
DEFAULT = "default"
#: Setup fields no framework here runs: each framework scales float16 losses itself.
NO_FRAMEWORK_RUNS = {
    "grad_scaler": "the frameworks scale a float16 loss themselves (their own mixed "
                   "precision), not with the setup's GradScaler",
}


@dataclass(frozen=True)
class FrameworkSetting:
    """One configuration of a framework: a short name for the rows (no spaces or commas,
    so that ``--frameworks NAME:SETTING`` can name it) and what it changes."""

    name: str
    #: What the setting changes from the shipped defaults (empty for ``default``).
    options: Mapping[str, Any] = field(default_factory=dict)
    #: Measured at every k; the others only at the largest k, unless the run asks for
    #: ``--matrix full`` (k = 1 adds little to them).
    core: bool = False

    def __post_init__(self) -> None:
        if not self.name or any(c in self.name for c in " ,"):
            raise ValueError(f"setting name {self.name!r}: allowed: no spaces or commas")


@dataclass(frozen=True)
class Job:
    """One framework run: the user's setup, the setting, k, the dtype to train in."""

    setup: Setup
    setting: FrameworkSetting
    #: k: micro-steps per optimizer step.
    accum_steps: int
    #: The framework's (or the run's, where narrower): the model is cast to it.
    dtype: torch.dtype
    #: Where the optimizer's steps are recorded.
    capture: StepCapture
    #: N: the ranks training together (the default process group's).
    world_size: int = 1

    def model(self) -> nn.Module:
        return self.setup.make_model().to(dtype=self.dtype)

    @functools.cached_property
    def windows(self) -> list[Any]:
        """Global batch of each optimizer step, cut to N x k equal micro-batches, floating
        tensors in the training dtype."""
        return [batches.prepared(batches.take(self.setup.batch(step), 0, self.samples),
                                 self.dtype, torch.device("cpu"))
                for step in range(self.setup.steps)]

    @functools.cached_property
    def micro_batch_size(self) -> int:
        """Samples per micro-batch, the same in every step (validated before)."""
        first = batches.sample_count(self.setup.batch(0), "batch(0)")
        return first // (self.world_size * self.accum_steps)

    @property
    def samples(self) -> int:
        """Samples one window trains on: N x k micro-batches (a remainder is left out)."""
        return self.micro_batch_size * self.world_size * self.accum_steps

    def window_of(self, index: int) -> Any:
        """The window sample ``index`` of the whole data set (every step's window, in
        order) belongs to."""
        return self.windows[index // self.samples]

    def option(self, name: str, default: Any = None) -> Any:
        return self.setting.options.get(name, default)


@dataclass(frozen=True)
class Applied:
    """What a framework was told: the configuration exactly as passed (``code``), the
    gradient-norm clip it applies once per window (None: it does not clip), and the
    counts it handed the loss (the Trainer's ``num_items_in_batch``: None where none)."""

    code: str
    clip: float | None = None
    #: ``num_items_in_batch`` the framework passed each micro-step of step 0, in order.
    counts_passed: tuple[int, ...] | None = None
    #: Whether the model's loss ignored the count it was passed (the same loss with twice
    #: the count): None where it was not probed.
    count_ignored: bool | None = None


#: ``train(job) -> Applied``, on every rank.
Train = Callable[[Job], Applied]


@dataclass(frozen=True)
class Framework:
    name: str
    #: The module to import.
    module: str
    #: The distribution whose version the rows record.
    distribution: str
    settings: tuple[FrameworkSetting, ...]
    train: Train
    #: The dtype the framework trains in: float64 where it allows it (verdicts in float64).
    dtype: torch.dtype = torch.float64
    #: The setting that clips by default, how to switch it off (for the fix), and the name
    #: of the setting that does (the study measures users' code variants under it too:
    #: a binding clip hides any scale of the gradient).
    clip_setting: str = ""
    clip_off: str = ""
    unclipped: str = ""
    #: Setup fields the framework has no place for -> why: refused by name, never ignored.
    refuses: Mapping[str, str] = field(default_factory=dict)
    #: How the framework steps a scheduler, for a fix where the learning rates differ.
    schedules: str = "it stepped the setup's scheduler another number of times"
    #: It reduces with DDP's bucketed all-reduce (see harness/check/fix.py), and how it is
    #: told to look for parameters without a gradient.
    reduces_in_buckets: bool = True
    find_unused: str = "pass find_unused_parameters=True to its DDP"

    def setting(self, name: str) -> FrameworkSetting:
        return next(s for s in self.settings if s.name == name)

    def missing(self) -> str | None:
        """Why this framework cannot run here (its package is not installed), or None."""
        if importlib.util.find_spec(self.module) is None:
            return f"{self.distribution} is not installed; {INSTALL_HINT}"
        return None

    def refused(self, setup: Setup) -> str | None:
        """Why the framework cannot run ``setup``'s whole step here, or None."""
        used = {"before_step": setup.before_step is not None,
                "make_scheduler": setup.make_scheduler is not None,
                "autocast": setup.autocast is not None,
                "autocast=torch.float16": setup.autocast == torch.float16,
                "grad_scaler": setup.grad_scaler}
        for name, why in {**NO_FRAMEWORK_RUNS, **self.refuses}.items():
            if used[name]:
                return f"{self.name} cannot run Setup.{name}: {why}"
        return None

    def version(self) -> str:
        return distribution_version(self.distribution)


@functools.cache
def distribution_version(distribution: str) -> str:
    """The distribution's version, read once: reading package metadata scans every
    installed distribution (24 ms a case here, as long as the check's own ddp case)."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return ""


class Code(str):
    """An argument shown as the code that built it (``DataLoaderConfiguration(...)``)
    rather than as the object's repr."""

    def __repr__(self) -> str:
        return str(self)


def call(name: str, arguments: Mapping[str, Any]) -> str:
    """``Name(a=1, b='x')``: a call exactly as the adapter made it."""
    return f"{name}({', '.join(f'{key}={value!r}' for key, value in arguments.items())})"


def micro_step_of(job: Job, index: int) -> MicroStep:
    """Where micro-step ``index`` (counted from the first step's first) sits: its place in
    its window, and the window itself (the setup's micro_step may count its tokens)."""
    window_index, micro = divmod(index, job.accum_steps)
    window = job.windows[window_index]
    return MicroStep(index=micro, accum_steps=job.accum_steps, world_size=job.world_size,
                     global_batch_size=batches.sample_count(window, "batch"), window=window)


def micro_loss(job: Job, model: nn.Module, micro_batch: Any, index: int) -> torch.Tensor:
    """The loss a user's training step returns to the framework: ``setup.loss`` of the
    micro-batch, or the setup's own ``micro_step`` where it has one (the framework then
    applies its own scaling to what it returns, as it would in the user's code)."""
    if job.setup.micro_step is None:
        return job.setup.loss(model, micro_batch)
    return job.setup.micro_step(model, micro_batch, micro_step_of(job, index))


def before_step(job: Job, model: nn.Module, optimizer: Any, index: int) -> None:
    """The setup's ``before_step`` at the end of the window micro-step ``index`` closes
    (the framework's own hook calls it, right before the optimizer steps)."""
    if job.setup.before_step is not None:
        job.setup.before_step(model, optimizer, micro_step_of(job, index))
