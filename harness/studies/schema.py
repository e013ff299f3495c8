"""What a study's CSV holds: its columns, each with a unit and a meaning.

Free of torch, so that the registry, the README check and the report can read
every study's schema (``harness/studies/<name>/schema.py``) without loading a
study's measuring code.
"""

from __future__ import annotations

from dataclasses import dataclass

from harness.verdicts import Equivalence


@dataclass(frozen=True)
class Column:
    """One column of a study's CSV: its name, its unit (or allowed values), its meaning."""

    name: str
    unit: str
    doc: str


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
WORLD_SIZE = Column("world_size", "devices",
                    "k: ranks (DDP, FSDP) or devices asked for (DataParallel)")
#: k where N names the ranks.
ACCUM_STEPS = Column("accum_steps", "micro-steps", "k: micro-steps per optimizer step")
#: The values of a verdict against the big batch (:class:`harness.verdicts.Equivalence`).
EQUIVALENCES = ", ".join(f"`{value}`" for value in Equivalence)


def names(columns: tuple[Column, ...]) -> tuple[str, ...]:
    return tuple(c.name for c in columns)
