"""Real training frameworks, each an adapter that trains a user's :class:`Setup` its own way.

Both the frameworks study (harness/studies/frameworks/) and ``grad-check --frameworks``
(harness/grad_check/frameworks_check.py) train through these adapters and measure with
:mod:`harness.adapters.measure`, which judges what each optimizer was handed with the
check's own engine. An adapter is one module exporting a
:class:`~harness.adapters.registry.Framework` (its package, settings and ``train``);
a new one is that module plus one line in :data:`ADAPTERS`. The adapters import their
framework only inside ``train``; this package imports none of them (nor torch) until
``FRAMEWORKS`` is asked for, so that :mod:`harness.adapters.columns` stays torch-free.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

#: The adapter modules, in row order.
ADAPTERS = ("hf_accelerate", "lightning_trainer", "hf_trainer", "deepspeed_engine")


@functools.cache
def _registry() -> dict[str, Any]:
    frameworks = {}
    for module in ADAPTERS:
        framework = importlib.import_module(f"{__name__}.{module}").FRAMEWORK
        frameworks[framework.name] = framework
    return frameworks


def __getattr__(name: str) -> Any:
    """``FRAMEWORKS``: every framework by name, in row order, imported when first asked for."""
    if name == "FRAMEWORKS":
        return _registry()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
