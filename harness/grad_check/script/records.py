"""A run's capture, read back in the launcher process: every rank's summary, rank 0's
tensors (one file per step and point, loaded when compared)."""

from __future__ import annotations

import collections
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch

from harness.grad_check.script.capture import summary_file, tensors_file
from harness.grad_check.script.processes import Run


@dataclass(frozen=True)
class Captured:
    """What one run of the command left: its ranks' summaries (a rank that never stepped
    an optimizer has none)."""

    run: Run
    summaries: tuple[dict[str, Any] | None, ...]

    @classmethod
    def read(cls, run: Run) -> Captured:
        summaries = []
        for rank in range(run.split.world_size):
            path = summary_file(run.folder, rank)
            summaries.append(torch.load(path, weights_only=True) if path.exists() else None)
        return cls(run, tuple(summaries))

    @property
    def first(self) -> dict[str, Any]:
        """Rank 0's summary, which names the tensors rank 0 wrote."""
        return self.summaries[0] or {}

    @property
    def stepped(self) -> bool:
        return any(summary is not None for summary in self.summaries)

    @property
    def steps(self) -> int:
        """Optimizer steps captured on every rank."""
        return min((summary or {}).get("steps", 0) for summary in self.summaries)

    @property
    def names(self) -> list[str]:
        return list(self.first.get("names", []))

    @cached_property
    def dtypes(self) -> set[torch.dtype]:
        names = {name for summary in self.summaries if summary for name in summary["dtypes"]}
        return {getattr(torch, name.removeprefix("torch.")) for name in names}

    def tensors(self, step: int, point: str) -> dict[str, torch.Tensor | None]:
        """Rank 0's ``grad`` or ``params`` of ``step``, or its ``initial`` parameters."""
        return torch.load(tensors_file(self.run.folder, step, point), map_location="cpu",
                          weights_only=True)

    def before(self, step: int) -> dict[str, torch.Tensor | None]:
        """The parameters this run started ``step`` from."""
        return self.tensors(0, "initial") if step == 0 else self.tensors(step - 1, "params")

    def records(self, step: int) -> list[dict[str, Any]]:
        """Every rank's record of ``step``."""
        return [summary["records"][step] for summary in self.summaries if summary]

    def samples(self, step: int) -> collections.Counter[str]:
        """The samples the step's training forwards fed, over all ranks and micro-steps."""
        return collections.Counter(sample for record in self.records(step)
                                   for sample in record["samples"])

    def counts(self, step: int) -> tuple[int, ...]:
        """The labelled tokens of each of the step's training forwards, over all ranks."""
        return tuple(count for record in self.records(step) for count in record["counts"])

    def ranks_agree(self, step: int, point: str) -> bool | None:
        """Whether every rank held the same tensors at ``point`` (None at N = 1)."""
        if len(self.summaries) < 2:
            return None
        key = "grad_fingerprint" if point == "grad" else "params_fingerprint"
        return len({record[key] for record in self.records(step)}) == 1

    @property
    def dropout(self) -> list[str]:
        return list(self.first.get("dropout", []))

    @property
    def batchnorm(self) -> set[str]:
        return set(self.first.get("batchnorm", []))
