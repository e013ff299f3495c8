"""What a framework adapter declares: its package, its settings, and how it trains a setup.

Each adapter module (``hf_accelerate``, ``lightning_trainer``, ``hf_trainer``,
``deepspeed_engine``) exports one :class:`Framework`. Its ``train`` runs on every rank
of a world whose default process group is already initialized (by the harness's
launch), trains one optimizer step of ``accum_steps`` micro-steps of a user's
:class:`Setup` the framework's way, records the step in the :class:`StepCapture` it
is handed, and returns the configuration it passed, exactly as passed.
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

from harness.check import batches
from harness.check.setup import MicroStep, Setup
from harness.frameworks.capture import StepCapture

#: What to install when a framework is missing (the package's optional extra).
INSTALL_HINT = "pip install '.[frameworks]'"
#: The label of the setting that runs the framework exactly as shipped.
DEFAULT = "default"


@dataclass(frozen=True)
class Setting:
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
    setting: Setting
    #: k: micro-steps per optimizer step.
    accum_steps: int
    #: The framework's (or the run's, where narrower): the model is cast to it.
    dtype: torch.dtype
    #: Where the optimizer's step is recorded.
    capture: StepCapture

    def model(self) -> nn.Module:
        return self.setup.make_model().to(dtype=self.dtype)

    def window(self) -> Any:
        """Global batch 0, floating tensors in the training dtype."""
        return batches.prepared(self.setup.batch(0), self.dtype, torch.device("cpu"))

    def option(self, name: str, default: Any = None) -> Any:
        return self.setting.options.get(name, default)


@dataclass(frozen=True)
class Applied:
    """What a framework was told: the configuration exactly as passed (``code``), and the
    gradient-norm clip it applies once per window (None: it does not clip)."""

    code: str
    clip: float | None = None


#: ``train(job) -> Applied``, on every rank.
Train = Callable[[Job], Applied]


@dataclass(frozen=True)
class Framework:
    name: str
    #: The module to import.
    module: str
    #: The distribution whose version the rows record.
    distribution: str
    settings: tuple[Setting, ...]
    train: Train
    #: The dtype the framework trains in: float64 where it allows it (verdicts in float64).
    dtype: torch.dtype = torch.float64
    #: The setting that clips by default, how to switch it off (for the fix), and the name
    #: of the setting that does (the study measures users' code variants under it too:
    #: a binding clip hides any scale of the gradient).
    clip_setting: str = ""
    clip_off: str = ""
    unclipped: str = ""

    def setting(self, name: str) -> Setting:
        return next(s for s in self.settings if s.name == name)

    def missing(self) -> str | None:
        """Why this framework cannot run here (its package is not installed), or None."""
        if importlib.util.find_spec(self.module) is None:
            return f"{self.distribution} is not installed; {INSTALL_HINT}"
        return None

    def version(self) -> str:
        return installed_version(self.distribution)


@functools.cache
def installed_version(distribution: str) -> str:
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


def micro_loss(setup: Setup, model: nn.Module, micro_batch: Any, index: int,
               accum_steps: int, world_size: int, window: Any) -> torch.Tensor:
    """The loss a user's training step returns to the framework: ``setup.loss`` of the
    micro-batch, or the setup's own ``micro_step`` where it has one (the framework then
    applies its own scaling to what it returns, as it would in the user's code)."""
    if setup.micro_step is None:
        return setup.loss(model, micro_batch)
    where = MicroStep(index=index, accum_steps=accum_steps, world_size=world_size,
                      global_batch_size=batches.sample_count(window, "batch(0)"),
                      window=window)
    return setup.micro_step(model, micro_batch, where)
