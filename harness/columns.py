"""What a CSV of the harness holds: its columns, each with a unit and a meaning, and the
columns several CSVs share, declared once; ``Table``, one CSV a study writes, between the
columns every study's CSV starts and ends with.

Free of torch, so that the studies' registry, the check, the README tests and the report
read every schema without loading any measuring code. Letters mean one thing everywhere:
**N** is the world size (ranks or devices), **k** the micro-steps of one optimizer step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from harness.verdicts import FIT_VERDICTS, Equivalence, Status


@dataclass(frozen=True)
class Column:
    """One column of a CSV: its name, its unit (or allowed values), its meaning."""

    name: str
    unit: str
    doc: str
    #: A column every judged row of the check has: how the engine's judgement of one step
    #: and point (:class:`harness.check.judge.Judged`) fills it. None: a CSV's own column,
    #: filled by the code that measured it.
    judged: Callable[[Any], Any] | None = field(default=None, compare=False, repr=False)

    def described(self, doc: str, unit: str | None = None) -> Column:
        """The same column (its name, and unit unless given) with a meaning of a CSV's own:
        what ``world_size`` counts in that CSV, say."""
        return replace(self, doc=doc, unit=self.unit if unit is None else unit)


def names(columns: tuple[Column, ...]) -> tuple[str, ...]:
    return tuple(c.name for c in columns)


#: Columns every CSV starts with and ends with, around the study's own.
LEADING_COLUMNS = (
    Column("study", "", "the study's name"),
    Column("case_id", "", "stable id of the case: `study/axis=value/...`; `--resume` and the "
           "report refer to it"),
)
TRAILING_COLUMNS = (
    Column("backend", "`gloo`, `nccl`", "collective backend of the run"),
    Column("device", "`cpu`, `cuda`", "where the case computed"),
    Column("dtype", "`float64`, `float32`", "floating-point type of models, data and gradients"),
    Column("hosts", "hosts", "distinct hostnames among the launch's ranks"),
    Column("nodes", "nodes", "torchrun agents (nodes) in the launch"),
    Column("ranks_per_node", "ranks", "ranks each agent started"),
    Column("launch_world_size", "ranks", "ranks in the whole launch (N)"),
    Column("slurm_job_id", "", "`SLURM_JOB_ID` when run inside Slurm, else empty"),
    Column("torch_version", "", "`torch.__version__`"),
    Column("ran_on", "`rank@host,...`", "the ranks the case ran on, each with its host's name: "
           "its slot's ranks for a case of several, the rank that ran it for one process"),
    Column("status", "", "`ok`, or why the case was not measured (e.g. `skipped: needs 2 CUDA "
           "devices, has 0`)"),
)


@dataclass(frozen=True)
class Table:
    """One CSV a study writes: ``<name>.csv``, its own columns between the leading and the
    trailing ones every CSV has, and what its rows are (for a study that writes several)."""

    name: str
    columns: tuple[Column, ...]
    doc: str = ""

    @property
    def csv(self) -> str:
        return f"{self.name}.csv"

    def schema(self) -> tuple[Column, ...]:
        return (*LEADING_COLUMNS, *self.columns, *TRAILING_COLUMNS)

    def column_names(self) -> tuple[str, ...]:
        """Every column of the CSV, in order."""
        return names(self.schema())


#: The values of a verdict against the big batch, as a fit gives them
#: (:data:`harness.verdicts.FIT_VERDICTS`).
EQUIVALENCES = ", ".join(f"`{value}`" for value in FIT_VERDICTS)

WORLD_SIZE = Column("world_size", "ranks", "N: ranks the global batch is split across")
ACCUM_STEPS = Column("accum_steps", "micro-steps", "k: micro-steps per optimizer step")


# The columns every row the check judges has (``grad-check``'s check.csv, ``--frameworks``'
# and the frameworks study's rows, ``grad-check run``'s script.csv), each filled from the
# engine's judgement. A column added to JUDGED is in every one of them.
#: What every front-end compares at each step: the gradient the optimizer was handed and
#: the update it made (the Setup matrix adds ``buffers`` for models with some).
POINTS = ("grad", "params")
STEP = Column("step", "steps", "optimizer step compared, from 0 (each on its own global batch)",
              judged=lambda j: j.step)
POINT = Column("point", "`grad`, `params`",
               "what is compared: the gradient the optimizer was handed, or the update it made "
               "(the parameters after the step, as updates from where the reference started "
               "it)", judged=lambda j: j.point)
#: A verdict against the single-process big-batch step, and the fit it is read from.
VERDICT = Column("verdict", Equivalence.words(),
                 "against the single-process big-batch step, empty where the row could not be "
                 f"judged: {Equivalence.described()}", judged=lambda j: j.verdict)
SCALE = Column("scale", "ratio",
               "s in `measured ~ s * reference` (least squares over every tensor)",
               judged=lambda j: j.scale)
RESIDUAL = Column("residual", "ratio",
                  "`||measured - s*reference|| / ||measured||`: 0 when a pure scale explains it",
                  judged=lambda j: j.residual)
WORST_TENSORS = Column("worst_tensors", "`name=error;...`",
                       "the three tensors with the largest `||m - s*r|| / ||s*r||`, worst "
                       "first (an error within the row's tolerance written 0)",
                       judged=lambda j: j.worst_tensors)
RANKS_AGREE = Column("ranks_agree", "`True`, `False`, empty",
                     "whether every rank held the same tensors at that point; empty where the "
                     "ranks are not meant to (one process, shards)",
                     judged=lambda j: "" if j.ranks_agree is None else j.ranks_agree)
PRECISION = Column("precision", "`float64`, `float32`, `bfloat16`, `float16`",
                   "the lowest precision the step really ran in (the model's type, the "
                   "autocast type, the type of every loss the user's code returned): the "
                   "row's tolerance is that precision's", judged=lambda j: j.precision_name)
CAUSE = Column("cause", "id",
               "why the row differs, as a stable id: one of the causes declared in "
               "harness/check/causes/ (its `fix` says it in words); empty when it matches or no "
               "cause explains it", judged=lambda j: j.cause)
FIX = Column("fix", "text", "what to change, read from the measurement; empty when it matches",
             judged=lambda j: j.fix)
STATUS = Column("status", Status.words(), Status.described(),
                judged=lambda j: str(j.status))
#: Judged columns whose values a CSV may not describe in its own words: each value's
#: meaning is declared once, in harness/verdicts.py.
DECLARED_ONCE = ("verdict", "status")
ERROR = Column("error", "text", "the exception of a case that failed (`Type: first sentence`), "
               "else empty", judged=lambda j: j.error)
JUDGED: tuple[Column, ...] = (STEP, POINT, VERDICT, SCALE, RESIDUAL, WORST_TENSORS, RANKS_AGREE,
                              PRECISION, CAUSE, FIX, STATUS, ERROR)

#: Rows of a check that may run under autocast (the Setup matrix and the frameworks').
AUTOCAST_RESIDUAL = Column(
    "autocast_residual", "ratio",
    "setups with `Setup.autocast`: the residual of the step as run under autocast (the "
    "autocast precision's rounding, plus any difference of the split). Each such case also "
    "runs without autocast at the run's dtype: where that run differs from the big batch, "
    "the row's verdict, scale, residual and fix are its own (`precision` then says so), since "
    "a low precision's tolerance must not hide a split that full precision shows; empty "
    "without autocast", judged=lambda j: j.autocast_residual_cell)


def judged_columns(**docs: str | tuple[str, str]) -> tuple[Column, ...]:
    """:data:`JUDGED`, with the meanings a CSV gives some of them: ``point="meaning"``, or
    ``point=("meaning", "unit")``."""
    unknown = set(docs) - set(names(JUDGED))
    if unknown:
        raise ValueError(f"no judged column is called {', '.join(sorted(unknown))}")
    redeclared = set(docs) & set(DECLARED_ONCE)
    if redeclared:
        raise ValueError(f"{', '.join(sorted(redeclared))}: each value's meaning is declared "
                         "once, in harness/verdicts.py")
    described = []
    for column in JUDGED:
        doc = docs.get(column.name)
        if isinstance(doc, tuple):
            column = column.described(*doc)
        elif doc is not None:
            column = column.described(doc)
        described.append(column)
    return tuple(described)
