"""Seed 000's experiment on real data: four update rules, one of which forgets ``zero_grad``.

The seed trains an MNIST CNN (convolutions + BatchNorm + ReLU + linear) with
manual SGD, once with ``torch.autograd.grad`` and ``p -= lr * g``, once with
``loss.backward()`` and ``p -= lr * p.grad`` without ever zeroing ``.grad``,
and finds the second "completely derails". Here the same model, adapted to
scikit-learn's 8x8 digits (shipped with the package: nothing is downloaded),
starts from the same seeded weights under four update rules:

- ``autograd.grad``: the seed's first loop;
- ``backward-no-zero``: the seed's second loop, ``.grad`` never zeroed;
- ``backward-zero-grad``: the second loop with ``zero_grad`` before each backward;
- ``optim.SGD``: ``torch.optim.SGD`` with ``zero_grad``.

Every epoch gives the train loss, the held-out accuracy, and the relative
parameter distance from the ``autograd.grad`` run. Each rule is also compared
with the one-process trajectory it is mathematically identical to (its *twin*):
the zeroed rules with ``autograd.grad``, and ``backward-no-zero`` with
``autograd.grad`` applying the running sum of every gradient so far. A twin
distance at rounding level is the measured proof that the two seed-000 rules
differ through gradient accumulation and nothing else.

Under ``ddp`` (N ranks, each forwarding its 1/N of every batch) the reference is
one process forwarding every rank's shard separately (per-shard BatchNorm
statistics, as DDP computes them) and averaging the N losses. ``autograd.grad``
never reaches the hooks through which DDP all-reduces, so under DDP its twin is
one process training on rank 0's shards alone, and the ranks drift apart
(``rank_spread``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from harness.context import RunContext
from harness.errors import UsageError
from harness.fit import relative_error
from harness.options import StudyOptions, option, parse_int
from harness.strategies import STRATEGIES as SPECS
from harness.strategies import step_cost
from harness.studies.base import Case, Study
from harness.studies.training.data import DIGITS_COUNT, Digits
from harness.studies.training.model import TrainingSetup, build_model
from harness.studies.training.schema import (
    COLUMNS,
    RANK0_ALONE,
    REFERENCE,
    RUNNING_SUM,
    UPDATE_RULES,
)
from harness.studies.training.trainer import EpochRecord, Feed, RuleTrainer
from harness.tolerances import close, relative_tolerance, trajectory_tolerance

STRATEGIES = ("local", "ddp")
#: Rough milliseconds of one training step of the CNN on 50 digits (float64, one CPU
#: thread, measured on a 2-core machine): only for balancing cases across ranks.
STEP_MS = 5.0


def _params_per_epoch(records: list[EpochRecord]) -> list[torch.Tensor]:
    return [record.params for record in records]


def _shared_twins(trainer: RuleTrainer, initial: nn.Module, world_size: int, rank: int,
                  group: dist.ProcessGroup) -> dict[str, list[torch.Tensor]] | None:
    """The DDP case's one-process twins, trained by the N ranks in turn (twin i on rank
    i mod N) instead of all on rank 0, and gathered on rank 0; None on the other ranks."""
    every_shard = Feed(world_size, tuple(range(world_size)))
    jobs = ((RUNNING_SUM, RUNNING_SUM, every_shard), (REFERENCE, REFERENCE, every_shard),
            (RANK0_ALONE, REFERENCE, Feed(world_size, (0,))))
    mine = {name: _params_per_epoch(trainer.train(initial, rule, feed))
            for i, (name, rule, feed) in enumerate(jobs) if i % world_size == rank}
    gathered: list[Any] | None = [None] * world_size if rank == 0 else None
    dist.gather_object(mine, gathered, dst=0, group=group)
    if gathered is None:
        return None
    return {name: params for part in gathered for name, params in part.items()}


def twin_of(strategy: str, rule: str) -> str | None:
    """The one-process trajectory ``rule`` under ``strategy`` is mathematically identical to."""
    if rule == "backward-no-zero":
        return RUNNING_SUM
    if rule == "autograd.grad":
        # One process: it is the reference. DDP: no all-reduce, so rank 0 trains alone.
        return RANK0_ALONE if SPECS[strategy].collective else None
    return REFERENCE


def ddp_world_sizes(run: RunContext) -> list[int]:
    """One DDP world size: the smallest N >= 2 of the run. Larger N add time, not insight:
    what autograd.grad and a forgotten zero_grad do under DDP does not depend on N."""
    return [n for n in run.world_sizes if n >= 2][:1]


# ------------------------------------------------------------------ study
#: Beyond this the study runs for hours on a CPU and shows nothing new after epoch 5.
MAX_EPOCHS = 100


@dataclass(frozen=True)
class TrainingOptions(StudyOptions):
    #: Epochs each update rule trains.
    epochs: int = field(default=5, metadata=option(
        "--epochs", "INT", "epochs of the training study", parse=parse_int))

    def __post_init__(self) -> None:
        if not 1 <= self.epochs <= MAX_EPOCHS:
            raise UsageError(f"--epochs {self.epochs} is not allowed; allowed: 1..{MAX_EPOCHS}")


class TrainingStudy(Study):
    name = "training"
    summary = ("seed 000 on scikit-learn's digits: autograd.grad vs backward() with and "
               "without zero_grad vs optim.SGD, per epoch, one process and DDP")
    example = ("torchrun --standalone --nproc_per_node=2 scripts/study.py --studies training "
               "--epochs 5")
    Options = TrainingOptions
    columns = COLUMNS

    def __init__(self, options: TrainingOptions | None = None,
                 setup: TrainingSetup | None = None) -> None:
        super().__init__(options)
        self.setup = setup or TrainingSetup()

    def cases(self, run: RunContext) -> list[Case]:
        steps = self.options.epochs * self._steps_per_epoch()
        cases, strategies = [], run.strategies(STRATEGIES)
        for strategy in strategies:
            if not SPECS[strategy].collective:
                # Four rules and the running-sum twin.
                cases.append(Case.of(self.name, cost=steps * 5 * STEP_MS, strategy=strategy,
                                     world_size=1))
                continue
            # Four DDP runs on every rank, then the three twins shared among the ranks.
            cases += [Case.of(self.name, participants=n, collective=True,
                              cost=steps * (4 * (STEP_MS + step_cost(strategy, n)) + 2 * STEP_MS),
                              strategy=strategy, world_size=n) for n in ddp_world_sizes(run)]
        return cases

    def _steps_per_epoch(self) -> int:
        samples = self.setup.train_samples or DIGITS_COUNT - self.setup.held_out
        return math.ceil(samples / self.setup.batch_size)

    def run_case(self, case: Case, run: RunContext) -> list[dict[str, Any]] | None:
        strategy, n = case["strategy"], case["world_size"]
        setup = self.setup
        digits = Digits.load(run.seed, run.dtype, run.device, setup.held_out,
                             setup.train_samples)
        trainer = RuleTrainer(digits, setup, self.options.epochs, run.device)
        initial = build_model(run.seed, setup, run.dtype)
        if SPECS[strategy].collective:
            group = run.group(n)
            rank = dist.get_rank(group)
            runs = {rule: trainer.train(initial, rule, Feed(n, (rank,)), group)
                    for rule in UPDATE_RULES}
            twins = _shared_twins(trainer, initial, n, rank, group)
            if twins is None:
                return None
        else:
            runs = {rule: trainer.train(initial, rule) for rule in UPDATE_RULES}
            twins = {REFERENCE: [record.params for record in runs["autograd.grad"]],
                     RUNNING_SUM: _params_per_epoch(trainer.train(initial, RUNNING_SUM))}
        rtol = trajectory_tolerance(run.dtype)
        return [self._row(case, rule, record, twins, rtol, relative_tolerance(run.dtype), digits)
                for rule in UPDATE_RULES for record in runs[rule]]

    def _row(self, case: Case, rule: str, record: EpochRecord,
             twins: dict[str, list[torch.Tensor]], rtol: float, gradient_rtol: float,
             digits: Digits) -> dict[str, Any]:
        twin = twin_of(case["strategy"], rule)
        twin_distance = (relative_error(record.params, twins[twin][record.epoch])
                         if twin else math.nan)
        return {
            "strategy": case["strategy"], "world_size": case["world_size"], "variant": rule,
            "epoch": record.epoch, "steps": record.steps,
            "batch_size": self.setup.batch_size, "learning_rate": self.setup.learning_rate,
            "train_samples": len(digits.train_y), "heldout_samples": len(digits.heldout_y),
            "train_loss": record.train_loss, "heldout_accuracy": record.heldout_accuracy,
            "param_distance": relative_error(record.params, twins[REFERENCE][record.epoch]),
            "twin": twin or "", "twin_distance": twin_distance,
            "identical_to_twin": twin_distance <= rtol if twin else None,
            "applied_grad_norm": record.applied_grad_norm,
            "fresh_grad_norm": record.fresh_grad_norm,
            "applied_is_fresh": (None if math.isnan(record.fresh_grad_norm) else
                                 close(record.applied_grad_norm, record.fresh_grad_norm,
                                       gradient_rtol)),
            "rank_spread": record.rank_spread,
            "applied_to_fresh": (record.applied_grad_norm / record.fresh_grad_norm
                                 if record.fresh_grad_norm else math.nan),
            "ranks_in_step": None if math.isnan(record.rank_spread) else record.rank_spread <= rtol,
            "status": "ok",
        }

    def summary_table(self, frame) -> str:
        last = frame[(frame["status"] == "ok") & (frame["epoch"] == frame["epoch"].max())]
        shown = last[["strategy", "world_size", "variant", "train_loss", "heldout_accuracy",
                      "param_distance", "twin", "twin_distance", "rank_spread"]]
        return "after the last epoch:\n" + shown.to_string(index=False)
