"""The diagnostics study's model and its fixed knobs: the MLP its experiments train.

:class:`DiagnosticsSetup` (batch size, epochs, the swept learning rates, the reported
steps, the MLP's width, the digits used), :class:`DiagnosticMLP` (whose middle layer can be
left out of the forward: DDP's unused parameters), and the builders that seed its weights
(:func:`build_mlp`) and freeze or skip its middle layer for the DDP frozen-layer cases
(:func:`frozen_layer_mlp`). Apart from study.py, which measures with them, as the training
study's model.py is apart from its trainer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from harness.context import RunContext
from harness.seeding import generator_for
from harness.studies.base import Case
from harness.studies.training.model import seeded_init


@dataclass(frozen=True)
class DiagnosticsSetup:
    """The experiments' fixed knobs."""

    batch_size: int = 30
    #: Two epochs of 50 steps: the dying happens within the first ten.
    epochs: int = 2
    #: From healthy (0.1) through partly dead (1, 3) to every unit dead (10).
    learning_rates: tuple[float, ...] = (0.1, 1.0, 3.0, 10.0)
    #: Steps written to the CSV: the first few (where units die) and then sparser.
    reported_steps: tuple[int, ...] = (1, 2, 3, 5, 10, 20, 50, 100)
    hidden: int = 32
    held_out: int = 297
    #: Training digits used; None: all that are not held out (tests use fewer).
    train_samples: int | None = None
    #: Steps of the frozen-layer experiments: enough to see a second iteration fail.
    frozen_steps: int = 3
    #: Learning rate of the frozen-layer experiments.
    learning_rate: float = 0.1


class DiagnosticMLP(nn.Module):
    """64 -> hidden -> ReLU -> hidden -> ReLU -> 10 on flattened 8x8 digits.

    ``skip_middle`` leaves the middle layer out of ``forward``: its parameters
    then require grad but take no part in the loss (DDP's "unused parameters").
    """

    #: The ReLU each layer feeds: the units whose death cuts that layer's gradient.
    RELU_AFTER = {"input": "relu1", "middle": "relu2"}

    def __init__(self, hidden: int, skip_middle: bool = False) -> None:
        super().__init__()
        self.input = nn.Linear(64, hidden)
        self.relu1 = nn.ReLU()
        self.middle = nn.Linear(hidden, hidden)
        self.relu2 = nn.ReLU()
        self.output = nn.Linear(hidden, 10)
        self.skip_middle = skip_middle

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.relu1(self.input(x))
        if not self.skip_middle:
            h = self.relu2(self.middle(h))
        return self.output(h)


def build_mlp(seed: int, setup: DiagnosticsSetup, dtype: torch.dtype,
              skip_middle: bool = False) -> DiagnosticMLP:
    model = DiagnosticMLP(setup.hidden, skip_middle).to(torch.float64)
    seeded_init(model, generator_for(seed, "diagnostics", "mlp"))
    return model.to(dtype)


def frozen_layer_mlp(case: Case, run: RunContext, setup: DiagnosticsSetup) -> DiagnosticMLP:
    """The DDP frozen-layer case's MLP on the run's device: its middle layer frozen
    (``requires_grad=False``), or, for ``middle`` = unused, left out of the forward."""
    frozen = case["middle"] == "frozen"
    model = build_mlp(run.seed, setup, run.dtype, skip_middle=not frozen).to(run.device)
    if frozen:
        model.middle.requires_grad_(False)
    return model
