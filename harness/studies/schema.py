"""What a study's CSV holds: its columns, each with a unit and a meaning.

Free of torch, so that the registry, the README check and the report can read
every study's schema (``harness/studies/<name>/schema.py``) without loading a
study's measuring code.
"""

from __future__ import annotations

from dataclasses import dataclass

from harness.columns import ACCUM_STEPS, EQUIVALENCES, Column, names
from harness.columns import WORLD_SIZE as _ANY_WORLD_SIZE

__all__ = ["ACCUM_STEPS", "EMULATED", "EQUIVALENCES", "LEADING_COLUMNS", "STRATEGY",
           "STRATEGY_OR_LOCAL", "TRAILING_COLUMNS", "WORLD_SIZE", "Column", "Table", "names"]

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

#: Columns several studies share, documented once.
STRATEGY = Column("strategy", "`ddp`, `fsdp`, `dp-emulated`, `dp`",
                  "how the model was wrapped: DistributedDataParallel, FSDP2's `fully_shard`, "
                  "a CPU emulation of DataParallel, the real DataParallel (CUDA)")
#: The same for a study whose cases include the one-process reference.
STRATEGY_OR_LOCAL = Column("strategy", "`local`, " + STRATEGY.unit,
                           "one process with nothing to reduce, or " + STRATEGY.doc)
EMULATED = Column("emulated", "bool", "true for the emulation")
#: N of a study whose strategies include DataParallel, which counts devices, not ranks.
WORLD_SIZE = _ANY_WORLD_SIZE.described(
    "N: ranks (DDP, FSDP) or devices asked for (DataParallel)", unit="devices")


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
