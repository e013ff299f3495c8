"""The accumulation study's recipes: the axes a case varies, and which of their
combinations each strategy, world size and k is measured under.

A :class:`Recipe` is one case (a row): strategy, world size, k, and the recipe's
``zero_grad``, ``loss_scaling``, ``sync``, ``norm``, ``shards`` and ``loss_normalization``
(their meanings: study.py's docstring). :func:`matrix` lists the recipes of one
(strategy, world size, k), by default or with ``--matrix full``; :func:`world_sizes` the
world sizes a strategy is measured at. Which cases exist is apart from how study.py
trains and measures one.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from harness.context import RunContext
from harness.models import NORMS
from harness.strategies import STRATEGIES
from harness.studies.accumulation.schema import default_scaling

#: The strategies this study runs, in row order.
SUPPORTED = ("local", "ddp", "dp-emulated", "dp")
ZERO_GRAD = ("never", "every-micro-step", "every-step")
LOSS_SCALING = ("none", "1/k")
#: Shard layouts: "tokens" belongs to the sequence task, the others to the MLP.
SHARDS = ("even", "uneven", "tokens")
LOSS_NORMALIZATIONS = ("micro-batch-mean", "window-total")


@dataclass(frozen=True)
class Recipe:
    """One case: a strategy, a world size and an accumulation recipe."""

    strategy: str
    world_size: int
    accum_steps: int
    zero_grad: str
    loss_scaling: str
    sync: str
    norm: str
    shards: str
    loss_normalization: str

    @property
    def task_name(self) -> str:
        if self.shards == "tokens":
            return "tokens"
        return "mlp" if self.norm == "none" else f"mlp-{self.norm}"

    @property
    def reference_task_name(self) -> str:
        """SyncBatchNorm over the whole window is BatchNorm over the big batch."""
        return "mlp-batchnorm" if self.norm == "syncbatchnorm" else self.task_name

    @property
    def scale(self) -> float:
        return 1.0 / self.accum_steps if self.loss_scaling == "1/k" else 1.0


def _syncs(strategy: str) -> tuple[str, ...]:
    """DDP can defer its all-reduce; DataParallel reduces in every backward; one process never."""
    return STRATEGIES[strategy].syncs


def _norms(strategy: str) -> tuple[str, ...]:
    """SyncBatchNorm synchronises over a process group: only a collective strategy has one."""
    return NORMS if STRATEGIES[strategy].collective else NORMS[:-1]


def world_sizes(strategy: str, run: RunContext) -> tuple[int, ...]:
    """A strategy that never reduces (one process) has world size 1 only."""
    return (1,) if STRATEGIES[strategy].syncs == ("none",) else run.world_sizes


def _conditions(strategy: str) -> list[tuple[str, str, str]]:
    """(norm, shards, loss_normalization) combinations a strategy is measured under."""
    sample_level = [(norm, shards, normalization) for norm in _norms(strategy)
                    for shards in SHARDS if shards != "tokens"
                    for normalization in LOSS_NORMALIZATIONS]
    tokens = [("none", "tokens", normalization) for normalization in LOSS_NORMALIZATIONS]
    return sample_level + tokens


def matrix(strategy: str, world_size: int, k: int, full: bool) -> list[Recipe]:
    """The recipes measured for one (strategy, world size, k).

    Default: every zero_grad x loss_scaling x sync recipe on the plain setting
    (no norm, even shards, per-micro-batch means), then every setting (norm x
    shards x normalization) under the textbook recipe. Full: every combination.
    """
    def recipe(zero_grad, scaling, sync, norm, shards, normalization):
        return Recipe(strategy, world_size, k, zero_grad, scaling, sync, norm, shards,
                      normalization)

    if full:
        return [recipe(z, s, y, n, sh, ln) for (n, sh, ln) in _conditions(strategy)
                for z, s, y in itertools.product(ZERO_GRAD, LOSS_SCALING, _syncs(strategy))]
    recipes = [recipe(z, s, y, "none", "even", "micro-batch-mean")
               for z, s, y in itertools.product(ZERO_GRAD, LOSS_SCALING, _syncs(strategy))]
    for norm, shards, normalization in _conditions(strategy):
        textbook = recipe("every-step", default_scaling(normalization), _syncs(strategy)[0],
                          norm, shards, normalization)
        if textbook not in recipes:
            recipes.append(textbook)
    return recipes
