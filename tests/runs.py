"""A RunContext as the runner builds it, for calling a study's ``run_case`` directly."""

from __future__ import annotations

import torch
import torch.distributed as dist

from harness.config import RunConfig
from harness.context import RunContext
from harness.placement import Launch, Placement
from harness.studies import STUDIES


def make_run(study: str, world_size: int = 1, rank: int = 0,
             dtype: str = "float64") -> RunContext:
    """The context of a one-study run on ``world_size`` ranks (the default group when > 1)."""
    config = RunConfig(studies=(study,), known_studies=tuple(STUDIES), dtype=dtype)
    launch = Launch(rank, world_size, rank, world_size, "test-host", "")
    groups = {(0, world_size): dist.group.WORLD} if world_size > 1 else {}
    return RunContext(config, launch, Placement("gloo", torch.device("cpu")),
                      tuple(range(1, world_size + 1)), groups)
