"""Finding the user's ``make_setup`` and refusing what cannot be checked fairly.

Everything here runs before any rank starts (``--nproc``) and again in every rank,
so bad input is one line and exit code 2 whichever way the check was launched.
"""

from __future__ import annotations

import copy
import importlib
import sys
import traceback
from pathlib import Path
from typing import Any

import torch
from torch import nn

from harness.check import batches
from harness.check.setup import Setup
from harness.errors import UsageError

#: Modules whose training-mode forward draws random numbers. A big batch and its pieces
#: draw different masks whatever the seed, so no comparison of them can be fair: refused.
RANDOM_MODULES = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout,
                  nn.FeatureAlphaDropout)


def _import(module_name: str, target: str) -> Any:
    # The working directory first, as `python -m` would: users name their own modules.
    cwd = str(Path.cwd())
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    try:
        return importlib.import_module(module_name)
    except Exception as error:  # noqa: BLE001 -- any import failure is the user's bad input
        last = traceback.extract_tb(error.__traceback__)[-1] if error.__traceback__ else None
        where = f" ({Path(last.filename).name}:{last.lineno})" if last else ""
        raise UsageError(f"{target}: module {module_name!r} does not import: "
                         f"{type(error).__name__}: {error}{where}; allowed: a module importable "
                         "from the current folder or the Python path") from None


def load_setup(target: str) -> Setup:
    """Call ``module:factory`` and return its Setup, named after the factory if unnamed."""
    module_name, _, factory_name = target.partition(":")
    if not module_name or not factory_name:
        raise UsageError(f"{target!r} is not module.path:factory; e.g. examples.mlp:make_setup")
    module = _import(module_name, target)
    factory = getattr(module, factory_name, None)
    if factory is None:
        raise UsageError(f"{target}: module {module_name!r} has no {factory_name!r}; allowed: "
                         "a function in it that returns a harness.check.Setup")
    if not callable(factory):
        raise UsageError(f"{target}: {factory_name!r} is a {type(factory).__name__}, not a "
                         "function; allowed: a function that returns a harness.check.Setup")
    try:
        setup = factory()
    except Exception as error:  # noqa: BLE001 -- the user's factory failing is bad input
        raise UsageError(f"{target}: calling {factory_name}() failed: "
                         f"{type(error).__name__}: {error}") from None
    if not isinstance(setup, Setup):
        raise UsageError(f"{target}: {factory_name}() returned a {type(setup).__name__}, not "
                         "a harness.check.Setup; allowed: Setup(make_model=..., batch=..., "
                         "loss=...)")
    if not setup.name:
        from dataclasses import replace

        setup = replace(setup, name=factory_name)
    return setup


def check_model(model: Any, target: str) -> None:
    """A module, on the CPU or a CUDA device, with no training-mode randomness."""
    if not isinstance(model, nn.Module):
        raise UsageError(f"{target}: make_model() returned a {type(model).__name__}; allowed: "
                         "a torch.nn.Module")
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if tensor.device.type not in ("cpu", "cuda"):
            raise UsageError(f"{target}: make_model() put {name!r} on {tensor.device}; allowed: "
                             "the CPU or a CUDA device (each rank moves its copy to its own "
                             "device)")
    for name, module in model.named_modules():
        if isinstance(module, RANDOM_MODULES) and module.p > 0:
            raise UsageError(
                f"{target}: module {name or 'model'!r} is {type(module).__name__}(p="
                f"{module.p}), random in training mode: a big batch and its pieces draw "
                "different masks, so no comparison is fair; allowed: models without "
                "train-mode randomness (set p=0, or build the model without dropout)")
    if not any(p.requires_grad for p in model.parameters()):
        raise UsageError(f"{target}: make_model() has no trainable parameter; allowed: a "
                         "model with parameters that require gradients")


def check_batches(setup: Setup, target: str, splits: list[tuple[int, int]],
                  drop_last: bool) -> None:
    """Every global batch holds tensors that split into every N x k of the matrix."""
    for step in range(setup.steps):
        where = f"{target}: batch({step})"
        try:
            batch = setup.batch(step)
        except Exception as error:  # noqa: BLE001
            raise UsageError(f"{where} failed: {type(error).__name__}: {error}") from None
        samples = batches.sample_count(batch, where)
        for world_size, accum_steps in splits:
            batches.pieces_needed(samples, world_size, accum_steps, drop_last, where)


def validated_setup(target: str, splits: list[tuple[int, int]], drop_last: bool) -> Setup:
    """The Setup behind ``target``, with its batches checked (each model it builds is
    checked as it is built: :func:`prepared_model`)."""
    setup = load_setup(target)
    check_batches(setup, target, splits, drop_last)
    return setup


def prepared_model(setup: Setup, dtype: torch.dtype, device: torch.device,
                   target: str = "make_model") -> nn.Module:
    """A fresh, checked model in the run's dtype (floating tensors only) on its device."""
    model = setup.make_model()
    check_model(model, target)
    return model.to(device=device, dtype=dtype)


def copy_of(template: nn.Module, setup: Setup, dtype: torch.dtype,
            device: torch.device) -> nn.Module:
    """A model at ``template``'s state, without building and initialising one more (a
    100M-parameter ``make_model`` spends seconds drawing weights it would overwrite).
    A model that cannot be deep-copied is built anew and loaded with the template's state."""
    try:
        return copy.deepcopy(template)
    except Exception:  # noqa: BLE001 -- any module deepcopy refuses: the slower way
        model = setup.make_model().to(device=device, dtype=dtype)
        model.load_state_dict(template.state_dict())
        return model
