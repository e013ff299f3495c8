"""Names for what an optimizer holds: its parameters by the model they belong to, and the
optimizer itself, the same at every split however the model is wrapped."""

from __future__ import annotations

import gc
import os
from collections.abc import Sequence

from torch import nn

#: Module attributes that wrappers put between a model and its parameters' names.
WRAPPER_SEGMENTS = ("_orig_mod.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")


def stripped(name: str) -> str:
    for segment in WRAPPER_SEGMENTS:
        name = name.replace(segment, "")
    return name


def owner(parameters: list[nn.Parameter]) -> nn.Module | None:
    """The model the optimizer's parameters belong to, the same however it is wrapped: of
    the live modules that hold all of them, the outermost, then, while it wraps a single
    child that holds them all too (DDP's ``module``, torch.compile's ``_orig_mod``, a
    framework's wrapper, a LightningModule around its one network), that child. Where no
    module holds them all, the one that holds the most. Found once, among every module
    alive: the optimizer knows its tensors, not their module."""
    wanted = {id(p) for p in parameters}
    parents: dict[int, list[nn.Module]] = {}
    found: list[nn.Module] = []
    # type(), not isinstance(): a deprecated object of torch answers isinstance with a warning.
    for module in (o for o in gc.get_objects() if issubclass(type(o), nn.Module)):
        for child in module._modules.values():
            if child is not None:
                parents.setdefault(id(child), []).append(module)
        if any(p is not None and id(p) in wanted for p in module._parameters.values()):
            found.append(module)
    held: dict[int, int] = {}  # every holder and its ancestors: how many they hold
    by_id: dict[int, nn.Module] = {}
    while found:
        module = found.pop()
        if id(module) not in held:
            held[id(module)] = len(wanted & {id(p) for p in module.parameters()})
            by_id[id(module)] = module
            found += parents.get(id(module), [])
    if not held:
        return None
    whole = {key for key, count in held.items() if count == len(wanted)}
    if not whole:
        return by_id[max(held, key=lambda key: (held[key], type(by_id[key]).__name__))]
    outermost = [by_id[key] for key in whole
                 if not any(id(parent) in whole for parent in parents.get(key, []))]
    models = {id(model): model for model in (unwrapped(m, whole) for m in outermost)}
    return min(models.values(), key=lambda model: (sum(1 for _ in model.parameters()),
                                                   type(model).__name__))


def unwrapped(module: nn.Module, whole: set[int]) -> nn.Module:
    """``module``'s wrapped model, for as long as it wraps one that holds them all: its single
    child, or where every child holds them all and each wraps the next (Lightning Fabric's
    ``_forward_module``, DDP around the model, beside ``_original_module``, the model
    itself, at N > 1; the model under both names alone), the innermost of them."""
    while True:
        children = list({id(child): child for child in module._modules.values()
                         if child is not None}.values())
        if not children or not all(id(child) in whole for child in children):
            return module
        inner = [child for child in children
                 if all(any(m is child for m in other.modules()) for other in children)]
        if len(inner) != 1:
            return module
        module = inner[0]


def parameter_names(parameters: Sequence[nn.Parameter], model: nn.Module | None,
                    groups: Sequence[int]) -> list[str]:
    """Each parameter's name in ``model`` (``param_groups.G.I`` for one it does not hold;
    ``groups``: each parameter's group)."""
    by_id = ({id(p): stripped(name) for name, p in model.named_parameters()}
             if model is not None else {})
    names, index = [], {}
    for parameter, group in zip(parameters, groups, strict=True):
        index[group] = index.get(group, -1) + 1
        names.append(by_id.get(id(parameter), f"param_groups.{group}.{index[group]}"))
    return names


def optimizer_label(kind: str, names: Sequence[str], others: Sequence[Sequence[str]]) -> str:
    """How rows name an optimizer: its type, and where the script steps several, the
    part of the model its parameters share (``AdamW(head)``)."""
    if not others:
        return kind
    prefix = os.path.commonprefix([name.split(".") for name in names])
    return f"{kind}({'.'.join(prefix) or names[0]})"
