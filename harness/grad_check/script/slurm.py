"""``grad-check run`` inside a Slurm allocation (scripts/slurm/check-run.sbatch): each rank
of a split started as a job step of its own, ``srun`` on a node of the job.

The check itself runs where the batch script runs (the job's first node), and hosts the
ranks' rendezvous store there, as it does on one machine (harness/grad_check/script/
processes.py); the ranks reach it at :data:`HOST_VARIABLE`. A split of N ranks takes
min(N, nodes) nodes, in blocks of ceil(N / nodes) consecutive ranks per node (rank r on
node r // per-node, its LOCAL_RANK r % per-node: one GPU each where the nodes have
them), so the 1x1 reference runs on the first node alone. Every step may share its
node's CPUs with the others (``--overlap``): more ranks than the allocation's CPUs wait
for a core, as on one machine. The captures must lie on a filesystem every node sees
(the batch script puts them under ``--out``).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from harness.grad_check.script.processes import Process, start_subprocess

#: The job's nodes, comma-separated (``scontrol show hostnames``), set by the batch script:
#: where it is set, ranks start through srun.
NODES_VARIABLE = "GRAD_CHECK_SRUN_NODES"
#: The address the ranks on any node reach the check's store at (the first node's name).
HOST_VARIABLE = "GRAD_CHECK_SRUN_HOST"


@dataclass(frozen=True)
class NodePlacement:
    node: int
    local_rank: int
    local_world_size: int
    nodes: int


def placement(rank: int, world_size: int, nodes: int) -> NodePlacement:
    """Where rank ``rank`` of ``world_size`` runs among ``nodes`` nodes: blocks of
    consecutive ranks, as many per node as the fewest nodes that hold them evenly."""
    per_node = math.ceil(world_size / min(world_size, nodes))
    used = math.ceil(world_size / per_node)
    node = rank // per_node
    return NodePlacement(node, rank % per_node, min(per_node, world_size - node * per_node), used)


@dataclass(frozen=True)
class SrunStarter:
    """Starts one rank as ``srun`` on its node (harness/grad_check/script/processes.py's
    ``Starter``): the rank's variables placed on that node, its output in ``log``."""

    nodes: tuple[str, ...]
    host: str
    srun: str = "srun"

    def __call__(self, command: list[str], environment: dict[str, str], log: Path) -> Process:
        world_size = int(environment.get("WORLD_SIZE", "1"))
        rank = int(environment.get("RANK", "0"))
        where = placement(rank, world_size, len(self.nodes))
        variables = {name: value for name, value in environment.items()
                     if name not in (NODES_VARIABLE, HOST_VARIABLE)}
        if world_size > 1:
            variables.update({"MASTER_ADDR": self.host, "LOCAL_RANK": str(where.local_rank),
                              "GROUP_RANK": str(where.node),
                              "LOCAL_WORLD_SIZE": str(where.local_world_size),
                              "GROUP_WORLD_SIZE": str(where.nodes)})
        step = [self.srun, "--nodes=1", "--ntasks=1", f"--nodelist={self.nodes[where.node]}",
                "--overlap", "--export=ALL", "--quiet", *command]
        return start_subprocess(step, variables, log)


def srun_starter(environment: Mapping[str, str] | None = None) -> SrunStarter | None:
    """The starter the batch script asks for (None: outside it, ranks start here)."""
    environment = os.environ if environment is None else environment
    nodes = tuple(node for node in environment.get(NODES_VARIABLE, "").split(",") if node)
    if not nodes:
        return None
    return SrunStarter(nodes, environment.get(HOST_VARIABLE) or nodes[0])


def nodes() -> int:
    """Nodes the ranks may run on: the job's, under the batch script; else this one."""
    starter = srun_starter()
    return len(starter.nodes) if starter is not None else 1
