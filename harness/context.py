"""Everything a study needs to know about the run it is part of."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from harness.config import RunConfig
from harness.placement import Launch, Placement
from harness.tolerances import relative_tolerance

#: Columns every CSV row carries, describing where and how it was measured.
CONTEXT_COLUMNS = (
    "backend", "device", "dtype", "hosts", "nodes", "ranks_per_node", "launch_world_size",
    "slurm_job_id", "torch_version", "ran_on",
)


@dataclass
class RunContext:
    config: RunConfig
    launch: Launch
    placement: Placement
    #: World sizes measured in this run (each <= launch.world_size).
    world_sizes: tuple[int, ...]
    #: (first rank, k) -> the process group of ranks first..first+k-1: every slot a
    #: collective case may run on (harness/schedule.py).
    groups: dict[tuple[int, int], dist.ProcessGroup] = field(default_factory=dict)
    #: Distinct hostnames among the launch's ranks.
    hosts: int = 1
    #: Each rank's hostname, in rank order.
    hostnames: tuple[str, ...] = ()
    #: First rank of the slot the current collective case runs on (the runner sets it).
    first_rank: int = 0

    @property
    def rank(self) -> int:
        return self.launch.rank

    @property
    def dtype(self) -> torch.dtype:
        return self.config.torch_dtype

    @property
    def device(self) -> torch.device:
        return self.placement.device

    @property
    def rtol(self) -> float:
        return relative_tolerance(self.dtype)

    @property
    def seed(self) -> int:
        return self.config.seed

    def ran_on(self, case) -> str:
        """Where ``case`` ran, ``rank@host`` for each of its ranks: its slot's, for a
        collective case; the rank that ran it, for one process."""
        ranks = (range(self.first_rank, self.first_rank + case.participants)
                 if case.collective else (self.rank,))
        names = self.hostnames or (self.launch.hostname,) * self.launch.world_size
        return ",".join(f"{rank}@{names[rank]}" for rank in ranks)

    def reports(self, case) -> bool:
        """Whether this rank returns the rows of ``case``: the rank running a
        single-process case, or the first rank of a collective one's slot."""
        return not case.collective or self.rank == self.first_rank

    def group(self, world_size: int) -> dist.ProcessGroup:
        """The group of the current case's slot: ``world_size`` ranks from its first."""
        return self.groups[(self.first_rank, world_size)]

    def strategies(self, supported: tuple[str, ...]) -> list[str]:
        """The strategies asked for on the command line that a study supports, in its order."""
        return [s for s in supported if s in self.config.strategies]

    def context_columns(self, device: str | None = None) -> dict[str, object]:
        return {
            "backend": self.placement.backend,
            "device": device or self.placement.device.type,
            "dtype": self.config.dtype,
            "hosts": self.hosts,
            "nodes": self.launch.nodes,
            "ranks_per_node": self.launch.local_world_size,
            "launch_world_size": self.launch.world_size,
            "slurm_job_id": self.launch.slurm_job_id,
            "torch_version": torch.__version__,
        }
