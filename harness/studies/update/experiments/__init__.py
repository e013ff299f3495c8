"""The update study's experiments: one plug-in module each, registered here in run order.

Adding an experiment: its module here (an ``EXPERIMENT``: name, question, columns, grid,
its ``measure(trial)``, report parts; torch imported inside ``measure``, so that the
schema, the report and the docs read the module without it), and its ``EXPERIMENT`` in the
tuple below. The study's cases, CSVs, schema and report section read the tuple, so
nothing else changes. An experiment that outgrows its module hands a part to one beside it
(lr_factor_measure.py: lr-factor's measurement), which is no experiment of its own: only
the modules whose ``EXPERIMENT`` is in the tuple are.
"""

from __future__ import annotations

from harness.studies.update.experiment import Experiment
from harness.studies.update.experiments import (
    bf16_accumulation,
    clipping,
    grad_scaler,
    linear_scaling,
    lr_factor,
    momentum_correction,
    non_finite,
)

#: Every experiment, in the order its cases run, its CSV is listed and its report reads.
EXPERIMENTS: tuple[Experiment, ...] = (
    lr_factor.EXPERIMENT,
    clipping.EXPERIMENT,
    grad_scaler.EXPERIMENT,
    non_finite.EXPERIMENT,
    bf16_accumulation.EXPERIMENT,
    linear_scaling.EXPERIMENT,
    momentum_correction.EXPERIMENT,
)


def experiment_named(name: str) -> Experiment:
    """The registered experiment called ``name`` (a case's ``experiment``)."""
    for experiment in EXPERIMENTS:
        if experiment.name == name:
            return experiment
    raise KeyError(f"no experiment of the update study is called {name!r}; registered: "
                   + ", ".join(e.name for e in EXPERIMENTS))
