"""What a cause is read from: one judged point of a step, as the judge and its front-end
saw it.

Every front-end hands the same :class:`Evidence`: the step, the point, its comparison with
the big batch, the facts of the case (harness/check/fix.py ``Facts``) and, for an update,
the step's gradient's comparison. Each adds what only it measured: a script's run, each
rank's record of the step and the reference's (:class:`ScriptStep`, read through
:class:`RankStep`: the fields of harness/grad_check/script/wire.py ``StepRecord`` a cause
may read); a framework, its recipe and what it was told (:class:`FrameworkStep`); the Setup
matrix, its custom micro-step (:class:`MatrixStep`). Plain data, free of the front-ends:
the engine imports none of them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from harness.check.compare import Comparison
from harness.check.fix import Facts


class RankStep(Protocol):
    """What a cause may read of one rank's record of a step: fields of
    harness/grad_check/script/wire.py ``StepRecord``, by the same names and types
    (tests/test_causes.py holds them to it)."""

    samples: list[list[Any]]
    forwards: int
    clips: list[str]
    clip_calls: int
    indices: list[int]
    before_norm: float | None
    received_norm: float | None
    non_finite: dict[str, list[str]]


@dataclass(frozen=True)
class RankDisagreement:
    """Ranks whose tensors differ from rank 0's at one point, and which tensors."""

    ranks: tuple[int, ...]
    tensors: tuple[str, ...]


def clip_factor(record: RankStep) -> float:
    """``||received|| / ||before the clip||`` of a rank's step (1 where nothing clipped)."""
    before, received = record.before_norm, record.received_norm
    if before is None or received is None:
        return 1.0
    return received / before if before > 0 else float("nan")


@dataclass(frozen=True)
class ScriptStep:
    """One optimizer step of a split's run of a script, beside the reference's."""

    world_size: int
    accum_steps: int
    global_batch: int
    #: Each rank's record of the step, in rank order; the reference's first run's.
    records: tuple[RankStep, ...]
    reference: tuple[RankStep, ...]
    #: The model's dropout layers that train, and the frameworks the script imported.
    dropout: tuple[str, ...] = ()
    frameworks: frozenset[str] = frozenset()
    #: The ranks whose tensors at this point differ from rank 0's (None: all agree, or
    #: each rank held a shard of its own).
    disagreement: RankDisagreement | None = None

    @property
    def samples_by_rank(self) -> list[Sequence[Any]]:
        return [record.samples for record in self.records]

    @property
    def samples(self) -> list[Any]:
        """The samples the step fed, over every rank and micro-step."""
        return [sample for record in self.records for sample in record.samples]

    @property
    def reference_samples(self) -> list[Any]:
        return [sample for record in self.reference for sample in record.samples]

    @property
    def indices(self) -> list[int]:
        """The dataset indices the step's loaders handed, over every rank."""
        return [index for record in self.records for index in record.indices]

    @property
    def reference_indices(self) -> list[int]:
        return [index for record in self.reference for index in record.indices]

    @property
    def forwards(self) -> list[int]:
        """Each rank's training forwards in the step's window (its micro-steps)."""
        return [record.forwards for record in self.records]


@dataclass(frozen=True)
class FrameworkStep:
    """A framework's step (harness/adapters/): its comparison with the big batch under its
    recipe, and what it was told and did."""

    recipe: Comparison
    name: str
    #: The setting that clips by default, and how to switch it off.
    clip_setting: str = ""
    clip_off: str = ""
    #: How it steps a scheduler, said where the learning rates differ.
    schedules: str = ""
    #: The norm it clipped the window's gradient to (None: it does not clip).
    clip: float | None = None
    #: ``num_items_in_batch`` it passed each micro-step of step 0, and whether the model's
    #: loss ignored it (None: not probed).
    counts_passed: tuple[int, ...] | None = None
    count_ignored: bool | None = None
    #: The window's labels other than ``ignored_label``: all, and those after the shift.
    label_counts: tuple[int, int] = (0, 0)
    ignored_label: int = -100
    #: The learning rates its optimizer used, and the big batch's step's.
    learning_rates: tuple[tuple[float, ...], tuple[float, ...]] = ((), ())
    #: A fresh model of the setup (its class and ``loss_type`` name a count's fix).
    model: Callable[[], object] | None = None


@dataclass(frozen=True)
class MatrixStep:
    """The Setup matrix's case: whether the setup runs a micro-step of its own, and what
    that micro-step edited that the forward saw (a clip, a scheduler, a GradScaler)."""

    custom_micro_step: bool = False
    edits: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Evidence:
    """One judged point of a step: what every cause is read from."""

    step: int
    point: str
    comparison: Comparison
    facts: Facts
    #: The precision the row is judged at.
    precision: torch.dtype = torch.float64
    #: The step's gradient's comparison, and its row's verdict and status as judged, where
    #: this point is its update.
    gradient: Comparison | None = None
    gradient_verdict: str = ""
    gradient_status: str = ""
    script: ScriptStep | None = None
    framework: FrameworkStep | None = None
    matrix: MatrixStep | None = None

    @property
    def explained(self) -> Comparison:
        """What the check's own causes explain: the row's comparison, or, for a framework,
        its comparison under the framework's recipe (a clip it applies taken as meant)."""
        return self.framework.recipe if self.framework is not None else self.comparison
