"""A run's capture, read back in the launcher process: every rank's summary, with what its
ranks compared with the reference's first run (harness/grad_check/script/points.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch

from harness.grad_check.script.explain import padding_of, tokens
from harness.grad_check.script.files import partial_file, summary_file
from harness.grad_check.script.naming import optimizer_label
from harness.grad_check.script.processes import SplitRun


@dataclass(frozen=True)
class RankDisagreement:
    """Ranks whose tensors differ from rank 0's at one point, and which tensors."""

    ranks: tuple[int, ...]
    tensors: tuple[str, ...]


@dataclass(frozen=True)
class Captured:
    """What one run of the command left: its ranks' summaries (a rank that never stepped
    an optimizer has none)."""

    run: SplitRun
    summaries: tuple[dict[str, Any] | None, ...]

    @classmethod
    def read(cls, run: SplitRun) -> Captured:
        """Each rank's summary, else what it kept up to its last finished step (a rank that
        crashed, hung or was stopped later: harness/grad_check/script/ending.py)."""
        summaries = []
        for rank in range(run.split.world_size):
            found = [path for path in (summary_file(run.folder, rank),
                                       partial_file(run.folder, rank)) if path.exists()]
            summaries.append(torch.load(found[0], weights_only=True) if found else None)
        return cls(run, tuple(summaries))

    @property
    def first(self) -> dict[str, Any]:
        """Rank 0's summary, which names the tensors rank 0 wrote."""
        return self.summaries[0] or {}

    @property
    def stepped(self) -> bool:
        return any(summary is not None for summary in self.summaries)

    # ---------------------------------------------------------------- optimizers
    @property
    def optimizers(self) -> list[dict[str, Any]]:
        """Each optimizer rank 0 stepped, in the order of its first step."""
        return list(self.first.get("optimizers", []))

    def label(self, optimizer: int) -> str:
        every = self.optimizers
        others = [o["names"] for i, o in enumerate(every) if i != optimizer]
        return optimizer_label(every[optimizer]["kind"], every[optimizer]["names"], others)

    def sharding(self, optimizer: int) -> str:
        """How the optimizer's tensors were spread over the ranks (sharded.py SHARDINGS)."""
        return str(self.optimizers[optimizer].get("sharding", "none"))

    def names(self, optimizer: int) -> list[str]:
        return list(self.optimizers[optimizer]["names"])

    def steps(self, optimizer: int) -> int:
        """Steps of ``optimizer`` captured on every rank."""
        return min((len(self._records_of(summary, optimizer)) for summary in self.summaries),
                   default=0)

    @property
    def total_steps(self) -> int:
        return sum(self.steps(o) for o in range(len(self.optimizers)))

    # ---------------------------------------------------------------- comparisons
    def compared(self, optimizer: int, step: int, point: str) -> dict[str, Any] | None:
        """What the ranks found comparing ``point`` of ``step`` with the reference's first
        run (the same on every rank: their sums combined); None: not compared."""
        record = self.records(optimizer, step)[0]
        return (record.get("compared") or {}).get(point)

    # ---------------------------------------------------------------- records
    @staticmethod
    def _records_of(summary: dict[str, Any] | None, optimizer: int) -> list[dict[str, Any]]:
        return [r for r in (summary or {}).get("records", []) if r["optimizer"] == optimizer]

    def records(self, optimizer: int, step: int) -> list[dict[str, Any]]:
        """Every rank's record of the optimizer's ``step``, in rank order."""
        return [self._records_of(summary, optimizer)[step] for summary in self.summaries
                if summary]

    def samples(self, optimizer: int, step: int) -> list[list[str]]:
        """The samples the step's training forwards fed, over all ranks and micro-steps."""
        return [sample for record in self.records(optimizer, step)
                for sample in record["samples"]]

    def indices(self, optimizer: int, step: int) -> list[int]:
        """The dataset indices of the batches the step's window was handed, over all
        ranks (empty where no DataLoader of a map-style dataset handed any)."""
        return [index for record in self.records(optimizer, step)
                for index in record.get("indices", [])]

    def counts(self, optimizer: int, step: int) -> tuple[int, ...]:
        """The labelled tokens of each of the step's training forwards, over all ranks;
        where the forwards took no ``labels`` (LitGPT computes its loss outside the model),
        the tokens of their samples, padding left out."""
        records = self.records(optimizer, step)
        labelled = tuple(count for record in records for count in record["counts"])
        if labelled:
            return labelled
        padding = padding_of([s for record in records for s in record["samples"]])
        counted = []
        for record in records:
            start = 0
            for size in record.get("per_forward", []):
                counted.append(tokens(record["samples"][start:start + size], padding))
                start += size
        return tuple(counted)

    def forwards(self, optimizer: int, step: int) -> list[int]:
        """Each rank's training forwards in the step's window (its micro-steps)."""
        return [record["forwards"] for record in self.records(optimizer, step)]

    def learning_rates(self, optimizer: int, step: int) -> list[float]:
        return list(self.records(optimizer, step)[0]["lrs"])

    def clips(self, optimizer: int, step: int) -> list[str]:
        return list(self.records(optimizer, step)[0]["clips"])

    def clip_calls(self, optimizer: int, step: int) -> int:
        """How many clips the step's window ran on rank 0 (more than one: per micro-step)."""
        return int(self.records(optimizer, step)[0].get("clip_calls", 0))

    def clip_factor(self, optimizer: int, step: int) -> float:
        """``||received|| / ||before the clip||`` on rank 0 (1 where nothing was clipped)."""
        record = self.records(optimizer, step)[0]
        before, received = record.get("before_norm"), record.get("received_norm")
        if before is None or received is None:
            return 1.0
        return received / before if before > 0 else math.nan

    def disagreement(self, optimizer: int, step: int, point: str) -> RankDisagreement | None:
        """The ranks whose tensors at ``point`` differ from rank 0's (None: all agree, or
        one rank)."""
        key = "grad_digests" if point == "grad" else "params_digests"
        records = self.records(optimizer, step)
        if len(records) < 2 or records[0].get(key) is None:  # each rank its own shard
            return None
        first = records[0][key]
        differing = {rank: [name for name, digest in record[key].items()
                            if not _same(digest, first.get(name))]
                     for rank, record in enumerate(records[1:], start=1)}
        differing = {rank: names for rank, names in differing.items() if names}
        if not differing:
            return None
        tensors = dict.fromkeys(name for names in differing.values() for name in names)
        return RankDisagreement(tuple(differing), tuple(tensors))

    def ranks_agree(self, optimizer: int, step: int, point: str) -> bool | None:
        """Whether every rank held the same tensors at ``point`` (None at N = 1, and where
        each rank held its own shard)."""
        key = "grad_digests" if point == "grad" else "params_digests"
        if len(self.summaries) < 2 or self.records(optimizer, step)[0].get(key) is None:
            return None
        return self.disagreement(optimizer, step, point) is None

    # ---------------------------------------------------------------- facts
    @cached_property
    def dtypes(self) -> set[torch.dtype]:
        names = {name for summary in self.summaries if summary for name in summary["dtypes"]}
        return {getattr(torch, name.removeprefix("torch.")) for name in names}

    @cached_property
    def model_dtypes(self) -> set[torch.dtype]:
        """The types of the parameters stepped."""
        names = {name for summary in self.summaries if summary
                 for name in summary.get("model_dtypes", ())}
        return {getattr(torch, name.removeprefix("torch.")) for name in names}

    @property
    def unknown(self) -> list[str]:
        return sorted({line for summary in self.summaries if summary
                       for line in summary.get("unknown", [])})

    @property
    def frameworks(self) -> set[str]:
        """The training frameworks the script imported (wire.py FRAMEWORK_MODULES)."""
        return set(self.first.get("frameworks", []))

    @property
    def dropout(self) -> list[str]:
        return list(self.first.get("dropout", []))

    @property
    def batchnorm(self) -> set[str]:
        return set(self.first.get("batchnorm", []))


def _same(a: float | None, b: float | None) -> bool:
    """Two digests of one tensor: equal, or both of a tensor that is not there."""
    if a is None or b is None:
        return a is b
    return a == b or (math.isnan(a) and math.isnan(b))
