"""``run.json``: what a run was, typed, and the settings hash that guards ``--resume``.

The manifest is written once at the end of a run (atomically) and read back,
typed and without torch, by :func:`read_manifest`: the report, ``grad-compare``
(``results_folder.py``) and the docs generator. Its keys are the fields below; ``settings``
holds every setting that can change a measured number (the run-wide ones and
each study's own options), and the settings hash covers exactly that, so a
setting added tomorrow is covered by ``--resume``'s refusal the day it is added.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harness.errors import UsageError
from harness.results import MANIFEST

if TYPE_CHECKING:
    from harness.config import RunConfig
    from harness.placement import Placement


class ManifestError(UsageError):
    """A folder without a readable ``run.json``: the message names the file and what is wrong."""


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
    import torch

    return json_ready({**config.results_settings(), "backend": placement.backend,
                        "device": placement.device.type, "world_sizes": list(world_sizes),
                        "torch": torch.__version__})


def settings_hash(settings: dict[str, Any]) -> str:
    """A short hash of ``settings``: resuming across a different one would mix runs."""
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class StudyEntry:
    """One study of the run: its CSVs (most studies write one), how many cases, how long it
    took."""

    csvs: tuple[str, ...]
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

    def value(self, key: str, default: Any = None) -> Any:
        """A context column (``backend``, ``torch_version``, ...) or a field, by its JSON key."""
        if key in self.context:
            return self.context[key]
        return getattr(self, key, default) if key in _FIELDS else default

    @property
    def dtype(self) -> str:
        return str(self.context.get("dtype", "float64"))

    def csv_names(self, study: str) -> tuple[str, ...]:
        """The CSVs the manifest names for ``study`` (``<study>.csv`` when it names none)."""
        entry = self.studies.get(study)
        return entry.csvs if entry is not None and entry.csvs else (f"{study}.csv",)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RunManifest:
        """The manifest of a parsed ``run.json``; keys it does not know are context columns.
        Fields missing from an older run's file are empty."""
        studies = {name: StudyEntry(csvs=_csvs(entry), cases=int(_number(entry, "cases")),
                                    wall_time_s=_number(entry, "wall_time_s"))
                   for name, entry in data.get("studies", {}).items()}
        known = {name: data[name] for name in _FIELDS if name in data and name != "studies"}
        context = {key: value for key, value in data.items() if key not in _FIELDS}
        return cls(**{"command": "", "settings": {}, "config": {}, "world_sizes": [],
                      "started": "", "wall_time_s": float("nan"), **known},
                   context=context, studies=studies)


_FIELDS = {f.name for f in fields(RunManifest)} - {"context"}


def _csvs(entry: Any) -> tuple[str, ...]:
    """A study's CSVs: its list ``csvs``, or the one ``csv`` an older run's file names."""
    if not isinstance(entry, dict):
        return ()
    listed = entry.get("csvs")
    if isinstance(listed, list):
        return tuple(name for name in listed if isinstance(name, str))
    return (entry["csv"],) if isinstance(entry.get("csv"), str) else ()


def _number(entry: Any, key: str) -> float:
    value = entry.get(key) if isinstance(entry, dict) else None
    return float(value) if isinstance(value, int | float) else 0.0


def read_manifest(out: Path) -> RunManifest:
    """``out/run.json``, typed; ManifestError when ``out`` is not the folder of a finished run."""
    if not out.exists():
        raise ManifestError(f"{str(out)!r} does not exist; give the --out folder of a study run")
    if not out.is_dir():
        raise ManifestError(f"{str(out)!r} is not a folder; give the --out folder of a study run")
    path = out / MANIFEST
    if not path.exists():
        what = "is empty" if not any(out.iterdir()) else f"has no {MANIFEST}"
        raise ManifestError(f"{str(out)!r} {what}; a finished run of scripts/study.py writes "
                            f"{MANIFEST} next to its CSVs")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ManifestError(f"{path}: not valid JSON ({error})") from None
    if not isinstance(data, dict) or not isinstance(data.get("studies"), dict):
        raise ManifestError(f"{path}: has no 'studies' object naming the run's studies and CSVs")
    if not data["studies"]:
        raise ManifestError(f"{path}: lists no studies")
    return RunManifest.from_json(data)
