"""What a framework adapter declares: its package, its settings, and how it trains a setup.

Each adapter module (``hf_accelerate``, ``lightning_trainer``, ``hf_trainer``,
``deepspeed_engine``) exports one :class:`Framework`. Its ``train`` runs on every rank
of a 2-rank world whose default process group is already initialized (by the
harness's launch) and trains one optimizer step of ``accum_steps`` micro-steps the
framework's way, recording the step in the :class:`StepCapture` it is handed.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from harness.check.setup import Setup
from harness.studies.frameworks.capture import StepCapture

#: What to install when a framework is missing (the package's optional extra).
INSTALL_HINT = "pip install '.[frameworks]'"


@dataclass(frozen=True)
class Setting:
    """One configuration of a framework: a short name for the rows, the code it stands for."""

    name: str
    #: The configuration as the user writes it (``k`` is the accumulation steps).
    code: str
    options: Mapping[str, Any] = field(default_factory=dict)
    #: The framework's own defaults: measured at every k. The other settings only at the
    #: largest k, unless the run asks for ``--matrix full`` (k = 1 adds little to them).
    core: bool = False


#: ``train(setup, setting, accum_steps, capture)``, on every rank.
Train = Callable[[Setup, Setting, int, StepCapture], None]


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

    def setting(self, name: str) -> Setting:
        return next(s for s in self.settings if s.name == name)

    def missing(self) -> str | None:
        """Why this framework cannot run here (its package is not installed), or None."""
        if importlib.util.find_spec(self.module) is None:
            return f"{self.distribution} is not installed; {INSTALL_HINT}"
        return None

    def version(self) -> str:
        try:
            return importlib.metadata.version(self.distribution)
        except importlib.metadata.PackageNotFoundError:
            return ""
