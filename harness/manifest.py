"""``run.json``: what a run was, typed, and the fingerprint that guards ``--resume``.

The manifest is written once at the end of a run (atomically) and read back by
the report and by ``compare.py``. Its keys are the fields below; ``settings``
holds every setting that can change a measured number (the run-wide ones and
each study's own options), and the fingerprint hashes exactly that, so a
setting added tomorrow is covered by ``--resume``'s refusal the day it is added.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from harness.config import RunConfig
from harness.launch import Placement


def json_ready(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, dict):
        return {k: json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_ready(v) for v in value]
    return value


def results_settings(config: RunConfig, placement: Placement,
                     world_sizes: tuple[int, ...]) -> dict[str, Any]:
    """Everything that changes the numbers: the config's results settings, where the
    run computed, the world sizes measured, and the torch version."""
    return json_ready({**config.results_settings(), "backend": placement.backend,
                        "device": placement.device.type, "world_sizes": list(world_sizes),
                        "torch": torch.__version__})


def fingerprint(settings: dict[str, Any]) -> str:
    """A short hash of ``settings``: resuming across a different one would mix runs."""
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class StudyEntry:
    """One study of the run: its CSV, how many cases, how long it took."""

    csv: str
    cases: int
    wall_time_s: float


@dataclass(frozen=True)
class RunManifest:
    """The typed content of ``run.json``."""

    #: The launch's equivalent command line (torchrun's own flags never reach the script).
    command: str
    #: Every setting that can change a number (see :func:`results_settings`).
    settings: dict[str, Any]
    #: The same flags as given, including those that cannot change a number.
    config: dict[str, Any]
    world_sizes: list[int]
    #: The run's context columns (backend, device, dtype, hosts, nodes, ...).
    context: dict[str, Any]
    started: str
    wall_time_s: float
    studies: dict[str, StudyEntry] = field(default_factory=dict)

    def to_json(self) -> str:
        """Flat JSON: context columns at the top level, as every CSV row has them."""
        data = asdict(self)
        context = data.pop("context")
        return json.dumps({**data, **context}, indent=2) + "\n"
