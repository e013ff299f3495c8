"""What a CSV of the harness holds: its columns, each with a unit and a meaning, and the
columns several CSVs share, declared once; ``Table``, one CSV a study writes, between the
columns every study's CSV starts and ends with.

Free of torch, so that the studies' registry, the check, the README tests and the report
read every schema without loading any measuring code. Letters mean one thing everywhere:
**N** is the world size (ranks or devices), **k** the micro-steps of one optimizer step.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from harness.verdicts import Equivalence


@dataclass(frozen=True)
class Column:
    """One column of a CSV: its name, its unit (or allowed values), its meaning."""

    name: str
    unit: str
    doc: str

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


#: The values of a verdict against the big batch (:class:`harness.verdicts.Equivalence`).
EQUIVALENCES = ", ".join(f"`{value}`" for value in Equivalence)

WORLD_SIZE = Column("world_size", "ranks", "N: ranks the global batch is split across")
ACCUM_STEPS = Column("accum_steps", "micro-steps", "k: micro-steps per optimizer step")

#: A verdict against the single-process big-batch step, and the fit it is read from.
VERDICT = Column("verdict", EQUIVALENCES,
                 "against the single-process big-batch step: the same, a pure multiple s of "
                 "it, or no multiple")
SCALE = Column("scale", "ratio",
               "s in `measured ~ s * reference` (least squares over every tensor)")
RESIDUAL = Column("residual", "ratio",
                  "`||measured - s*reference|| / ||measured||`: 0 when a pure scale explains it")
WORST_TENSORS = Column("worst_tensors", "`name=error;...`",
                       "the three tensors with the largest `||m - s*r|| / ||s*r||`, worst "
                       "first (an error within the row's tolerance written 0)")
PRECISION = Column("precision", "`float64`, `float32`, `bfloat16`, `float16`",
                   "the lowest precision the step really ran in (the model's type, the "
                   "autocast type, the type of every loss the user's code returned): the "
                   "row's tolerance is that precision's")
AUTOCAST_RESIDUAL = Column(
    "autocast_residual", "ratio",
    "setups with `Setup.autocast`: the residual of the step as run under autocast (the "
    "autocast precision's rounding, plus any difference of the split). Each such case also "
    "runs without autocast at the run's dtype: where that run differs from the big batch, "
    "the row's verdict, scale, residual and fix are its own (`precision` then says so), since "
    "a low precision's tolerance must not hide a split that full precision shows; empty "
    "without autocast")
FIX = Column("fix", "text", "what to change, read from the measurement; empty when it matches")
ERROR = Column("error", "text", "the exception of a case that failed (`Type: first sentence`), "
               "else empty")
