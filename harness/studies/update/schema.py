"""The update study's CSVs: ``TABLES``, one per registered experiment, in the registry's order.

Each experiment declares its columns (``experiments/``, with the shared ones of
``columns.py``); this module only lists them, for the registry's ``study_tables`` and the
docs. Free of torch, like every schema.
"""

from __future__ import annotations

from harness.studies.update.experiments import EXPERIMENTS

TABLES = tuple(experiment.table for experiment in EXPERIMENTS)
