"""Names for what an optimizer holds: its parameters by the model they belong to, and the
optimizer itself, the same at every split however the model, or any part of it, is
wrapped.

A wrapper holds the model it wraps under an attribute of its own (DDP's ``module``), which
torch puts in every name under it; the wrapper is there at N > 1 and not at N = 1, or
around the model at one split and around a part of it at another. The names here are
found by walking the modules, leaving out an attribute only where the module holding it
is an instance of a wrapper type that holds its model there (``WRAPPERS``): a user's own
submodule called ``module`` keeps its name.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from torch import nn

from harness.check.fix import batchnorm_tensors


@dataclass(frozen=True)
class Wrapper:
    """A module type that holds the model it wraps under attributes of its own."""

    #: The class as ``module.QualifiedName``, looked for among a module's classes (its
    #: subclasses are wrappers too): the capture runs in the user's process and must not
    #: import DeepSpeed or Lightning to ask ``isinstance``.
    type_path: str
    #: The attributes it holds the model under, none of them a segment of the model's names.
    attributes: tuple[str, ...]


WRAPPERS = (
    Wrapper("torch.nn.parallel.distributed.DistributedDataParallel", ("module",)),
    Wrapper("torch.nn.parallel.data_parallel.DataParallel", ("module",)),
    Wrapper("torch.distributed.fsdp.fully_sharded_data_parallel.FullyShardedDataParallel",
            ("_fsdp_wrapped_module",)),
    Wrapper("torch._dynamo.eval_frame.OptimizedModule", ("_orig_mod",)),
    Wrapper("torch.distributed.algorithms._checkpoint.checkpoint_wrapper.ActivationWrapper",
            ("_checkpoint_wrapped_module",)),
    # Fabric holds the model twice: _forward_module (DDP around it at N > 1) and
    # _original_module (the model itself).
    Wrapper("lightning.fabric.wrappers._FabricModule", ("_forward_module", "_original_module")),
    Wrapper("lightning_fabric.wrappers._FabricModule", ("_forward_module", "_original_module")),
    Wrapper("deepspeed.runtime.engine.DeepSpeedEngine", ("module",)),
)


def wrapped_attributes(module: nn.Module) -> tuple[str, ...]:
    """The attributes ``module`` holds a wrapped model under: none unless it is a wrapper."""
    classes = {f"{cls.__module__}.{cls.__qualname__}" for cls in type(module).__mro__}
    return next((wrapper.attributes for wrapper in WRAPPERS if wrapper.type_path in classes),
                ())


def joined(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def named_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """Every module of ``model`` once, as ``model.named_modules()`` lists them, but named
    without the wrappers' own attributes: a wrapped model has its wrapper's name."""
    yield from _walk(model, "", set())


def _walk(module: nn.Module, prefix: str, seen: set[int]) -> Iterator[tuple[str, nn.Module]]:
    if id(module) in seen:  # a module held twice is named where it is met first, as torch does
        return
    seen.add(id(module))
    yield prefix, module
    own = wrapped_attributes(module)
    for attribute, child in module._modules.items():
        if child is not None:
            yield from _walk(child, prefix if attribute in own else joined(prefix, attribute),
                             seen)


def named_parameters(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """Every parameter of ``model`` once, named as ``named_modules`` names its module."""
    seen: set[int] = set()
    for prefix, module in named_modules(model):
        for name, parameter in module._parameters.items():
            if parameter is not None and id(parameter) not in seen:
                seen.add(id(parameter))
                yield joined(prefix, name), parameter


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
    by_id = ({id(p): name for name, p in named_parameters(model)}
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


def model_facts(model: nn.Module) -> dict[str, set[str]]:
    """What a fix is read from besides the tensors (harness/check/fix.py: Facts), named as
    the optimizer's tensors are: the tensors of BatchNorm layers, the dropout layers that
    train."""
    modules = list(named_modules(model))
    return {"batchnorm": batchnorm_tensors(model, modules),
            "dropout": {name for name, module in modules
                        if isinstance(module, nn.modules.dropout._DropoutNd)
                        and module.p > 0 and module.training}}
