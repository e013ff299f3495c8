"""A run's capture, read back in the launcher process: every rank's summary, with what its
ranks compared with the reference's first run (harness/grad_check/script/points.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import torch

from harness.check.causes.evidence import RankDisagreement, clip_factor
from harness.grad_check.script.files import partial_file, summary_file
from harness.grad_check.script.naming import optimizer_label
from harness.grad_check.script.processes import SplitRun
from harness.grad_check.script.wire import OptimizerRecord, PointFit, RankSummary, StepRecord


@dataclass(frozen=True)
class Captured:
    """What one run of the command left: its ranks' summaries (a rank that never stepped
    an optimizer has none)."""

    run: SplitRun
    summaries: tuple[RankSummary | None, ...]

    @classmethod
    def read(cls, run: SplitRun) -> Captured:
        """Each rank's summary, else what it kept up to its last finished step (a rank that
        crashed, hung or was stopped later: harness/grad_check/script/ending.py)."""
        summaries = []
        for rank in range(run.split.world_size):
            found = [path for path in (summary_file(run.folder, rank),
                                       partial_file(run.folder, rank)) if path.exists()]
            summaries.append(RankSummary.from_json(torch.load(found[0], weights_only=True))
                             if found else None)
        return cls(run, tuple(summaries))

    @property
    def first(self) -> RankSummary:
        """Rank 0's summary, which names the tensors rank 0 wrote."""
        return self.summaries[0] or RankSummary()

    @property
    def ran_on(self) -> str:
        """Where the run's ranks ran, ``rank@host`` each (those that wrote a summary)."""
        return ",".join(f"{summary.rank}@{summary.host}" for summary in self.summaries
                        if summary is not None)

    @property
    def stepped(self) -> bool:
        return any(summary is not None for summary in self.summaries)

    # ---------------------------------------------------------------- optimizers
    @property
    def optimizers(self) -> list[OptimizerRecord]:
        """Each optimizer rank 0 stepped, in the order of its first step."""
        return list(self.first.optimizers)

    def label(self, optimizer: int) -> str:
        every = self.optimizers
        others = [o.names for i, o in enumerate(every) if i != optimizer]
        return optimizer_label(every[optimizer].kind, every[optimizer].names, others)

    def sharding(self, optimizer: int) -> str:
        """How the optimizer's tensors were spread over the ranks (sharded.py SHARDINGS)."""
        return self.optimizers[optimizer].sharding

    def names(self, optimizer: int) -> list[str]:
        return list(self.optimizers[optimizer].names)

    def steps(self, optimizer: int) -> int:
        """Steps of ``optimizer`` captured on every rank."""
        return min((len(self._records_of(summary, optimizer)) for summary in self.summaries),
                   default=0)

    def holds(self, steps: int) -> bool:
        """Whether every rank's summary holds ``steps`` steps of every optimizer."""
        return (all(summary is not None for summary in self.summaries)
                and all(self.steps(o) >= steps for o in range(len(self.optimizers))))

    @property
    def total_steps(self) -> int:
        return sum(self.steps(o) for o in range(len(self.optimizers)))

    # ---------------------------------------------------------------- comparisons
    def compared(self, optimizer: int, step: int, point: str) -> PointFit | None:
        """What the ranks found comparing ``point`` of ``step`` with the reference's first
        run (the same on every rank: their sums combined); None: not compared."""
        return self.records(optimizer, step)[0].compared.get(point)

    # ---------------------------------------------------------------- records
    @staticmethod
    def _records_of(summary: RankSummary | None, optimizer: int) -> list[StepRecord]:
        return [r for r in (summary.records if summary else []) if r.optimizer == optimizer]

    def records(self, optimizer: int, step: int) -> list[StepRecord]:
        """Every rank's record of the optimizer's ``step``, in rank order."""
        return [self._records_of(summary, optimizer)[step] for summary in self.summaries
                if summary]

    def samples(self, optimizer: int, step: int) -> list[list[str]]:
        """The samples the step's training forwards fed, over all ranks and micro-steps."""
        return [sample for record in self.records(optimizer, step)
                for sample in record.samples]

    def indices(self, optimizer: int, step: int) -> list[int]:
        """The dataset indices of the batches the step's window was handed, over all
        ranks (empty where no DataLoader of a map-style dataset handed any)."""
        return [index for record in self.records(optimizer, step)
                for index in record.indices]

    def counts(self, optimizer: int, step: int) -> tuple[int, ...]:
        """The labels each of the step's training losses counted (those not ignored), over
        all ranks. Only a loss's own targets are counted: a loss whose targets the capture
        does not see (in-batch negatives, a loss over pooled embeddings) has no count, and
        no cause of token counts is named for it (a text's length is not what weighs it)."""
        return tuple(count for record in self.records(optimizer, step) for count in record.counts)

    def not_finite(self, optimizer: int, step: int, point: str) -> list[str]:
        """The tensors at ``point`` of the step that held a NaN or an infinity on any rank."""
        return list(dict.fromkeys(name for record in self.records(optimizer, step)
                                  for name in record.non_finite.get(point, [])))

    def first_not_finite(self) -> tuple[int, int, str, list[str]] | None:
        """The first (optimizer, step, point, tensors) that held a NaN or an infinity."""
        for optimizer in range(len(self.optimizers)):
            for step in range(self.steps(optimizer)):
                for point in ("grad", "params"):
                    if names := self.not_finite(optimizer, step, point):
                        return optimizer, step, point, names
        return None

    def forwards(self, optimizer: int, step: int) -> list[int]:
        """Each rank's training forwards in the step's window (its micro-steps)."""
        return [record.forwards for record in self.records(optimizer, step)]

    def learning_rates(self, optimizer: int, step: int) -> list[float]:
        return list(self.records(optimizer, step)[0].lrs)

    def clips(self, optimizer: int, step: int) -> list[str]:
        return list(self.records(optimizer, step)[0].clips)

    def clip_calls(self, optimizer: int, step: int) -> int:
        """How many clips the step's window ran on rank 0 (more than one: per micro-step)."""
        return self.records(optimizer, step)[0].clip_calls

    def clip_factor(self, optimizer: int, step: int) -> float:
        """``||received|| / ||before the clip||`` on rank 0 (1 where nothing was clipped)."""
        return clip_factor(self.records(optimizer, step)[0])

    def disagreement(self, optimizer: int, step: int, point: str) -> RankDisagreement | None:
        """The ranks whose tensors at ``point`` differ from rank 0's (None: all agree, or
        one rank)."""
        records = self.records(optimizer, step)
        first = digests_of(records[0], point)
        if len(records) < 2 or first is None:  # each rank its own shard
            return None
        differing = {rank: [name for name, digest in (digests_of(record, point) or {}).items()
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
        if (len(self.summaries) < 2
                or digests_of(self.records(optimizer, step)[0], point) is None):
            return None
        return self.disagreement(optimizer, step, point) is None

    # ---------------------------------------------------------------- facts
    @cached_property
    def dtypes(self) -> set[torch.dtype]:
        names = {name for summary in self.summaries if summary for name in summary.dtypes}
        return {getattr(torch, name.removeprefix("torch.")) for name in names}

    @cached_property
    def model_dtypes(self) -> set[torch.dtype]:
        """The types of the parameters stepped."""
        names = {name for summary in self.summaries if summary
                 for name in summary.model_dtypes}
        return {getattr(torch, name.removeprefix("torch.")) for name in names}

    @property
    def unknown(self) -> list[str]:
        return sorted({line for summary in self.summaries if summary
                       for line in summary.unknown})

    @property
    def frameworks(self) -> set[str]:
        """The training frameworks the script imported (wire.py FRAMEWORK_MODULES)."""
        return set(self.first.frameworks)

    @property
    def dropout(self) -> list[str]:
        return list(self.first.dropout)

    @property
    def batchnorm(self) -> set[str]:
        return set(self.first.batchnorm)


def digests_of(record: StepRecord, point: str) -> dict[str, float] | None:
    """The digests of the point's tensors a rank holding whole copies wrote (None: each
    rank held its own shard)."""
    return record.grad_digests if point == "grad" else record.params_digests


def _same(a: float | None, b: float | None) -> bool:
    """Two digests of one tensor: equal, or both of a tensor that is not there."""
    if a is None or b is None:
        return a is b
    return a == b or (math.isnan(a) and math.isnan(b))
