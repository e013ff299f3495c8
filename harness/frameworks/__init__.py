"""Real training frameworks, each an adapter that trains a user's :class:`Setup` its own way.

Both the frameworks study (harness/studies/frameworks/) and ``grad-check --frameworks``
(harness/check/frameworks.py) train through these adapters and measure with
:mod:`harness.frameworks.measure`. An adapter is one module exporting a
:class:`~harness.frameworks.registry.Framework` (its package, settings and ``train``);
a new one is that module plus one line in :data:`FRAMEWORKS`. The adapters import their
framework only inside ``train``, so this registry imports none of them.
"""

from harness.frameworks import deepspeed_engine, hf_accelerate, hf_trainer, lightning_trainer
from harness.frameworks.registry import Framework

#: Every framework, in row order.
FRAMEWORKS: dict[str, Framework] = {
    framework.name: framework
    for framework in (hf_accelerate.FRAMEWORK, lightning_trainer.FRAMEWORK,
                      hf_trainer.FRAMEWORK, deepspeed_engine.FRAMEWORK)}
