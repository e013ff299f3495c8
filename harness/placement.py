"""Where this process runs: its rank in the launch, its device, its backend.

torchrun describes the launch in environment variables (RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, ...). Everything the harness needs to know about
the launch is read here, once, so that bad combinations (nccl without GPUs, more
ranks than GPUs for nccl) are refused before any process group exists.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING

from harness.errors import UsageError

if TYPE_CHECKING:  # torch is imported where a placement is chosen: parsing flags needs none
    import torch

BACKENDS = ("auto", "gloo", "nccl")
DEVICES = ("auto", "cpu", "cuda")

_TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


@dataclass(frozen=True)
class Launch:
    """The launch as torchrun (or Slurm through torchrun) set it up."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    hostname: str
    #: SLURM_JOB_ID when the launch runs inside a Slurm allocation, else "".
    slurm_job_id: str

    #: torchrun agents (nodes) in the launch: GROUP_WORLD_SIZE, exact even when
    #: nodes run different numbers of ranks.
    nodes: int = 1

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    @classmethod
    def planned(cls, nproc: int) -> Launch:
        """Rank 0's view of a one-node launch of ``nproc`` ranks, before it starts."""
        return cls(rank=0, world_size=nproc, local_rank=0, local_world_size=nproc,
                   hostname=socket.gethostname(), slurm_job_id=os.environ.get("SLURM_JOB_ID", ""))

    @classmethod
    def from_environment(cls, env: dict[str, str] | None = None) -> Launch:
        env = dict(os.environ if env is None else env)
        missing = [name for name in _TORCHRUN_VARIABLES if name not in env]
        if missing:
            raise UsageError(
                "scripts/study.py needs --nproc N or torchrun to start its ranks (missing "
                f"{', '.join(missing)}); run e.g. 'python scripts/study.py --nproc 4' or "
                "'torchrun --standalone --nproc_per_node=4 scripts/study.py'"
            )
        return cls(
            rank=int(env["RANK"]),
            world_size=int(env["WORLD_SIZE"]),
            local_rank=int(env["LOCAL_RANK"]),
            local_world_size=int(env["LOCAL_WORLD_SIZE"]),
            hostname=socket.gethostname(),
            slurm_job_id=env.get("SLURM_JOB_ID", ""),
            nodes=int(env.get("GROUP_WORLD_SIZE", 1)),
        )


def under_torchrun(env: dict[str, str] | None = None) -> bool:
    env = os.environ if env is None else env
    return all(name in env for name in _TORCHRUN_VARIABLES)


def leader_from_environment(env: dict[str, str] | None = None) -> bool:
    """True on the process that should speak: rank 0, or any process outside torchrun."""
    env = os.environ if env is None else env
    return env.get("RANK", "0") == "0"


@dataclass(frozen=True)
class Placement:
    """The backend and the device this rank computes on."""

    backend: str
    device: torch.device

    @property
    def description(self) -> str:
        return f"backend={self.backend} device={self.device}"


def choose_placement(backend: str, device: str, launch: Launch) -> Placement:
    """Pick backend and device, or refuse a combination that cannot work.

    auto: nccl when every rank on this node has a GPU of its own (nccl refuses
    two ranks on one GPU), else gloo -- on CUDA tensors when GPUs exist but are
    shared by several ranks, on CPU tensors when there are none.
    """
    if backend not in BACKENDS:
        raise UsageError(f"--backend {backend!r} is unknown; allowed: {', '.join(BACKENDS)}")
    if device not in DEVICES:
        raise UsageError(f"--device {device!r} is unknown; allowed: {', '.join(DEVICES)}")
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device == "auto":
        device = "cuda" if gpus > 0 else "cpu"
    if device == "cuda" and gpus == 0:
        raise UsageError("--device cuda needs a CUDA device, and this machine has none; "
                         "allowed here: cpu")
    if backend == "auto":
        backend = "nccl" if device == "cuda" and gpus >= launch.local_world_size else "gloo"
    if backend == "nccl":
        if device != "cuda":
            raise UsageError("--backend nccl needs CUDA devices (nccl has no CPU tensors); "
                             "use --backend gloo on this machine")
        if gpus < launch.local_world_size:
            raise UsageError(f"--backend nccl needs one GPU per rank: {launch.local_world_size} "
                             f"ranks on this node but {gpus} GPU(s); use --backend gloo "
                             "or fewer ranks per node")
    if device == "cuda":
        return Placement(backend, torch.device("cuda", launch.local_rank % gpus))
    return Placement(backend, torch.device("cpu"))
