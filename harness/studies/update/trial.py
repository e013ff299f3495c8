"""One case of an update experiment as its ``measure`` gets it, and the big-batch runs the
cases of one process share.

Free of torch (tensors are only held here), so that an experiment's spec can name it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from harness.context import RunContext
    from harness.studies.base import Case
    from harness.studies.update.options import UpdateOptions


class ReferenceRuns:
    """Big-batch runs, each computed once per process and shared by every case that compares
    with it: DDP, FSDP and DataParallel at the same N and k train on the same windows."""

    def __init__(self) -> None:
        self._runs: dict[tuple, list[torch.Tensor]] = {}

    def get(self, key: tuple, compute: Callable[[], list[torch.Tensor]]) -> list[torch.Tensor]:
        if key not in self._runs:
            self._runs[key] = compute()
        return self._runs[key]


@dataclass(frozen=True)
class Trial:
    """One case of an experiment, as its measuring code gets it."""

    case: Case
    run: RunContext
    options: UpdateOptions
    #: Big-batch runs computed by this process, shared by the cases that compare with them.
    references: ReferenceRuns

    @property
    def strategy(self) -> str:
        return self.case["strategy"]

    @property
    def world_size(self) -> int:
        return self.case["world_size"]

    @property
    def accum_steps(self) -> int:
        return self.case["accum_steps"]

    @property
    def full(self) -> bool:
        return self.run.config.matrix == "full"

    @property
    def reports(self) -> bool:
        """Whether this rank returns the case's rows (rank 0 of its group)."""
        return self.run.reports(self.case)
